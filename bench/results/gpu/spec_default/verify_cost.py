"""How a forward pass of n tokens costs on this GPU, by attention route: mx.fast (cuDNN for n > 1 on CUDA) vs the
worker's unfused route, the key length growing each step as a verification's does."""
import sys, time, statistics
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
sys.path.insert(0, ".")
sys.path.insert(0, "/tmp/t-head"); from worker.mlx_engine import attention
model, tok = load(sys.argv[1])
fast = attention._fast
def run(route, n, steps=40):
    setattr(mx.fast, "scaled_dot_product_attention", route)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 400), mx.uint32), cache=cache))
    ids = mx.zeros((1, n), mx.uint32)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        out = model(ids, cache=cache)
        mx.eval(out)
        times.append(time.perf_counter() - t0)
        for c in cache:
            c.trim(n - 1)  # keep one: the key length grows by one a step, as decoding's
    return statistics.median(times[5:]) * 1e3, max(times[5:]) * 1e3
for name, route in (("fast", fast), ("unfused", attention.routed_attention)):
    for n in (1, 2, 3, 5, 9):
        med, worst = run(route, n)
        print(f"{name:8s} n={n}: median {med:.2f} ms, worst {worst:.2f} ms", flush=True)
setattr(mx.fast, "scaled_dot_product_attention", fast)
