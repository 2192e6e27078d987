"""Benchmark parameters and the named profiles. Everything used is recorded in the results."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Params:
    profile: str
    preset: str  # mlxsup make-model preset
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    tokens: dict[int, int] = field(default_factory=lambda: {1: 256, 8: 256, 32: 256})  # generated per request
    rounds: dict[int, int] = field(default_factory=lambda: {1: 5, 8: 5, 32: 5})
    warmup_tokens: dict[int, int] = field(default_factory=lambda: {1: 256, 8: 256, 32: 256})  # per side and c
    prompt_words: int = 24
    cold_rounds: int = 3
    idle_evict_rounds: int = 5
    busy_evict_rounds: int = 3
    busy_streams: int = 8
    busy_max_tokens: int = 4096
    burst_probe: bool = True  # n clients connecting at once, no pre-opened connections (informative)
    overhead_concurrency: list[int] = field(default_factory=lambda: [1, 8])
    overhead_tokens: int = 256
    overhead_rounds: int = 3
    profile_concurrency: list[int] = field(default_factory=lambda: [1, 32])
    profile_rounds: int = 2
    run_cache_bench: bool = True  # run bench/cache_bench.py (else include its committed results)
    cache_tokens: int = 2048
    # prefill_itl: itl_streams decode; one long prompt arrives; their ITL during its prefill
    itl_streams: int = 8
    itl_baseline_tokens: int = 128  # per stream, in the run without the long prompt
    itl_long_prompt_words: int = 6000  # ~6k tokens on the 1b preset's tokenizer (a word a token)
    itl_lead_tokens: int = 16  # every stream has this many tokens before the long prompt is sent
    itl_tail_tokens: int = 16  # ... and this many after its first token; then the client disconnects them
    itl_stream_max_tokens: int = 2048  # a ceiling only: the streams are cut after the tail
    itl_rounds: int = 3
    itl_step_targets: list = field(default_factory=lambda: [None, 0.05])  # mlxsup daemons (None: its default)
    # resume: a greedy stream whose worker is SIGKILLed after resume_lead_tokens, resumed
    resume_prompt_words: int = 2000  # "w123"-style words: ~2.6 tokens each on the small preset
    resume_tokens: int = 256
    resume_lead_tokens: int = 64
    resume_rounds: int = 3
    run_timeout_s: float = 300.0
    deadline_s: float = 540.0  # stop starting new work after this; results are still written
    seed: int = 0
    bandwidth_gbs: float | None = None  # memory bandwidth for the decode bound (None: the GPU's, from bench/bound.py)
    # CPUs every side's server runs on (Linux: sched_setaffinity; an mlxsup daemon's workers inherit it): "auto" =
    # the first quarter of the cores (at least 4), "" = unpinned. On the GPU host the same stream_generate process
    # ran 1.65 ms a token on cores 0-3 and 2.87 on cores 8-11 (bench.diagnose affinity): unpinned, a side's speed
    # was the luck of its core, not its code. The sides run one at a time, so they share the set, never at once.
    server_cpus: str = ""
    # the throughput section waits for mlxsup's worker to end its batch-shape warm-up (a GPU's: it runs after Ready,
    # while idle) before any round, so no side is measured while it runs
    await_warm_up: bool = False
    # extra environment for the throughput section's mlxsup daemon and so its workers ("K=V" each): an A/B of a
    # worker setting against the same in-process baseline, e.g. MLX_CUDA_USE_CUDNN_SDPA=0
    mlxsup_env: tuple[str, ...] = ()
    # CPUs the harness itself (the HTTP clients that time every event) runs on: "rest" = every CPU outside
    # server_cpus, "" = wherever the OS puts it. At 32 streams the client parses ~5000 SSE events a second; left
    # unpinned it can land on the servers' CPUs and take them from the daemon and its worker (the in-process sides
    # have no HTTP client to compete with).
    client_cpus: str = ""
    # another checkout's mlxsup (a folder holding its supervisor/, worker/, protocol/) as a fifth side of the
    # throughput section, "mlxsup_b", run in the same rounds: a before/after of two trees that one run can see
    mlxsup_b: str = ""
    mlxsup_b_env: tuple[str, ...] = ()  # more environment for mlxsup_b only ("K=V" each), after mlxsup_env

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens"] = {str(k): v for k, v in self.tokens.items()}
        d["rounds"] = {str(k): v for k, v in self.rounds.items()}
        d["warmup_tokens"] = {str(k): v for k, v in self.warmup_tokens.items()}
        return d


PROFILES: dict[str, Params] = {
    # The NVIDIA (or Apple GPU) run: the 1b preset, 256 tokens everywhere, five alternating rounds.
    "gpu": Params(profile="gpu", preset="1b", server_cpus="auto", client_cpus="rest", await_warm_up=True),
    # This repo's 2-core CI-class CPU: MLX's CPU matmul runs ~2.4 GFLOP/s whatever the batch, so the
    # small preset costs ~150 ms per token *per sequence*, prefill included. Token counts shrink with
    # concurrency to keep the whole run near ten minutes; rounds are fewer at high concurrency.
    "cpu": Params(profile="cpu", preset="small", tokens={1: 32, 8: 8, 32: 4}, rounds={1: 3, 8: 2, 32: 1},
                  warmup_tokens={1: 2}, prompt_words=4, cold_rounds=3, idle_evict_rounds=3,
                  busy_evict_rounds=2, burst_probe=False, overhead_concurrency=[1], overhead_tokens=32, overhead_rounds=2,
                  profile_concurrency=[1, 8], profile_rounds=1, run_cache_bench=False,
                  itl_baseline_tokens=12, itl_long_prompt_words=120, itl_lead_tokens=2, itl_tail_tokens=2,
                  itl_stream_max_tokens=1000, itl_rounds=1, itl_step_targets=[None],
                  resume_prompt_words=120, resume_tokens=24, resume_lead_tokens=8, resume_rounds=1,
                  run_timeout_s=400, deadline_s=840),
    # A functional check of the whole suite in about a minute (tiny preset; numbers mean nothing).
    "smoke": Params(profile="smoke", preset="tiny", tokens={1: 16, 8: 16, 32: 8}, rounds={1: 2, 8: 2, 32: 1},
                    warmup_tokens={1: 2, 8: 2, 32: 2}, prompt_words=6, cold_rounds=2, idle_evict_rounds=2,
                    busy_evict_rounds=1, overhead_concurrency=[1], overhead_tokens=16, overhead_rounds=1,
                    profile_concurrency=[1, 8], profile_rounds=1, run_cache_bench=False,
                    itl_baseline_tokens=16, itl_long_prompt_words=1500, itl_lead_tokens=4, itl_tail_tokens=4,
                    itl_rounds=1, itl_step_targets=[None],
                    resume_prompt_words=200, resume_tokens=32, resume_lead_tokens=8, resume_rounds=1,
                    run_timeout_s=120, deadline_s=300),
}
