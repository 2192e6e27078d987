"""Short prefills' attention outside cuDNN (worker/mlx_engine/attention.py, issue 15): the unfused path equals
MLX's own fallback exactly, on this CPU where mx.fast runs that fallback, and the route sends only short
prefills there."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest

from worker.mlx_engine import attention
from worker.mlx_engine.attention import SHORT_SCORES, install, routed_attention, unfused_attention, wants_route


@pytest.fixture(autouse=True)
def fast_after() -> Iterator[None]:
    yield
    install("fast")
    assert mx.fast.scaled_dot_product_attention is attention._fast


def qkv(b: int, n_q: int, n_kv: int, length: int, keys: int, dtype=mx.bfloat16) -> tuple[mx.array, ...]:
    mx.random.seed(b * 100 + length)
    return tuple(mx.random.normal(shape).astype(dtype) for shape in
                 ((b, n_q, length, 16), (b, n_kv, keys, 16), (b, n_kv, keys, 16)))


@pytest.mark.parametrize("shape", [(1, 8, 2, 5, 5), (3, 4, 4, 7, 12), (2, 8, 1, 3, 9)])
@pytest.mark.parametrize("mask", ["none", "causal", "bool_shared", "bool_per_head", "additive"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("sinks", [False, True])
def test_unfused_equals_mlx_fallback_exactly(shape: tuple, mask: str, dtype, sinks: bool) -> None:
    b, n_q, n_kv, length, keys = shape
    q, k, v = qkv(*shape, dtype=dtype)
    s = mx.random.normal((n_q,)).astype(dtype) if sinks else None
    m = {"none": None, "causal": "causal",
         "bool_shared": mx.random.uniform(shape=(b, 1, length, keys)) > 0.3,  # the BatchKVCache's left-padding mask
         "bool_per_head": mx.random.uniform(shape=(b, n_q, length, keys)) > 0.3,
         "additive": mx.random.normal((length, keys)).astype(dtype)}[mask]
    assert mx.array_equal(unfused_attention(q, k, v, 0.25, m, s), attention._fast(q, k, v, scale=0.25, mask=m, sinks=s))


def test_an_unknown_mask_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mask mode"):
        unfused_attention(*qkv(1, 2, 2, 3, 3), 0.5, "sliding")


def test_only_short_prefills_go_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(attention, "unfused_attention", lambda *a, **kw: calls.append("unfused"))
    monkeypatch.setattr(attention, "_fast", lambda *a, **kw: calls.append("fast"))
    routed_attention(*qkv(2, 8, 2, 40, 40), scale=0.1, mask="causal")  # a batch's prefill
    routed_attention(*qkv(1, 8, 2, 1, 300), scale=0.1, mask=None)  # a decode step: one query
    routed_attention(*qkv(1, 8, 2, 4, 4), scale=0.1, mask=None, sinks=mx.zeros((8,)))  # gpt-oss's sinks
    routed_attention(*qkv(2, 8, 2, 40, 40), scale=0.1, mask="causal", force_fused=True)  # asked for the kernel
    assert calls == ["unfused", "fast", "unfused", "fast"]
    big_q = mx.zeros((1, 32, 2048, 16), dtype=mx.bfloat16)
    big_k = mx.zeros((1, 8, 4096, 16), dtype=mx.bfloat16)
    assert 32 * 2048 * 4096 > SHORT_SCORES
    calls.clear()
    routed_attention(big_q, big_k, big_k, scale=0.1, mask="causal")  # a long prompt's chunk: cuDNN is worth its build
    assert calls == ["fast"]


def test_install_routes_where_asked_and_auto_only_on_cuda() -> None:
    assert install("routed") and mx.fast.scaled_dot_product_attention is routed_attention
    assert not install("fast") and mx.fast.scaled_dot_product_attention is attention._fast
    assert wants_route("auto") == (mx.default_device() == mx.gpu and mx.cuda.is_available())
    with pytest.raises(ValueError, match="attention must be one of"):
        wants_route("cudnn")
