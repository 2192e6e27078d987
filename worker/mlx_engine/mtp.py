"""Multi-token prediction (MTP) heads: the drafter a checkpoint ships with itself.

Qwen3.5 (and Qwen3.6) checkpoints carry an `mtp.*` module trained with the model: from the target's last hidden
state h_p (after its final norm) and the embedding of the token x_{p+1} that followed it, one extra decoder layer
predicts x_{p+2}: fc([norm_e(embed(x_{p+1})), norm_h(h_p)]) -> a full-attention decoder layer (with a K/V cache of
its own) -> norm -> the target's own lm_head. Drafting k tokens chains it: its output after d_i is the hidden state
d_{i+1} is drafted from. mlx-lm drops these weights on load (qwen3_5's sanitize); `load_head` reads them from the
checkpoint's safetensors itself, in the layout vLLM and SGLang read (`mtp.fc`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`), the norms shifted by one where mlx-lm shifts the model's
(an original Hugging Face checkpoint's zero-centred RMSNorm), quantized where the checkpoint quantized them.

The target's hidden states come from a tap on its final norm (taps.py); the solo hands each forward pass's to the
request's `MTPDrafter` (`see`, with the positions they are at), compiled or not. The head's
cache holds one pair (h_p, x_{p+1}) per position from the first position the request prefilled (after a prefix-cache
hit its attention starts there: rotary positions are relative, so only the context it sees is shorter); a pair is
fed once both halves are known (`_pair`: a prompt's as it is prefilled, a generated token's at the next proposal),
and a proposal's chained pairs are trimmed back after it. A verification's hidden states are the kept tokens' only
(`keep`). A batch row has no tap: there the drafter proposes nothing (its hidden states stop at the hand-over).

Only dense heads of one layer are loaded (Qwen3.5's and Qwen3.6's dense models); an MoE checkpoint's head (the
A3B models) or one of several layers is left out with a log line, the model serving without it.

Invariants: the head's cache holds pairs for positions [base, base + fed) of the request's history, all of them
verified tokens'; `rows` are the target's hidden states at positions [base + fed, ...) not yet paired.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from worker.mlx_engine.taps import Seen, text_model

log = logging.getLogger(__name__)

PAIR_CHUNK = 512  # a catch-up's pairs fed in chunks of this many (a long prompt's, the first time)
EAGER = 64  # pairable rows at which `see` feeds them at once (a prompt's prefill), not at the next proposal


def _header(path: Path) -> dict:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return cast(dict, json.loads(f.read(n)))


class MTPHead(nn.Module):
    """Qwen3.5's MTP module: the target's embedding and lm_head, a fusion, one full-attention decoder layer."""

    def __init__(self, args: Any, embed: nn.Embedding, lm_head: nn.Module | None) -> None:
        from mlx_lm.models.qwen3_5 import DecoderLayer

        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = [DecoderLayer(args, args.full_attention_interval - 1)]  # a full-attention layer
        self.norm = nn.RMSNorm(h, eps=eps)
        self._target = (embed, lm_head)  # a tuple: not this module's parameters

    def __call__(self, ids: mx.array, hidden: mx.array, cache: list) -> mx.array:
        """The head's hidden states for pairs (hidden[:, i], ids[:, i]), shape (1, L, H)."""
        embed = self._target[0]
        x = mx.concatenate([self.pre_fc_norm_embedding(embed(ids)), self.pre_fc_norm_hidden(hidden)], axis=-1)
        x = self.fc(x)
        x = self.layers[0](x, create_attention_mask(x, cache[0]), cache[0])
        return self.norm(x)

    def logits(self, out: mx.array) -> mx.array:
        embed, lm_head = self._target
        return lm_head(out) if lm_head is not None else embed.as_linear(out)

    def make_cache(self) -> list:
        return [KVCache()]


class HeadStep(nn.Module):
    """One draft step of a head as a model (ids, cache) -> logits, for draft_pricing's timing of a draft step."""

    def __init__(self, head: MTPHead) -> None:
        super().__init__()
        self._head = (head,)

    def __call__(self, ids: mx.array, cache: list) -> mx.array:
        head = self._head[0]
        hidden = mx.zeros((*ids.shape, head.fc.weight.shape[0]), head.norm.weight.dtype)
        return head.logits(head(ids, hidden, cache))

    def make_cache(self) -> list:
        return self._head[0].make_cache()


