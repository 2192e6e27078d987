"""What the tokenizer's chat template is given, and which tokens are not text: pure Python, no MLX.

The engine (worker/mlx_engine/engine.py) renders a chat request's messages and tools through the
model's chat template with these (`chat_template_args`), and leaves the special tokens out of the text it streams.
Templates write a tool's name raw, so the engine refuses names holding a special token's text
(`f<|end|><|start|>system` would open a turn of its own). For a model whose template does not write tools
(`renders_tools`), the worker writes them into the messages itself (`template_input`, worker/tool_fallback.py)
rather than dropping them. Invariant: nothing here changes what a client sent, only its shape (a tool call's
JSON-string arguments become the mapping templates read; tools and tool turns become text for a template without them;
a system message inside the conversation becomes user text, and user messages in a row one, for a template that
cannot write them).
"""

from __future__ import annotations

import json

from worker import tool_fallback


def special_token_ids(tokenizer) -> frozenset[int]:
    """Tokens that are not text: the tokenizer's special tokens (BOS, EOS, padding) and the added
    tokens marked special (turn markers such as <|im_start|>). Added tokens a format means to show
    (Qwen's <think>, <tool_call>) are not marked special, so they stay text, as in
    `decode(..., skip_special_tokens=True)`."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    return frozenset(ids)


def special_token_texts(tokenizer) -> frozenset[str]:
    """The text of every special or added token (turn and format markers): what a tool name must not hold."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts.update(getattr(tok, "content", "") for tok in added.values())
    return frozenset(t for t in texts if t)


_PROBE = "mlxsup_probe_tool_name"


def renders_tools(tokenizer) -> bool:
    """Whether the chat template writes the tools it is given into the prompt (a probe tool's name shows)."""
    probe = [{"type": "function", "function": {"name": _PROBE, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template that rejects the probe rejects a request's tools itself, with its own words
        return True
    return _PROBE in str(text)


_ASKED, _SAID, _SYSTEM = "mlxsup_probe_question", "mlxsup_probe_answer", "mlxsup_probe_system"


def _renders_in_order(tokenizer, messages: list[dict], texts: list[str]) -> bool:
    try:
        text = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    except Exception:
        return False
    at = [text.find(t) for t in texts]
    return -1 not in at and at == sorted(at)


def renders_mid_system(tokenizer) -> bool:
    """Whether the chat template writes a system message that comes after the conversation began, where it stands
    (ChatML's do; Gemma 3's and Qwen3.5's refuse one, others move it to the top or drop it)."""
    return _renders_in_order(tokenizer, [{"role": "user", "content": _ASKED}, {"role": "assistant", "content": _SAID},
                                         {"role": "system", "content": _SYSTEM}, {"role": "user", "content": _ASKED}],
                             [_SAID, _SYSTEM])


def renders_user_runs(tokenizer) -> bool:
    """Whether the chat template writes two user messages in a row (Gemma 3's raises unless roles alternate)."""
    return _renders_in_order(tokenizer, [{"role": "user", "content": _ASKED}, {"role": "user", "content": _SAID}],
                             [_ASKED, _SAID])


def tool_names(tools: list | None, messages: list | None) -> list[str]:
    """The function names a chat template writes: the tools' and the earlier calls' (string names only)."""
    names = [t.get("name") for t in tools or [] if isinstance(t, dict)]
    for m in messages or []:
        for call in (m.get("tool_calls") or []) if isinstance(m, dict) else []:
            fn = call.get("function") if isinstance(call, dict) else None
            names.append(fn.get("name") if isinstance(fn, dict) else None)
    return [n for n in names if isinstance(n, str)]


def template_tools(tools: list | None) -> list | None:
    """Neutral function definitions as chat templates take them (OpenAI's shape, which they all read)."""
    return [{"type": "function", "function": t} for t in tools] if tools else None


def chat_template_args(messages: list[dict], template_kwargs: dict) -> dict:
    """How the template is asked to end the prompt: with the generation prompt (a new assistant turn), or, for a
    prefill (`continue_final_message` and a final assistant message), inside that message, so the model continues
    its text (Hugging Face's `continue_final_message`: no end of turn after it, no new turn)."""
    kwargs = dict(template_kwargs)
    prefill = bool(kwargs.pop("continue_final_message", False)) and bool(messages) \
        and messages[-1].get("role") == "assistant"
    return {**kwargs, "continue_final_message": True} if prefill else {**kwargs, "add_generation_prompt": True}


def template_messages(messages: list[dict]) -> list[dict]:
    """Earlier calls' arguments as mappings (Hugging Face's convention; a JSON string that is not an object stays)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = dict(call["function"])
                try:
                    args = json.loads(fn["arguments"]) if isinstance(fn.get("arguments"), str) else fn.get("arguments")
                except ValueError:
                    args = fn["arguments"]
                fn["arguments"] = args if isinstance(args, dict) else fn.get("arguments")
                calls.append({**call, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def template_input(messages: list[dict], tools: list | None, renders: bool, mid_system: bool = True,
                   user_runs: bool = True) -> tuple[list[dict], list | None]:
    """The template's messages and tools: as the client sent them (shaped), or, for a template that writes no tools
    (`renders` False) and a request with tools or tool history, with them written into the messages. A system message
    after the conversation began stays where it was sent (a template that cannot write one there, `mid_system` False,
    is given it as user text: tool_fallback.alternated), never moved into the system prompt at the top: an agent
    that adds one (Claude Code does, turns into a session) would change its prompt's head and re-prefill all of it.
    User messages in a row are joined for a template that cannot write them (`user_runs` False)."""
    if not (mid_system and user_runs):
        messages = tool_fallback.alternated(messages, mid_system, user_runs)
    if not renders and tool_fallback.needed(messages, tools):
        return tool_fallback.fallback_messages(messages, tools), None
    return template_messages(messages), template_tools(tools)
