"""The typed results keep the API's JSON shape (keys, their order, the state-dependent ones) and read back."""

from __future__ import annotations

import json

from supervisor.reports import EvictReport, LoadProgress, ModelStatus, RecentEviction, SpareStatus, Status

ALWAYS = ["id", "state", "kind", "pid", "memory_bytes", "in_flight", "queued", "waiting", "oldest_wait_s", "queue_refused", "leases", "idle_s", "ttl_s", "ttl_remaining_s",
          "pinned", "restarts", "crashes", "suspended", "resumed", "resume_failed", "last_error", "stderr_tail",
          "last_eviction", "worker_active", "batch_size", "peak_batch_size", "weights_bytes", "cache"]

REPORT = EvictReport("m", True, "ttl", pid=7, mode="drain", memory_before_bytes=10, duration_s=0.5, exit=0,
                     signals=("SIGTERM",), aborted=0, drained=2, phases_s={"drain": 0.1}, memory_after_settle_bytes=3)


def test_an_evict_report_is_the_api_json_and_reads_back() -> None:
    out = REPORT.to_dict()
    assert list(out) == ["model", "evicted", "reason", "pid", "mode", "memory_before_bytes", "duration_s", "exit",
                         "signals", "aborted", "drained", "phases_s", "memory_after_settle_bytes", "stranded_bytes"]
    assert out["signals"] == ["SIGTERM"] and out["phases_s"] == {"drain": 0.1}
    assert EvictReport.from_dict(json.loads(json.dumps(out))) == REPORT
    assert EvictReport.not_loaded("m").to_dict() == {"model": "m", "evicted": False, "reason": "not loaded"}
    assert EvictReport.from_dict({"model": "m", "evicted": False, "reason": "not loaded"}).evicted is False


def test_model_status_keys_depend_on_the_state_as_the_api_always_had_them() -> None:
    stopped = ModelStatus("m", "stopped", last_eviction=REPORT)
    assert list(stopped.to_dict()) == ALWAYS
    assert stopped.to_dict()["last_eviction"] == {"reason": "ttl", "mode": "drain", "duration_s": 0.5, "exit": 0}
    failed = ModelStatus("m", "failed", retry_in_s=12.5)
    assert list(failed.to_dict()) == [*ALWAYS, "retry_in_s"]
    worker = ["generated_tokens", "context_length", "drafted_tokens", "accepted_tokens", "acceptance_rate",
              "drafting", "drafting_priced"]
    ready = ModelStatus("m", "ready", pid=7, generated_tokens=0, context_length=None)
    assert list(ready.to_dict()) == [*ALWAYS, *worker] and ready.to_dict()["acceptance_rate"] is None
    drafting = ModelStatus("m", "ready", pid=7, generated_tokens=9, drafted_tokens=8, accepted_tokens=6)
    assert drafting.to_dict()["acceptance_rate"] == 0.75
    loading = ModelStatus("m", "loading", generated_tokens=0, progress=LoadProgress("weights", 0.5))
    assert list(loading.to_dict()) == [*ALWAYS, *worker, "progress"]
    assert loading.to_dict()["progress"] == {"stage": "weights", "fraction": 0.5}
    for status in (stopped, failed, ready, drafting, loading):
        back = ModelStatus.from_dict(json.loads(json.dumps({**status.to_dict(), "a_key_from_the_future": 1})))
        assert back.to_dict() == status.to_dict()


def test_the_daemon_status_nests_its_models() -> None:
    status = Status(1, 2, 3, 4, None, SpareStatus(9, True), [ModelStatus("m", "stopped")],
                    [RecentEviction(2.5, REPORT)])
    out = status.to_dict()
    assert list(out) == ["ceiling_bytes", "used_bytes", "system_available_bytes", "system_total_bytes",
                         "max_loaded_models", "spare", "models", "recent_evictions", "stranded_bytes"]
    assert out["spare"] == {"pid": 9, "standing_by": True} and out["models"][0]["id"] == "m"
    assert out["recent_evictions"] == [{"ago_s": 2.5, **REPORT.to_dict()}]
    json.dumps(out)