def load_head(model: nn.Module, path: Path) -> MTPHead | None:
    """The checkpoint's MTP head, on `model`'s embedding and lm_head, evaluated; None where it has none we load."""
    files = sorted(path.glob("model*.safetensors"))
    headers = {f: _header(f) for f in files}
    keys = {k: f for f, h in headers.items() for k in h if k != "__metadata__" and "mtp." in k}
    if not keys:
        return None
    lm: Any = getattr(model, "language_model", model)
    args = getattr(lm, "args", None)
    inner = text_model(model)
    if args is None or inner is None or getattr(args, "model_type", "").split("_text")[0] not in ("qwen3_5",):
        log.warning("[mtp] %s has MTP weights mlxsup does not load for %s", path.name, type(model).__module__)
        return None
    config = json.loads((path / "config.json").read_text())
    text = {**config, **(config.get("text_config") or {})}
    if int(text.get("mtp_num_hidden_layers", 1)) != 1 or getattr(args, "num_experts", 0) > 0:
        log.warning("[mtp] %s: only a dense head of one layer is loaded (this one: %s layers, %s experts); "
                    "serving without it", path.name, text.get("mtp_num_hidden_layers", 1), args.num_experts)
        return None
    raw: dict[str, mx.array] = {}
    for f in sorted(set(keys.values())):
        loaded = cast(dict[str, mx.array], mx.load(str(f)))  # lazy: only the head's arrays are read
        raw.update({k: v for k, v in loaded.items() if k in keys})
    weights = {k[k.index("mtp.") + 4:]: v for k, v in raw.items()}
    # mlx-lm shifts a Hugging Face checkpoint's norms by one (zero-centred RMSNorm) where its conv1d is unconverted
    hf = any(k.endswith("conv1d.weight") and h[k]["shape"][-1] != 1 for h in headers.values() for k in h
             if k != "__metadata__")
    if hf:
        weights = {k: v + 1.0 if k.endswith("norm.weight") and v.ndim == 1 else v for k, v in weights.items()}
    head = MTPHead(args, inner.embed_tokens, None if args.tie_word_embeddings else lm.lm_head)
    if any(k.endswith(".scales") for k in weights):
        q = config.get("quantization") or {}
        nn.quantize(head, group_size=q.get("group_size", 64), bits=q.get("bits", 4),
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    head.load_weights(list(weights.items()), strict=True)
    mx.eval(head.parameters())
    return head


def pick(logprobs: mx.array, sampling: Any, key: mx.array | None) -> tuple[mx.array, mx.array | None]:
    """A draft token from a drafter's logprobs (1, vocab): argmax where greedy, else a draw (with a seeded request's
    `key`), and the draw's probabilities."""
    if sampling is None:
        return mx.argmax(logprobs, axis=-1).astype(mx.uint32), None
    logits = sampling.logits(logprobs)
    return mx.random.categorical(logits, key=key).astype(mx.uint32), mx.softmax(logits, axis=-1)


class MTPDrafter(Seen):
    """A head's proposals for one request (the module says how its cache follows the request's history)."""

    def __init__(self, head: MTPHead) -> None:
        self.head = head
        super().__init__()

    def fresh(self) -> list:
        return self.head.make_cache()

    def see(self, start: int, hidden: mx.array, tokens: Sequence[int]) -> None:
        """The target's hidden states at positions start, start + 1, ... (a forward pass of it); `tokens`: the
        request's history as verified so far (the tokens after the positions it pairs)."""
        self.seen(start, hidden)
        assert self.rows is not None
        pairable = min(self.rows.shape[1], len(tokens) - 1 - self.next)
        if pairable >= EAGER:
            self._pair(tokens, pairable)
            mx.eval([c.state for c in self.cache])

    def _pair(self, history: Sequence[int], n: int) -> mx.array:
        """Feed the first n pending rows with the tokens after them; the head's output at the last one."""
        first = self.next
        rows = self.used(n)
        out = None
        for a in range(0, n, PAIR_CHUNK):
            b = min(n, a + PAIR_CHUNK)
            ids = mx.array(list(history[first + a + 1:first + b + 1]), mx.uint32)[None]
            out = self.head(ids, rows[:, a:b], self.cache)
            if b < n:
                mx.eval([c.state for c in self.cache])
        assert out is not None
        return out[:, -1:]

    def propose(self, tokens: list[int], y: int, k: int, sampling: Any,
                keys: Sequence[mx.array] | None) -> tuple[mx.array | None, mx.array | None]:
        pending = self.pending(tokens)  # rows for positions up to len(tokens) - 1, whose next token is y
        if not pending:
            return None, None
        with mx.stream(generation_stream):
            out = self._pair([*tokens, y], pending)
            drafts, qs = [], []
            for i in range(k):
                logits = self.head.logits(out)[0]
                d, q = pick(logits - mx.logsumexp(logits, axis=-1, keepdims=True), sampling,
                            None if keys is None else keys[i])
                drafts.append(d)
                if q is not None:
                    qs.append(q)
                if i + 1 < k:
                    out = self.head(d[None], out, self.cache)
            if k > 1:
                for c in self.cache:
                    c.trim(k - 1)  # the chained pairs: a draft's own hidden states, not the target's
        return mx.concatenate(drafts), (mx.concatenate(qs) if qs else None)
