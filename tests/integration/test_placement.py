"""`cpu_split`: a real daemon keeps its threads on a CPU of its own, and its workers (the spare, and the model's
worker that the spare became) run on the others, every thread of each (Linux only: macOS cannot pin)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from protocol.placement import CAN_PIN
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(not CAN_PIN or len(os.sched_getaffinity(0)) < 2, reason="needs CPU affinity, 2 CPUs")


def cpus_of(pid: int) -> dict[int, set[int]]:
    """Each thread of `pid` and the CPUs it may run on."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            pass
    return out


def test_cpu_split_on_puts_the_daemon_and_its_workers_apart(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    daemon_cpus, worker_cpus = {allowed[-1]}, set(allowed[:-1])
    cfg = tmp_path / "split.toml"
    cfg.write_text(f'[server]\nmodel_dirs = ["{model_dir}"]\ncpu_split = "on"\n')
    d = daemon_factory("--config", str(cfg), name="split")
    spare = wait_for(lambda: (s := d.status()["spare"]) and s["standing_by"] and s, 60, what="a spare on standby")
    d.seen_pids.add(spare["pid"])
    r = httpx.post(d.v1 + "/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    worker = d.model("tiny")["pid"]
    assert worker == spare["pid"]  # the spare placed itself at its start, before it knew its model
    daemon_threads = cpus_of(d.proc.pid)
    assert len(daemon_threads) > 1 and all(c == daemon_cpus for c in daemon_threads.values()), daemon_threads
    worker_threads = cpus_of(worker)
    assert len(worker_threads) > 1 and all(c == worker_cpus for c in worker_threads.values()), worker_threads
    assert "cpu_split=on" in (d.state_dir / "daemon.log").read_text()


PLACE = """
import argparse, logging, os, sys
from worker.__main__ import place
place(argparse.Namespace(cpus=None, gpu_cpus={int(sys.argv[1])}), logging.getLogger())
print(sorted(os.sched_getaffinity(0)))
"""


def test_with_auto_a_worker_on_the_cpu_backend_keeps_every_cpu() -> None:
    """--gpu-cpus moves a worker only where MLX computes on a GPU; here MLX runs on the CPU, which needs them all."""
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", PLACE, str(allowed[0])], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == str(allowed)
