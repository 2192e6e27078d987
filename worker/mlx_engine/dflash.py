"""DFlash drafters: a block of drafts in one forward pass, conditioned on the target's own hidden states.

A DFlash drafter (arXiv:2602.06036; z-lab's checkpoints, dflash-mlx's MLX port) is a few decoder layers that read no
tokens of their own: its context is the target's hidden states at some of its layers (`target_layer_ids`; each
position's concatenated, projected by `fc` and `hidden_norm` into keys and values), and its queries a block of
embeddings, [the token in hand, mask, mask, ...], attended without a causal mask; the target's lm_head turns the
block's outputs at the mask positions into k drafts at once. The model class is dflash-mlx's (`DFlashDraftModel`:
its layout is the checkpoints'); this module loads it (`load_dflash`, the target's shape checked against it) and
drives it for one request (`DFlashDrafter`).

The context: the solo hands each of its forward passes' tapped layers (taps.py) to the drafter (`see`), which keeps
them per position until they are verified (the tokens after them kept) and appends them to its cache at the next
proposal, in one pass; its cache is an mlx-lm KVCache per layer holding the context's keys and values only (a
proposal's block is trimmed back out after it). After a prefix-cache hit the context starts at the first position
prefilled (rotary positions are relative). A batch row proposes nothing: its hidden states stop at the hand-over.

Invariants: the cache holds the projected context of positions [base, base + fed) of the request's history, all of
them verified; `rows` are the target's tapped states from position base + fed on, not in the cache yet.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache

from worker.mlx_engine.taps import Seen, text_model

EAGER = 64  # verified rows at which `see` appends them at once (a prompt's prefill), not at the next proposal


class DFlashHead:
    """A loaded DFlash drafter and the target's embedding and lm_head it drafts through."""

    def __init__(self, model: nn.Module, target: nn.Module) -> None:
        inner = text_model(target)
        assert inner is not None
        lm: Any = getattr(target, "language_model", target)
        self.model = model
        self.layers = [int(i) for i in cast(Any, model).target_layer_ids]
        self.block = int(cast(Any, model).block_size)
        self.mask_id = int(cast(Any, model).mask_token_id)
        self.embed = inner.embed_tokens
        self._lm_head = None if lm.args.tie_word_embeddings else lm.lm_head

    def logits(self, out: mx.array) -> mx.array:
        return self._lm_head(out) if self._lm_head is not None else self.embed.as_linear(out)

    def make_cache(self) -> list:
        return [KVCache() for _ in cast(Any, self.model).layers]

    def forward(self, block: mx.array, context: mx.array, cache: list) -> mx.array:
        """The drafter's outputs for a block of ids (1, B), its context (1, C, width) appended to `cache` (and the
        block trimmed back out)."""
        model = cast(Any, self.model)
        out = model(noise_embedding=self.embed(block), target_hidden=context, cache=cache)
        for c in cache:
            c.trim(block.shape[1])
        return cast(mx.array, out)


def load_dflash(path: Path, target: nn.Module) -> DFlashHead:
    """The DFlash drafter at `path` for `target`; a ValueError naming what does not match."""
    from dflash_mlx.model import DFlashDraftModel, DFlashDraftModelArgs
    from mlx_lm.utils import load_model

    inner = text_model(target)
    if inner is None:
        raise ValueError("a DFlash drafter needs a decoder whose layers mlxsup can read")
    config = json.loads((path / "config.json").read_text())
    if not (config.get("dflash_config") or "block_size" in config):
        raise ValueError(f"{path} is not a DFlash drafter (no dflash_config, no block_size in its config.json)")
    model, _ = load_model(path, lazy=True, get_model_classes=lambda config: (DFlashDraftModel, DFlashDraftModelArgs))
    mx.eval(model.parameters())
    layers = [int(i) for i in model.target_layer_ids]
    width = int(inner.embed_tokens.weight.shape[-1])
    vocab = int(inner.embed_tokens.weight.shape[0])
    args = model.args
    if (int(args.hidden_size), int(args.num_target_layers), int(args.vocab_size)) != (width, len(inner.layers), vocab) \
            or not all(0 <= i < len(inner.layers) for i in layers):
        raise ValueError(f"the DFlash drafter at {path} is for another model (hidden size {args.hidden_size}, "
                         f"{args.num_target_layers} target layers, vocabulary {args.vocab_size}, reading layers "
                         f"{layers}; this one: {width}, {len(inner.layers)} layers, {vocab})")
    return DFlashHead(model, target)


