"""Short prefills' attention outside cuDNN on MLX CUDA, so a new prompt shape builds nothing.

MLX CUDA runs the attention of a prefill (more than one query) through cuDNN, which builds a graph for every
new combination of shapes and strides of q, k, v and the mask. On an H200 a build took ~60 ms
(`bench.diagnose --parts cudnn`: a batch-1 prefill of a prompt length new to the process 66.6 ms, of a seen one
4.5 ms, with cuDNN off 9.2 ms either way). Every new prompt length is a new shape, and so is every group of
arrivals of a ramp (its batch, its longest prompt): 8 clients starting together waited 285 ms p50 for their
first token from mlxsup, 50 ms with cuDNN off. Off everywhere, a 4096-token prefill took 2.4x as long: the
fused kernel pays for its build there, and a long prompt's chunks are few shapes (bucketed by the step cost
model).

So the worker routes (`install("auto")` on CUDA): a prefill attention whose scores (batch x query heads x
queries x keys) hold at most SHORT_SCORES elements runs unfused, MLX's own fallback written out (scores, mask,
softmax, values; gpt-oss's sinks too), which builds nothing per shape; larger ones and decode steps (one query: MLX's
vector kernel, or cuDNN over whole 256-position cache blocks, few shapes) go to mx.fast as before. Metal
and the CPU build no per-shape attention graph: nothing is routed there.

The route replaces `mx.fast.scaled_dot_product_attention` for the worker process (one model per process), the
one call mlx-lm's models make for attention (`mlx_lm.models.base.scaled_dot_product_attention`).
"""

from __future__ import annotations

import mlx.core as mx

ATTENTION_MODES = ("auto", "fast", "routed")
SHORT_SCORES = 1 << 26  # 128 MiB of bfloat16 scores: a 1024-token prompt at 64 heads, or 8 of 512 at 32 heads
_fast = mx.fast.scaled_dot_product_attention


def wants_route(mode: str) -> bool:
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, not {mode!r}")
    return mode == "routed" or (mode == "auto" and mx.default_device() == mx.gpu and mx.cuda.is_available())


def install(mode: str) -> bool:
    """Route short prefills unfused (mode routed, or auto on CUDA), else keep mx.fast's; True if routed."""
    routed = wants_route(mode)
    setattr(mx.fast, "scaled_dot_product_attention", routed_attention if routed else _fast)  # noqa: B010  (a patch)
    return routed


def is_short_prefill(q: mx.array, k: mx.array) -> bool:
    return q.shape[2] > 1 and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= SHORT_SCORES


def routed_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None, sinks=None,
                     force_fused: bool = False, stream=None) -> mx.array:
    if force_fused or stream is not None or not is_short_prefill(q, k):
        return _fast(q, k, v, scale=scale, mask=mask, sinks=sinks, force_fused=force_fused, stream=stream)
    return unfused_attention(q, k, v, scale, mask, sinks)


def unfused_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
    """mx.fast.scaled_dot_product_attention's fallback (mlx/fast.cpp), for a mask of None, "causal" or an array, and
    optional sinks (one logit per query head that takes part in the softmax and adds no value)."""
    B, n_q, L, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    reps = n_q // n_kv
    q = q * mx.array(scale, q.dtype)
    if reps > 1:  # grouped queries: each kv head serves `reps` query heads
        q = q.reshape(B, n_kv, reps, L, D)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask mode {mask!r}")
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    if mask is not None:
        if reps > 1 and mask.ndim >= 3:
            mask = mx.expand_dims(mask, -3) if mask.shape[-3] == 1 else mask.reshape(
                *mask.shape[:-3], n_kv, reps, *mask.shape[-2:])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    if sinks is not None:
        sinks = sinks.reshape(1, n_kv, reps, 1, 1) if reps > 1 else sinks.reshape(1, n_q, 1, 1)
        scores = mx.concatenate([mx.broadcast_to(sinks, (*scores.shape[:-1], 1)).astype(scores.dtype), scores], -1)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = (weights[..., 1:] if sinks is not None else weights) @ v
    return out.reshape(B, n_q, L, D) if reps > 1 else out
