"""The worker's watchdog (worker/watchdog.py) tells a loop turn that computes from one that is stuck: the pure rule,
then the real thread watching real threads (a native call that computes, Python spinning, a wait on a lock)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.conftest import wait_for
from worker.watchdog import Sample, Watchdog, computing, held_fraction

AT_EVAL = Sample(1, 2, 40, "/venv/site-packages/mlx_lm/generate.py:1232 prompt")
AT_POLL = Sample(3, 4, 12, "/src/worker/channel.py:58 wait")


def test_a_held_native_call_computes_only_with_cpu_or_in_mlx_code() -> None:
    assert computing([AT_EVAL] * 4, cpu_s=0.0)  # MLX's own code: a GPU may compute while the CPU waits
    assert computing([AT_POLL] * 4, cpu_s=0.5)  # held, and the process computes
    assert not computing([AT_POLL] * 4, cpu_s=0.0)  # held with no CPU: a wait, a deadlock
    assert not computing([AT_EVAL], cpu_s=1.0)  # one sample tells nothing


def test_a_moving_frame_is_python_running_not_a_native_call() -> None:
    moving = [Sample(1, 2, lasti, "/src/worker/x.py:3 spin") for lasti in (10, 14, 10, 18, 14)]
    assert held_fraction(moving) == 0.0
    assert not computing(moving, cpu_s=2.0)
    tight = [Sample(1, 2, 100, "/src/worker/x.py:3 spin", in_call=False)] * 5  # a tight loop, seen at its jump back
    assert held_fraction(tight) == 0.0
    assert not computing(tight, cpu_s=2.0)


def watched(target, stop: threading.Event) -> tuple[Watchdog, list[tuple], threading.Thread]:
    """A thread running `target` for ever (till `stop`), and a watchdog on it whose turn never ends."""
    pulses: list[tuple] = []
    thread = threading.Thread(target=target, name="watched", daemon=True)
    thread.start()
    started = time.monotonic()
    dog = Watchdog(lambda: started, lambda *p: pulses.append(p), after_s=0.2, sample_s=0.02, main_ident=thread.ident)
    dog.start()
    return dog, pulses, thread


def run_for(dog: Watchdog, thread: threading.Thread, stop: threading.Event, windows: int) -> None:
    """Let the watchdog judge `windows` windows (at least), then stop both threads and prove them gone."""
    wait_for(lambda: dog.windows >= windows, 60, what=f"{windows} watchdog windows")
    stop.set()
    dog.close()
    thread.join(10)
    assert not thread.is_alive() and not dog._thread.is_alive()


def test_a_thread_computing_in_a_native_call_gets_pulses() -> None:
    stop = threading.Event()
    a = np.random.default_rng(0).random((600, 600))

    def matmuls() -> None:
        while not stop.is_set():
            a @ a  # numpy releases the GIL and computes

    dog, pulses, thread = watched(matmuls, stop)
    run_for(dog, thread, stop, 4)
    assert len(pulses) >= 2, pulses
    turn_s, window_s, cpu_s, where = pulses[-1]
    assert turn_s >= 0.2 and cpu_s > 0 and "test_worker_watchdog.py" in where


@pytest.mark.parametrize("how", ["spin", "lock"])
def test_a_thread_spinning_in_python_or_blocked_on_a_lock_gets_none(how: str) -> None:
    stop = threading.Event()
    lock = threading.Lock()
    lock.acquire()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n = (n + 1) % 7

    def blocked() -> None:
        lock.acquire()

    dog, pulses, thread = watched(spin if how == "spin" else blocked, stop)
    try:
        wait_for(lambda: dog.windows >= 4, 60, what="4 watchdog windows")
        assert pulses == []
    finally:
        stop.set()
        lock.release()
        dog.close()
        thread.join(10)
    assert not thread.is_alive() and not dog._thread.is_alive()


def test_a_group_leader_trusts_no_held_mlx_call_without_cpu() -> None:
    """Rank 0 of a group waits in a collective (an MLX call) for a rank that is stopped: that is no computing."""
    assert not computing([AT_EVAL] * 4, cpu_s=0.0, trust_mlx=False)
    assert computing([AT_EVAL] * 4, cpu_s=0.5, trust_mlx=False)