class DFlashStep(nn.Module):
    """A DFlash drafter's proposal as a model (ids, cache) -> logits, for draft_pricing's timing: a block of
    `ids` (`block`: priced once per verification, not per draft)."""

    block = True

    def __init__(self, head: DFlashHead) -> None:
        super().__init__()
        self._head = (head,)

    def __call__(self, ids: mx.array, cache: list) -> mx.array:
        head = self._head[0]
        width = len(head.layers) * int(head.embed.weight.shape[-1])
        # the first call's context as long as its ids (the scratch context), then a row a call, as a proposal after
        # one verified token appends (the caller trims the block back out)
        rows = ids.shape[1] if cache[0].offset == 0 else 1
        context = mx.zeros((ids.shape[0], rows, width), head.embed.weight.dtype)
        model = cast(Any, head.model)
        out = model(noise_embedding=head.embed(ids), target_hidden=context, cache=cache)
        return head.logits(out)

    def make_cache(self) -> list:
        return self._head[0].make_cache()


class DFlashDrafter(Seen):
    """A DFlash drafter's proposals for one request (the module says how its context follows the history)."""

    def __init__(self, head: DFlashHead) -> None:
        self.head = head
        super().__init__()

    def fresh(self) -> list:
        return self.head.make_cache()

    def see(self, start: int, hidden: mx.array, tokens: Sequence[int]) -> None:
        """The target's tapped states at positions start, start + 1, ...; `tokens`: the history verified so far."""
        self.seen(start, hidden)
        assert self.rows is not None
        verified = min(self.rows.shape[1], len(tokens) - self.next)
        if verified >= EAGER:
            self._append(verified)
            mx.eval([c.state for c in self.cache])

    def _append(self, n: int) -> None:
        """The first n pending rows into the cache, as a proposal's forward pass appends its context (the keys and
        values of each layer's attention over the projected context, at their rotary positions), with no block."""
        model = cast(Any, self.head.model)
        context = model.project_target_hidden(self.used(n))
        b, length, _ = context.shape
        for layer, c in zip(model.layers, self.cache, strict=True):
            a = layer.self_attn
            keys = a.k_norm(a.k_proj(context).reshape(b, length, a.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            values = a.v_proj(context).reshape(b, length, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
            c.update_and_fetch(a.rope(keys, offset=c.offset), values)

    def propose(self, tokens: list[int], y: int, k: int, sampling: Any,
                keys: Sequence[mx.array] | None) -> tuple[mx.array | None, mx.array | None]:
        from worker.mlx_engine.mtp import pick

        pending = self.pending(tokens)  # rows up to position len(tokens) - 1: the context y follows
        if not pending:
            return None, None
        k = min(k, self.head.block - 1)
        with mx.stream(generation_stream):
            block = mx.array([[y] + [self.head.mask_id] * k], mx.uint32)
            out = self.head.forward(block, self.used(pending), self.cache)
            logits = self.head.logits(out[:, 1:])[0]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            drafts, qs = [], []
            for i in range(k):
                d, q = pick(logprobs[i:i + 1], sampling, None if keys is None else keys[i])
                drafts.append(d)
                if q is not None:
                    qs.append(q)
        return mx.concatenate(drafts), (mx.concatenate(qs) if qs else None)
