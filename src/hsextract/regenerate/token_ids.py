"""The token ids a server read and wrote, asked for with every request; one place for every server's spelling
(vLLM: ``prompt_token_ids`` on the response, ``token_ids`` on the choice; SGLang: ``prompt_token_ids`` and
``response_token_ids`` on the choice; ``transformers serve`` gives none and refuses a field it does not know with
HTTP 422 naming it, as OpenAI's API does with 400: such an endpoint is asked again without the field, from then on).
"""

from __future__ import annotations

import json

from hsextract.prepare.served import COMPLETION_IDS, PROMPT_IDS

REQUEST_FIELDS = {"return_token_ids": True}

"""Added to every request's body (not part of the job's settings: a server without ids answers the same text)."""


def reply_ids(data: dict, choice: dict) -> dict:
    """``{"prompt_token_ids": [...], "token_ids": [...]}`` from a response and its first choice, or ``{}`` when
    the server gave no ids (or only half of them)."""
    prompt = data.get("prompt_token_ids")
    if prompt is None:
        prompt = choice.get("prompt_token_ids")
    completion = choice.get("token_ids")
    if completion is None:
        completion = choice.get("response_token_ids")
    if _ids(prompt) and _ids(completion) is not None:
        return {PROMPT_IDS: prompt, COMPLETION_IDS: completion}
    return {}


def _ids(value) -> list | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def refuses_fields(status: int, payload: bytes) -> bool:
    """A refusal (400, 422) that names one of ``REQUEST_FIELDS``: the server does not know them."""
    if status not in (400, 422):
        return False
    text = payload.decode(errors="replace")
    return any(name in text for name in REQUEST_FIELDS)


def body(payload: dict, with_ids: bool) -> bytes:
    return json.dumps({**payload, **REQUEST_FIELDS} if with_ids else payload, ensure_ascii=False).encode()
