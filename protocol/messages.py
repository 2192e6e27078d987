"""Every message that crosses the supervisor <-> worker boundary, one typed class each.

Messages to the worker are imperative (Load, Submit, Abort, Evict, ClearCache, Tokenize, Embed, Rerank, Transcribe,
Speak); messages from it are facts (Standby, Progress, Ready, Tokens, Finished, Failed, Heartbeat, StepStarted, Pulse,
CacheStats, CacheCleared, Tokenized, Embedded, Reranked, Transcribed, SpokenPart, Spoken, Bye).
Fields hold only msgpack-native types (str, int, float, bool, None, list, dict) so the codec can
validate them without any custom serialisation; errors travel as data (a machine code and a message), never as
serialised exceptions.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import ClassVar

PROTOCOL_VERSION = 13  # 2: prompt caches (ClearCache, CacheCleared, CacheStats); 3: StepStarted;
# 4: resumed requests (Submit.resume_tokens, token ids in Tokens chunks and Finished); Submit's tools, template
# kwargs, constraint, logprobs, seed, penalties, prompt_ids; typed chunk extras; 5: Tokenize/Tokenized,
# Submit.reasoning_budget; 6: Embed/Embedded (embedding models); 7: Rerank/Reranked, Embed.input_type and
# Embed.instruction, Finished.drafted_tokens and accepted_tokens (speculative decoding),
# Submit.cache_mark and Finished.cache_written (prompt-cache breakpoints and usage); 8: Submit.branch_points;
# 9: Submit.more; 10: Pulse (the worker's watchdog); 11: Transcribe/Transcribed, Speak/Spoken (audio models);
# 12: Submit.speculative, Ready.drafting, Heartbeat.priced (drafting by default); 13: SpokenPart (speech sent as it
# is encoded)

# Machine codes carried by Failed and surfaced to HTTP clients as the error "code".
MODEL_EVICTED = "model_evicted"
WORKER_CRASHED = "worker_crashed"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
INVALID_REQUEST = "invalid_request"
ABORTED = "aborted"
INTERNAL_ERROR = "internal_error"
OVERLOADED = "overloaded"  # the worker cannot take this request now (e.g. its image decoders are all held): retry later

INPUT_TYPES = ("query", "document")  # Embed.input_type: which of the model's prompts prefixes a text input

EVICT_MODES = ("drain", "now")
CACHE_TIERS = ("hot", "ssd")  # ClearCache.which: the in-memory prefix cache or the on-disk one
CONTEXT_WINDOW = "context_window"  # a finish reason: max_tokens was clamped to the context, and the context ended it
FINISH_REASONS = ("stop", "length", "tool_calls", CONTEXT_WINDOW)

# Worker exit codes, distinct so the supervisor can tell a failed load from a crash.
EXIT_OK = 0
EXIT_LOAD_FAILED = 4
EXIT_PARENT_GONE = 5
EXIT_PROTOCOL = 6
EXIT_CRASHED = 7  # an unexpected exception escaped the worker's loop (its traceback is in the worker's log)

# Sent by the supervisor to a worker it is about to kill as hung: the worker's faulthandler writes
# every thread's Python stack to its stderr (the worker's log), so a hang leaves evidence.
DUMP_STACKS_SIGNAL = signal.SIGUSR1


@dataclass(slots=True)
class Message:
    KIND: ClassVar[str] = ""


# --- supervisor -> worker -------------------------------------------------------------


@dataclass(slots=True)
class Submit(Message):
    """Start one generation. Exactly one of `messages` (chat), `prompt` (completion text) or `prompt_ids`
    (completion token ids).

    API-neutral (the OpenAI, Anthropic and Responses shapes all map onto it): `tools` are function
    definitions ({"name", "description", "parameters"}) given to the chat template and to the output
    parser; `template_kwargs` are extra chat-template arguments (enable_thinking, reasoning_effort);
    `constraint` restricts decoding: {"type": "json", "schema": {...} | None} or {"type": "tool",
    "names": [allowed function names], "parallel": bool} (the worker writes the family's call format);
    `logprobs` is -1 for none, else the number of top alternatives per token (0-20); `logit_bias` is
    [[token_id, bias], ...]; a `seed` samples from its own random stream, whatever else is in the batch.

    `resume_tokens`: a continuation of a request an earlier worker of this model was running (it
    crashed or was evicted under it): the token ids it had generated and its client received. They
    follow the encoded prompt as its tail, are replayed through the text stream and the output parser
    (so what they hold back is what it was, and the next delta continues the client's text exactly) and
    count as completion tokens; `max_tokens` is what is left to generate (the supervisor reduced it).

    `reasoning_budget`: the most tokens the model may think for (Anthropic's thinking.budget_tokens); once
    spent, the worker closes the reasoning the family's way and the answer follows. None: the budget that
    `template_kwargs["reasoning_effort"]` maps to (worker/mlx_engine/budget.py), or none.
    `template_kwargs["continue_final_message"]`: the last message is the assistant's, to be continued (a
    prefill), not a finished turn.

    `cache_mark`: [[n, ttl_s], ...], Anthropic's `cache_control` breakpoints: the prompt's prefix through its first n
    `messages` (the tools with them) is kept ahead of other prefixes in the hot cache for ttl_s seconds.
    `branch_points`: [[i, chars], ...], where the first user message (`messages[i]`, text) ends a content block but its
    last: sessions of one agent in one project share those blocks (Claude Code's system-reminders) and branch at
    their task; a worker whose model caches only at snapshots (sliding-window, recurrent) snapshots there too.

    `more`: how many other generation requests the gateway had received and not yet submitted when this one left:
    a burst of clients reaches the daemon together but its worker a request at a time (the gateway's work on each),
    so a worker told more are coming waits a little for them before its next step (worker/loop.py).

    `images`: for a vision model, each image as [media_type ("image/png", "image/jpeg", ...), its encoded bytes
    (msgpack bin)], in the order of the `{"type": "image"}` parts of `messages`' contents (the gateway has turned
    every API's image block into such a part and checked the bytes); empty for a text request.
    """

    KIND: ClassVar[str] = "submit"
    rid: str
    max_tokens: int
    messages: list | None = None
    prompt: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: list = field(default_factory=list)
    ignore_eos: bool = False
    prompt_ids: list | None = None
    tools: list | None = None
    template_kwargs: dict = field(default_factory=dict)
    constraint: dict | None = None
    logprobs: int = -1
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list | None = None
    resume_tokens: list = field(default_factory=list)
    reasoning_budget: int | None = None
    images: list = field(default_factory=list)  # [[media_type, bytes], ...]: a vision model's images (docs/vision.md)
    cache_mark: list = field(default_factory=list)  # [[messages, ttl_s], ...]: prefixes to keep cached a while
    branch_points: list = field(default_factory=list)  # [[message, chars], ...]: the first user turn's block ends
    more: int = 0  # generation requests the gateway is still admitting, behind this one
    speculative: bool = True  # False: it never drafts (the API's "speculative": false), whatever the model's mode


@dataclass(slots=True)
class Tokenize(Message):
    """Count a request's prompt tokens exactly as a Submit of the same fields would encode them (chat template,
    tools, template kwargs), without generating or touching the batch; answered by Tokenized(rid).
    Exactly one of `messages` or `prompt`. `ids`: send the token ids too."""

    KIND: ClassVar[str] = "tokenize"
    rid: str
    messages: list | None = None
    prompt: str | None = None
    tools: list | None = None
    template_kwargs: dict = field(default_factory=dict)
    ids: bool = False


@dataclass(slots=True)
class Embed(Message):
    """To an embedding model's worker: one vector per input, answered by Embedded(rid). Each input is a text
    (tokenized with the model's special tokens) or a list of token ids (used as given). `truncate`: None
    refuses an input longer than the model's window; 0 cuts it to the window; n > 0 to its first n tokens.
    `dimensions`: keep the first n components and normalise again (None: all). `input_type` ("query",
    "document" or None) prefixes each text input with the model's prompt of that name (its sentence-transformers
    `prompts`), `instruction` a query with this task instead (in the model's own instruction format); token ids
    are never prefixed."""

    KIND: ClassVar[str] = "embed"
    rid: str
    inputs: list
    truncate: int | None = None
    dimensions: int | None = None
    input_type: str | None = None
    instruction: str | None = None


@dataclass(slots=True)
class Rerank(Message):
    """To a reranker's worker: a relevance score of each document for the query, answered by Reranked(rid).
    `instruction`: the task the model's prompt names (None: its default). `truncate`: each query-document pair
    is cut to the window (None or 0) or to its first n > 0 tokens; the document is cut, never the query."""

    KIND: ClassVar[str] = "rerank"
    rid: str
    query: str
    documents: list
    instruction: str | None = None
    truncate: int | None = None


@dataclass(slots=True)
class Transcribe(Message):
    """To a speech-to-text model's worker: the text of one audio file, answered by Transcribed(rid). `audio` is the
    file's bytes as the client sent them (msgpack bin; the worker finds its format from its bytes, not from
    `media_type`, and decodes it on a thread); `task` "transcribe" or "translate" (to English); `language` an ISO-639-1
    code or None (detected); `prompt` the text the first window is conditioned on; `words`: word timestamps too;
    `max_audio_s`: a longer file is refused (0: no limit)."""

    KIND: ClassVar[str] = "transcribe"
    rid: str
    audio: bytes
    media_type: str = ""
    task: str = "transcribe"
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    words: bool = False
    max_audio_s: float = 0.0


@dataclass(slots=True)
class Speak(Message):
    """To a text-to-speech model's worker: `input` spoken in `voice` (None: the model's first) at `speed`, encoded as
    `response_format` (wav, flac, mp3, opus, pcm: worker/audio_codec.py), answered by Spoken(rid)."""

    KIND: ClassVar[str] = "speak"
    rid: str
    input: str
    voice: str | None = None
    speed: float = 1.0
    response_format: str = "wav"


@dataclass(slots=True)
class Load(Message):
    """To a spare worker on standby: become this model's worker. `args` are the model's worker
    command-line arguments (--model-path, --model-id, ...), exactly as a fresh worker gets them."""

    KIND: ClassVar[str] = "load"
    args: list


@dataclass(slots=True)
class Abort(Message):
    KIND: ClassVar[str] = "abort"
    rid: str


@dataclass(slots=True)
class Evict(Message):
    """Run the orderly exit: stop admitting, abort or drain, close caches, settle, bye."""

    KIND: ClassVar[str] = "evict"
    mode: str = "now"
    deadline_s: float = 10.0


@dataclass(slots=True)
class ClearCache(Message):
    """Drop every entry of one cache tier (`which` in CACHE_TIERS); answered by CacheCleared(rid)."""

    KIND: ClassVar[str] = "clear_cache"
    rid: str
    which: str


# --- worker -> supervisor -------------------------------------------------------------


@dataclass(slots=True)
class Ready(Message):
    KIND: ClassVar[str] = "ready"
    model_id: str
    pid: int
    context_length: int
    vocab_size: int
    weights_bytes: int
    memory_bytes: int
    load_s: float
    drafting: str = ""  # what its requests draft with: "off", "prompt-lookup", "draft" ("": it generates no text)


@dataclass(slots=True)
class Standby(Message):
    """A spare worker has paid its imports and waits for a Load."""

    KIND: ClassVar[str] = "standby"
    pid: int


@dataclass(slots=True)
class Progress(Message):
    """Load progress, before Ready: a stage name and the fraction of the weights in memory."""

    KIND: ClassVar[str] = "progress"
    stage: str
    fraction: float


@dataclass(slots=True)
class Tokens(Message):
    """Deltas produced by one engine step, coalesced: [[rid, text, n_tokens, token_ids], ...], where `text`
    is answer text; a chunk may carry a fifth element, a dict of typed extras: "reasoning" (text), "calls"
    ([[index, id, name, arguments_piece], ...]: id and name only in a call's first piece) and "logprobs"
    ([[token_text, logprob, [[alt_text, alt_logprob], ...]], ...], one per token).

    `token_ids` are the n_tokens generated since the request's previous chunk (a token whose output
    is held back travels with the next chunk that says something), so the ids a supervisor has
    received are exactly the ones whose output it has: what a resumed request continues from."""

    KIND: ClassVar[str] = "tokens"
    chunks: list


@dataclass(slots=True)
class Finished(Message):
    KIND: ClassVar[str] = "finished"
    rid: str
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    token_ids: list = field(default_factory=list)  # generated since the request's last Tokens chunk
    extra: dict | None = None  # the last deltas' typed extras, as in a Tokens chunk; "stop_sequence": the stop hit
    drafted_tokens: int = 0  # speculative decoding: tokens drafted and verified, and how many of them were kept
    accepted_tokens: int = 0
    cache_written: int = 0  # prompt tokens not read from the caches that the worker keeps in them for later requests


@dataclass(slots=True)
class Failed(Message):
    KIND: ClassVar[str] = "failed"
    rid: str
    code: str
    message: str


@dataclass(slots=True)
class Heartbeat(Message):
    """Sent from the generation loop itself, so it proves progress, not just a live socket."""

    KIND: ClassVar[str] = "heartbeat"
    active: int
    waiting: int
    batch_size: int
    max_batch_size: int
    generated_tokens: int
    memory_bytes: int
    priced: bool = False  # what drafting costs on this machine is measured (its idle work, after Ready): it may draft


@dataclass(slots=True)
class StepStarted(Message):
    """The generation loop starts an engine step predicted to take `predicted_s`: sent only for steps
    predicted to take a sizeable part of a heartbeat interval (never per decode token), so the
    supervisor can tell a slow step from a stuck one. The work it holds: prompt tokens it
    prefills (padded, all sequences) and sequences it decodes."""

    KIND: ClassVar[str] = "step_started"
    predicted_s: float
    prefill_tokens: int
    decoding: int


# The worker's watchdog sends from a socket of its own, under its worker's identity with this suffix.
WATCH_SUFFIX = b"#watch"


@dataclass(slots=True)
class Pulse(Message):
    """From the worker's watchdog thread (worker/watchdog.py), not its loop: one turn of the generation loop has run
    `turn_s` seconds, and in the last `window_s` the main thread sat in one native call (an MLX evaluation, where
    `where` names the Python line that made it) while the process used `cpu_s` seconds of CPU: slow, not stuck. Sent
    only then, so a stopped, deadlocked or Python-spinning worker stays silent and is still caught as hung."""

    KIND: ClassVar[str] = "pulse"
    turn_s: float
    window_s: float
    cpu_s: float
    where: str


@dataclass(slots=True)
class CacheStats(Message):
    """The worker's prompt caches, sent with every heartbeat. Entries are KV blocks.

    hits/misses count lookups (one per request whose prompt spans at least one block); the
    SSD tier is consulted only for what the hot tier did not have. `ssd_error` says why the
    SSD tier is off (unwritable directory, full disk), None while it works or was never asked for.
    """

    KIND: ClassVar[str] = "cache_stats"
    block_tokens: int
    hot_entries: int
    hot_bytes: int
    hot_budget_bytes: int
    hot_hits: int
    hot_misses: int
    hot_hit_tokens: int
    ssd_enabled: bool
    ssd_entries: int
    ssd_bytes: int
    ssd_cap_bytes: int
    ssd_hits: int
    ssd_misses: int
    ssd_hit_tokens: int
    ssd_dir: str | None = None
    ssd_error: str | None = None


@dataclass(slots=True)
class CacheCleared(Message):
    """The answer to ClearCache: what was dropped, in bytes actually given back (memory or disk)."""

    KIND: ClassVar[str] = "cache_cleared"
    rid: str
    which: str
    entries: int
    reclaimed_bytes: int


@dataclass(slots=True)
class Tokenized(Message):
    """The answer to Tokenize: the prompt's token count (and ids, when asked), or why a Submit of it would be
    refused (`code`, `message`: as Failed's, count 0)."""

    KIND: ClassVar[str] = "tokenized"
    rid: str
    count: int
    ids: list = field(default_factory=list)
    code: str | None = None
    message: str = ""


@dataclass(slots=True)
class Embedded(Message):
    """The answer to Embed: a vector per input, in the inputs' order, and the tokens they took; or why not
    (`code`, `message`: as Failed's, no vectors)."""

    KIND: ClassVar[str] = "embedded"
    rid: str
    vectors: list = field(default_factory=list)
    tokens: int = 0
    code: str | None = None
    message: str = ""


@dataclass(slots=True)
class Reranked(Message):
    """The answer to Rerank: a score per document, in the documents' order (higher is more relevant), and the
    tokens the pairs took; or why not (`code`, `message`: as Failed's, no scores)."""

    KIND: ClassVar[str] = "reranked"
    rid: str
    scores: list = field(default_factory=list)
    tokens: int = 0
    code: str | None = None
    message: str = ""


@dataclass(slots=True)
class Transcribed(Message):
    """The answer to Transcribe: the text, the language, the audio's length in seconds and its segments
    ([{"id", "start", "end", "text", "tokens", "temperature", "avg_logprob", "compression_ratio", "no_speech_prob",
    "words": [{"word", "start", "end", "probability"}, ...] when asked}, ...], times in seconds from the file's start);
    or why not (`code`, `message`: as Failed's)."""

    KIND: ClassVar[str] = "transcribed"
    rid: str
    text: str = ""
    language: str = ""
    duration: float = 0.0
    segments: list = field(default_factory=list)
    code: str | None = None
    message: str = ""


@dataclass(slots=True)
class SpokenPart(Message):
    """Part of a Speak's answer, sent as soon as it is encoded, before the Spoken that ends it: the next bytes of the
    response (`audio`: the encoded speech at `sample_rate`). The parts' bytes in order, then Spoken's, are the whole
    response; a request withdrawn or failed after some parts ends with a Spoken with a code."""

    KIND: ClassVar[str] = "spoken_part"
    rid: str
    audio: bytes
    sample_rate: int


@dataclass(slots=True)
class Spoken(Message):
    """The end of a Speak's answer: the speech's last bytes, encoded as asked (msgpack bin; after its SpokenParts'
    bytes, or the whole response when there were none), `samples` in all at `sample_rate`; or why not (`code`,
    `message`: as Failed's)."""

    KIND: ClassVar[str] = "spoken"
    rid: str
    audio: bytes = b""
    sample_rate: int = 0
    samples: int = 0
    code: str | None = None
    message: str = ""


@dataclass(slots=True)
class Bye(Message):
    """The last message of a worker that exits in order; phases maps phase -> seconds."""

    KIND: ClassVar[str] = "bye"
    reason: str
    aborted: int
    drained: int
    phases: dict
    memory_bytes: int


ALL_MESSAGES: tuple[type[Message], ...] = (
    Submit,
    Load,
    Abort,
    Evict,
    ClearCache,
    Tokenize,
    Embed,
    Rerank,
    Transcribe,
    Speak,
    Standby,
    Ready,
    Progress,
    Tokens,
    Finished,
    Failed,
    Heartbeat,
    StepStarted,
    Pulse,
    CacheStats,
    CacheCleared,
    Tokenized,
    Embedded,
    Reranked,
    Transcribed,
    SpokenPart,
    Spoken,
    Bye,
)
