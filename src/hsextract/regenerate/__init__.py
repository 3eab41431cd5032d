"""``hsextract regenerate``: the prompts of a data mix answered by the served target, written as a data source.

Drafters accept more tokens when they learn the target's own replies, so the responses of a mix are regenerated on
OpenAI-compatible servers (vLLM, SGLang) before states are extracted. ``config`` holds the options, ``turns`` turns
a row into the requests it needs and the row it becomes, ``client`` talks to the servers (retries, endpoints going
down), ``ledger`` is the output directory (chunks written whole, the settings record, what is done), ``runner``
drives them. No torch here: this is a light process.
"""
