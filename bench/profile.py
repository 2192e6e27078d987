"""Sampling profiles of mlxsup's daemon and worker under the benchmark's load, with py-spy.

py-spy attaches by pid (root, or ptrace allowed), samples without pausing the process
(--nonblocking) and with idle threads included (--idle) so the fractions are of wall time. The raw
(collapsed) stacks are summarized here: for the thread that runs the process's loop, the share of
samples in which each function is on the stack (inclusive) and at the top (self).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def find_pyspy() -> str | None:
    cands = [shutil.which("py-spy"), os.path.join(os.path.dirname(sys.executable), "py-spy")]
    for p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if p:
            cands.append(os.path.join(p, "bin", "py-spy"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


class Spy:
    def __init__(self, exe: str, pid: int, out: Path, rate: int = 200) -> None:
        self.out = out
        self.log = out.with_suffix(".log")
        self.argv = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--idle",
                     "--nonblocking", "--output", str(out)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)

    async def stop(self, timeout: float = 30) -> int | None:
        if not self.proc:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        for _ in range(int(timeout * 10)):
            if self.proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        return self.proc.returncode


def _short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    f = m.group("file")
    parts = f.replace("\\", "/").split("/")
    if "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1:]
    return f"{m.group('fn')} ({'/'.join(parts[-2:])})"


def summarize_collapsed(path: Path, marker: str, top: int = 40) -> dict:
    """Stacks that contain `marker` (a substring of a frame: the loop's thread) -> inclusive/self shares."""
    if not path.exists():
        return {"error": f"no profile at {path}"}
    stacks: list[tuple[list[str], int]] = []
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [_short(f) for f in stack.split(";") if f]
        stacks.append((frames, int(n)))
    mine = [(f, n) for f, n in stacks if any(marker in x for x in f)]
    total = sum(n for _, n in mine)
    if not total:
        return {"error": f"no samples with {marker!r}", "all_samples": sum(n for _, n in stacks)}
    incl: Counter = Counter()
    self_: Counter = Counter()
    for frames, n in mine:
        for fr in set(frames):
            incl[fr] += n
        self_[frames[-1]] += n
    trunk = {k for k, v in incl.items() if v >= total}  # on every sample: entry points, the loop itself
    for k in trunk:
        del incl[k]
    pct = lambda c: [[k, round(100 * v / total, 2)] for k, v in c.most_common(top)]  # noqa: E731
    return {"samples": total, "all_samples": sum(n for _, n in stacks), "inclusive_pct": pct(incl),
            "self_pct": pct(self_)}
