"""``hsextract regenerate``: the prompts of a data mix answered by the served target, written as a data source.

Drafters accept more tokens when they learn the target's own replies, so a mix's responses are regenerated on
OpenAI-compatible servers (vLLM, SGLang) before states are extracted. No torch here: this is a light process.
"""
