"""Prometheus metrics for GET /metrics (prometheus_client's text format).

One registry per daemon, not the process-global one. Counters and histograms are observed
once per request or per lifecycle event, never per token, so the hot path pays nothing;
per-model gauges (memory, in flight, state) are read from the router at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StatusCollector(Collector):
    def __init__(self, status: Callable[[], dict]) -> None:
        self._status = status

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self._status()
        memory = GaugeMetricFamily("mlxsup_model_memory_bytes", "Measured footprint of a model's worker",
                                   labels=["model"])
        in_flight = GaugeMetricFamily("mlxsup_model_in_flight", "Requests in flight per model", labels=["model"])
        loaded = GaugeMetricFamily("mlxsup_model_state", "1 for the model's current state", labels=["model", "state"])
        suspended = GaugeMetricFamily("mlxsup_model_suspended", "Requests waiting to resume per model",
                                      labels=["model"])
        waiting = GaugeMetricFamily("mlxsup_model_waiting", "Requests waiting in the model's queue", labels=["model"])
        for m in status["models"]:
            memory.add_metric([m["id"]], m["memory_bytes"] or 0)
            in_flight.add_metric([m["id"]], m["in_flight"])
            loaded.add_metric([m["id"], m["state"]], 1)
            suspended.add_metric([m["id"]], m.get("suspended", 0))
            waiting.add_metric([m["id"]], m.get("waiting", 0))
        yield memory
        yield in_flight
        yield suspended
        yield waiting
        yield loaded
        yield GaugeMetricFamily("mlxsup_memory_ceiling_bytes", "Admission ceiling", value=status["ceiling_bytes"])
        yield GaugeMetricFamily("mlxsup_stranded_bytes", "Wired memory that workers' exits did not give back (macOS)",
                                value=status.get("stranded_bytes", 0))
        yield GaugeMetricFamily("mlxsup_system_available_bytes", "System memory available",
                                value=status["system_available_bytes"])


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mlxsup_requests", "Requests by model, endpoint and outcome",
                                ["model", "endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("mlxsup_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.completion_tokens = Counter("mlxsup_completion_tokens", "Tokens generated", ["model"], registry=r)
        self.draft_tokens = Counter("mlxsup_draft_tokens", "Tokens drafted by speculative decoding and verified",
                                    ["model"], registry=r)
        self.draft_accepted_tokens = Counter("mlxsup_draft_accepted_tokens", "Drafted tokens the model kept",
                                             ["model"], registry=r)
        self.ttft = Histogram("mlxsup_time_to_first_token_seconds", "Time to first token, load included",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mlxsup_inter_token_latency_seconds", "Mean time per token after the first, per request",
                             ["model"], buckets=TOKEN_BUCKETS, registry=r)
        self.loads = Counter("mlxsup_loads", "Worker loads by outcome", ["model", "outcome"], registry=r)
        self.load_seconds = Histogram("mlxsup_load_seconds", "Worker load time", ["model"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.evictions = Counter("mlxsup_evictions", "Evictions by reason", ["model", "reason"], registry=r)
        self.crashes = Counter("mlxsup_crashes", "Unexpected worker exits", ["model"], registry=r)
        self.suspensions = Counter("mlxsup_suspended_requests", "Requests suspended when their worker ended under "
                                   "them, by cause (crash, hang, pressure)", ["model", "cause"], registry=r)
        self.resumes = Counter("mlxsup_resumes", "Suspended requests by outcome (resumed, failed)",
                               ["model", "outcome"], registry=r)
        self.resume_pause = Histogram("mlxsup_resume_pause_seconds", "A resumed request's pause: from its "
                                      "suspension to its next token", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("mlxsup_queue_wait_seconds", "A request's wait in its model's queue (a load, "
                                    "room, a swap, a place on its worker) before its lease", ["model"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.queue_refused = Counter("mlxsup_queue_refused", "Requests the model's queue refused: full (429) or "
                                     "waited too long (503)", ["model", "why"], registry=r)

    def watch(self, status: Callable[[], dict]) -> None:
        self.registry.register(_StatusCollector(status))

    def render(self) -> bytes:
        return generate_latest(self.registry)
