"""A Submit as the engine runs it: `Requests.build` turns one Submit, once, into a frozen EngineRequest; nothing after
it (the engine's start, its lanes, its output) reads the Submit again.

The Submit's way, in order, every step a call from `build` that returns here:
1. `_check_ids`: logit_bias ids past the vocabulary, and tool names holding a special token's text, are refused;
2. the prompt's ids: a request with images through the engine's vision part (vision.py's VisionInput: the chat
   template, then the model's processor expands each image's tokens), any other through prompt.py's Prompts (a
   chat's messages through the template, token ids as given and checked, or text);
3. `_budget`: a resumed request's earlier tokens appended (checked), and max_tokens sized to the room the context
   leaves (a ceiling: stopped there, the request finishes as "context_window"; refused only when the prompt leaves
   no room, or, with strict_context, when max_tokens does not fit);
4. its decoding (decoding.py's `setup`): sampler, logits processors (penalties, grammar, reasoning budget, a test's
   hooks), output (text stream, parser, logprobs);
5. its drafting (speculative.py), where its processors allow it: none, or only its grammar;
6. what the prompt caches need of it: its key ids (an image's run keyed by its pixels), the ends of its
   cache_control marks and where sibling sessions branch off it (prompt.py's `marked` and `branch_ends`).
The engine then starts it (engine.py's `_start`): its prefix looked up, and the solo lane when it is alone and
`alone_ok`, else the batch.

Invariants: whatever would index past the vocabulary (prompt ids, logit_bias ids, resume tokens) is refused here, as
a RequestRejected, because MLX's scatter does not check and would write out of bounds; a tool name holding a special
token's text is refused, so no client puts control tokens into a template; `tokenize` encodes and checks as `build`
does and nothing more; nothing here touches the model, the batch or what the caches hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from protocol.messages import CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST, Submit
from worker.engine_api import RequestRejected
from worker.mlx_engine.decoding import Decoding, RequestDecoding
from worker.mlx_engine.prompt import Prompts
from worker.mlx_engine.prompt_cache import PromptCaches
from worker.mlx_engine.speculative import Drafting, Speculation
from worker.template_input import special_token_texts, tool_names


class ImagePrompt(Protocol):
    """A prompt with images as a vision part made it (vision.py's Processed): its ids, each image's tokens expanded."""

    ids: list[int]


class ImagePart(Protocol):
    """A vision-language model's part of the request path (vision.py's VisionInput, given to the engine)."""

    def encode(self, msg: Submit, pictures: list | None = None) -> Any:
        """A request with images as the model takes it: an ImagePrompt."""
        ...

    def keys(self, processed: Any, tokens: list[int]) -> list[int]: ...

    def prefill(self, rid: str, tokens: list[int], cached: int, prefix: list | None,
                processed: Any) -> tuple[int, list, int] | None: ...


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the engine runs it, made once from its Submit (`Requests.build`)."""

    rid: str
    tokens: list[int]  # the prompt's ids, then a resumed request's earlier tokens: what the request's cache will hold
    prompt_tokens: int  # how many of `tokens` are the prompt's
    max_tokens: int  # what the context leaves, at most the Submit's
    clamped: bool  # max_tokens reaches the context's end: stopping there is the context's doing
    resumed: int  # tokens generated before (Submit.resume_tokens): its completion tokens start there
    ignore_eos: bool
    seeded: bool  # its sampler is its seed's stream of draws (the solo never builds ahead for it: solo.py)
    alone_ok: bool  # it needs nothing only the batch has (logits processors, logprobs): it may run as the solo
    decoding: RequestDecoding  # sampler, processors, output, grammar
    drafting: Drafting | None
    keys: list[int]  # the ids the prompt caches know it by: `tokens` itself, but for an image's (vision.py)
    marks: tuple[tuple[int, float], ...] = ()  # (end in tokens, ttl_s) of each cache_control mark (caches on)
    branches: tuple[int, ...] = ()  # where sibling sessions branch off it, for the caches' snapshot points
    images: ImagePrompt | None = None  # a prompt with images, as the vision part made it (its image prefill reads it)


