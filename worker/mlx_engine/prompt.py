"""A request's prompt as token ids, through the model's chat template: what request.py's `Requests.build` asks of
a prompt (`encode`), and what the prompt caches need of it (`marked`, `branch_ends`: ends of its prefixes).

`encode` renders chat messages through the template (messages and tools shaped as it takes them, template_input.py),
takes token ids as given (ids past the vocabulary refused, a RequestRejected: MLX's scatter does not check and would
write out of bounds), or encodes text. The model's prompt facts (vocabulary size, context length, strict_context)
live here for request.py's checks. Nothing here touches the model or the batch.
"""

from __future__ import annotations

import hashlib
import json

from mlx_lm.tokenizer_utils import TokenizerWrapper

from protocol.messages import INVALID_REQUEST, Submit
from worker.engine_api import RequestRejected
from worker.template_input import (
    chat_template_args,
    renders_mid_system,
    renders_tools,
    renders_user_runs,
    template_input,
)

HEADS_KEPT = 24  # rendered heads remembered: a few sessions' system prompts and tools, and their first turns' branches
MAX_BRANCHES = 4  # branch points looked for in a first user turn, of each kind (Prompts.branch_ends)


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` start with alike."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C: a head is most of an agent's prompt
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


class Prompts:
    def __init__(self, tokenizer: TokenizerWrapper, vocab_size: int, context_length: int,
                 strict_context: bool) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.strict_context = strict_context  # max_tokens past the context is refused, not clamped (request.py)
        self._renders_tools = renders_tools(tokenizer)
        self._mid_system = renders_mid_system(tokenizer)
        self._user_runs = renders_user_runs(tokenizer)
        self._heads: dict[bytes, list[int]] = {}  # marked heads' token ids by what they render (`_head`)

    def encode(self, msg: Submit) -> list[int]:
        if msg.messages is not None:
            try:
                shown, tools = self.shaped(msg.messages, msg.tools)
                return list(self.tokenizer.apply_chat_template(
                    shown, tools=tools, **chat_template_args(msg.messages, msg.template_kwargs)))
            except Exception as exc:  # a template can reject roles or shapes it does not know
                raise RequestRejected(INVALID_REQUEST, f"chat template rejected the messages: {exc}") from None
        if msg.prompt_ids is not None:
            if any(not 0 <= t < self.vocab_size for t in msg.prompt_ids if self.vocab_size):
                raise RequestRejected(INVALID_REQUEST, f"a prompt token id is outside the vocabulary "
                                                       f"(0-{self.vocab_size - 1})")
            return list(msg.prompt_ids)
        prompt = msg.prompt or ""
        bos = self.tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special))

    def shaped(self, messages: list[dict], tools: list | None) -> tuple[list[dict], list | None]:
        """The messages and tools as this model's template is given them (template_input.py)."""
        return template_input(messages, tools, self._renders_tools, self._mid_system, self._user_runs)

    def marked(self, msg: Submit, tokens: list[int], n: int) -> int:
        """How many of a chat prompt's `tokens` its first `n` messages cover (a `cache_mark`): those it shares with
        the template rendering only them (no generation prompt), so a mark ends where those messages' text does,
        whatever the template adds between turns."""
        if msg.messages is None:
            return 0
        if n >= len(msg.messages):
            return len(tokens)
        try:
            head = self._head(msg, max(n, 1))
        except Exception:  # a template that refuses a partial conversation: keep the whole prompt marked
            return len(tokens)
        return shared_prefix(head, tokens)

    def branch_ends(self, msg: Submit, tokens: list[int]) -> list[int]:
        """Where sessions that open as this prompt does branch off, in its `tokens` (ascending, none 0):
        - the end of the template's own preamble, before the first message's text (every session shares it:
          gpt-oss's is ~150 tokens, and opencode's title request shares only it with the session);
        - the end of its head (leading system messages and the tools: an agent's subagents share them);
        - in its first user turn, each user message's end before the last (Codex sends its environment as a user
          message before the task);
        - in the first user message, the end of each content block but the last (`Submit.branch_points`: Claude
          Code's system-reminders, the same for every session in a project, before the task).
        Each is found by rendering the prompt's start up to there and remembered (`_head`): a head is rendered with
        an empty user message after it, so a template that folds the system prompt into the first user turn
        (gemma3's) ends it there too; a template that refuses a partial conversation gives no end there."""
        messages = msg.messages or []
        n = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), 0)
        cuts: list[tuple[int, list[dict] | None]] = [(0, [{**messages[0], "content": ""}])] if messages else []
        cuts += [(n, [{"role": "user", "content": ""}])] if n else []
        turn = next((i for i, m in enumerate(messages) if m.get("role") != "user" and i >= n), len(messages))
        cuts += [(k, None) for k in range(n + 1, min(turn, n + MAX_BRANCHES + 1))]
        for point in msg.branch_points[:MAX_BRANCHES]:
            i, chars = point if isinstance(point, list | tuple) and len(point) == 2 else (-1, 0)
            text = messages[i].get("content") if isinstance(i, int) and 0 <= i < len(messages) else None
            if isinstance(text, str) and isinstance(chars, int) and 0 < chars < len(text):
                cuts.append((i, [{**messages[i], "content": text[:chars]}]))
        ends = set()
        for k, then in cuts:
            try:
                ends.add(shared_prefix(self._head(msg, k, then), tokens))
            except Exception:  # a template that refuses a partial conversation or an empty turn
                continue
        return sorted(e for e in ends if 0 < e < len(tokens))

    def _head(self, msg: Submit, n: int, then: list[dict] | None = None) -> list[int]:
        """The template's rendering of the first `n` messages alone (and `then`), remembered: an agent sends the
        same head (its system prompt and tools, most of a 30k-token prompt) on every turn, and often marks it twice
        in one request."""
        messages = (msg.messages or [])[:n] + (then or [])
        kwargs = {k: v for k, v in msg.template_kwargs.items() if k != "continue_final_message"}
        what = json.dumps([messages, msg.tools, kwargs], sort_keys=True, default=repr)
        key = hashlib.blake2b(what.encode(), digest_size=16).digest()
        head = self._heads.pop(key, None)
        if head is None:
            shown, tools = self.shaped(messages, msg.tools)
            head = list(self.tokenizer.apply_chat_template(shown, tools=tools, add_generation_prompt=False, **kwargs))
        self._heads[key] = head  # most recent last
        if len(self._heads) > HEADS_KEPT:
            del self._heads[next(iter(self._heads))]
        return head
