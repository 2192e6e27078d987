"""OpenAI's `prompt_cache_key` becomes the Submit's cache mark on both of OpenAI's chat APIs: the prompt through its
last message, kept 5 minutes, or an hour for `prompt_cache_retention` "24h" (capped); no key, no mark."""

from __future__ import annotations

import pytest

from supervisor.errors import InvalidRequest
from supervisor.gateway.openai_api import parse_chat
from supervisor.gateway.responses_api import parse_responses

MESSAGES = [{"role": "system", "content": "Rules."}, {"role": "user", "content": "Hi"}]


def marks(api: str, **extra: object) -> list:
    if api == "chat":
        return parse_chat({"model": "m", "messages": MESSAGES, **extra}).submit.cache_mark
    body = {"model": "m", "instructions": "Rules.", "input": "Hi", **extra}
    return parse_responses(body, lambda rid: []).parsed.submit.cache_mark


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_prompt_cache_key_marks_the_whole_prompt_for_its_retention(api: str) -> None:
    assert marks(api) == [] and marks(api, prompt_cache_retention="24h") == []
    assert marks(api, prompt_cache_key="agent-1") == [[2, 300.0]]
    assert marks(api, prompt_cache_key="agent-1", prompt_cache_retention="in_memory") == [[2, 300.0]]
    assert marks(api, prompt_cache_key="agent-1", prompt_cache_retention="24h") == [[2, 3600.0]]


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("extra", [{"prompt_cache_key": ["k"]}, {"prompt_cache_key": "k" * 1025},
                                   {"prompt_cache_key": "k", "prompt_cache_retention": "1h"},
                                   {"prompt_cache_key": "k", "prompt_cache_retention": []}])  # unhashable: a 400
def test_a_bad_prompt_cache_key_or_retention_is_refused(api: str, extra: dict) -> None:
    with pytest.raises(InvalidRequest) as err:
        marks(api, **extra)
    assert err.value.param in extra