class Requests:
    """The engine's one way from a Submit to an EngineRequest (the module's docstring)."""

    def __init__(self, prompts: Prompts, decoding: Decoding, speculation: Speculation, caches: PromptCaches | None,
                 vision: ImagePart | None = None) -> None:
        self.prompts = prompts
        self.decoding = decoding
        self.speculation = speculation
        self.caches = caches
        self.vision = vision
        self._special_texts = special_token_texts(prompts.tokenizer)

    def tokenize(self, msg: Submit) -> list[int]:
        """The prompt's token ids as `build` would encode and check them."""
        self._check_ids(msg)
        return self._encode(msg, None)[0]

    def build(self, msg: Submit, pictures: list | None = None) -> EngineRequest:
        """The request `msg` asks for (`pictures`: its images, decoded already; None: decoded here if it has any)."""
        self._check_ids(msg)
        tokens, images = self._encode(msg, pictures)
        tokens, prompt_tokens, max_tokens = self._budget(msg, tokens)
        prompt = tokens[:prompt_tokens]
        d = self.decoding.setup(msg, prompt)
        drafting = self.speculation.drafting(msg) if not d.processors or d.processors == [d.grammar] else None
        keys = self.vision.keys(images, tokens) if self.vision is not None and images is not None else tokens
        marks: tuple[tuple[int, float], ...] = ()
        branches: tuple[int, ...] = ()
        if (caches := self.caches) is not None:
            marks = tuple((self.prompts.marked(msg, prompt, int(n)), float(ttl_s)) for n, ttl_s in msg.cache_mark)
            if caches.layout.snapshots and caches.enabled:
                branches = tuple(self.prompts.branch_ends(msg, prompt))
        return EngineRequest(msg.rid, tokens, prompt_tokens, max_tokens,
                             clamped=max_tokens < msg.max_tokens or not msg.max_tokens,
                             resumed=len(msg.resume_tokens), ignore_eos=msg.ignore_eos,
                             seeded=msg.seed is not None,
                             alone_ok=not d.processors and msg.logprobs < 0, decoding=d, drafting=drafting, keys=keys, marks=marks, branches=branches, images=images)

    def _encode(self, msg: Submit, pictures: list | None) -> tuple[list[int], ImagePrompt | None]:
        if self.vision is not None and msg.images:
            images: ImagePrompt = self.vision.encode(msg, pictures)
            return list(images.ids), images
        return self.prompts.encode(msg), None

    def _budget(self, msg: Submit, tokens: list[int]) -> tuple[list[int], int, int]:
        """(the tokens to run: the prompt, then a resumed request's earlier tokens; how many are the prompt's;
        the max_tokens that fits the context)."""
        if not tokens:
            raise RequestRejected(INVALID_REQUEST, "the prompt is empty")
        prompt_tokens = len(tokens)
        tokens += self._resume_tokens(msg)
        context, room = self.prompts.context_length, self.prompts.context_length - len(tokens)
        max_tokens = min(msg.max_tokens or room, room)
        if max_tokens <= 0 or (self.prompts.strict_context and msg.max_tokens > room):
            raise RequestRejected(
                CONTEXT_LENGTH_EXCEEDED,
                f"this model's maximum context length is {context} tokens; the prompt has "
                f"{len(tokens)} tokens and max_tokens asks for {msg.max_tokens or 'the rest'}",
            )
        return tokens, prompt_tokens, max_tokens

    def _check_ids(self, msg: Submit) -> None:
        """Refuse what would index past the vocabulary (mlx's scatter does not check: it would write out of
        bounds) or put special-token text into the prompt through a tool's name."""
        tokenizer = self.prompts.tokenizer
        vocab = self.prompts.vocab_size or len(tokenizer.get_vocab())
        for pair in msg.logit_bias or []:
            t = pair[0] if isinstance(pair, list | tuple) and len(pair) == 2 else None
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise RequestRejected(INVALID_REQUEST, f"logit_bias holds a token id outside the vocabulary "
                                                       f"(0-{vocab - 1})")
        for name in tool_names(msg.tools, msg.messages):
            if any(text in name for text in self._special_texts):
                raise RequestRejected(INVALID_REQUEST, f"the tool name {name[:80]!r} holds a special token's text")

    def _resume_tokens(self, msg: Submit) -> list[int]:
        """A resumed request's earlier tokens, checked: ids this vocabulary has."""
        ids, vocab = msg.resume_tokens, self.prompts.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or 0 < vocab <= t for t in ids):
            raise RequestRejected(INVALID_REQUEST, "resume_tokens must be token ids of this model's vocabulary")
        return list(ids)
