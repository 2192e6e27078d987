"""A worker process's odd output and lingering pipes (supervisor/process.py), with real subprocesses.

The "worker" here is a tiny Python program given to WorkerProcess in place of `python -m worker`:
what is under test is how the supervisor reads a process's stderr and sees its exit, not the worker.
Each test names, in its docstring, the handling it would catch missing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from supervisor.process import LINE_MAX_BYTES, WorkerProcess
from tests.conftest import assert_gone

EXIT_WAIT_S = 30.0  # turns a hang into a failure; a healthy run takes a fraction of a second


def run(code: str, log_path: Path) -> WorkerProcess:
    """Start `python -c code` as a worker process, wait for its exit to be seen, and return it."""

    async def go() -> WorkerProcess:
        proc = WorkerProcess("m", [sys.executable, "-c", code], log_path)
        await proc.start()
        seen = await proc.wait(EXIT_WAIT_S)
        if not seen:  # leave nothing behind, then fail
            proc.signal(signal.SIGKILL, "the test is over")
            await proc.wait(EXIT_WAIT_S)
        assert seen, f"the exit of pid {proc.pid} was not seen; stderr so far: {list(proc.stderr_tail)[-3:]}"
        return proc

    return asyncio.run(go())


def test_a_megabyte_line_is_logged_cut_and_the_lines_after_it_still_arrive(tmp_path: Path) -> None:
    """Catches: a line-limited stderr reader (64 KiB) that dies on a long line, leaving the worker blocked on a
    full pipe and its exit never seen; a long line logged whole."""
    code = ("import sys\n"
            "sys.stderr.write('x' * 2**20 + '\\n')\n"
            "sys.stderr.write('after the long line\\n')\n"
            "sys.stderr.write('no newline at the end')\n"
            "sys.exit(3)\n")
    log_path = tmp_path / "m.log"
    proc = run(code, log_path)
    assert proc.pid is not None
    assert_gone([proc.pid])
    cut = f"{'x' * LINE_MAX_BYTES} ... [cut {2**20 - LINE_MAX_BYTES} bytes]"
    assert proc.returncode == 3
    assert list(proc.stderr_tail) == [cut, "after the long line", "no newline at the end"]
    logged = [line.split(" ", 2)[2] for line in log_path.read_text().splitlines()]  # after its time stamp
    assert logged == [cut, "after the long line", "no newline at the end"]


def test_an_exit_is_seen_while_a_process_it_started_holds_its_pipes_open(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Catches: an exit seen only once every pipe of the process is closed (asyncio's Process.wait), which a
    process it started, inheriting its stderr and stdin, can put off for good."""
    code = ("import subprocess, sys\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print('grandchild', child.pid, file=sys.stderr, flush=True)\n")
    caplog.set_level(logging.WARNING, logger="supervisor.process")
    log_path = tmp_path / "m.log"
    try:
        proc = run(code, log_path)
        assert proc.returncode == 0 and any(x.startswith("grandchild ") for x in proc.stderr_tail)
        assert proc.pid is not None
        assert_gone([proc.pid])
        assert any("its stderr is still open" in r.getMessage() for r in caplog.records)
    finally:
        for line in log_path.read_text().splitlines() if log_path.exists() else []:
            if " grandchild " in line:  # it holds the pipes as long as it lives: it goes, and is proven gone
                grandchild = int(line.split()[-1])
                os.kill(grandchild, signal.SIGKILL)
                assert_gone([grandchild])
