"""Small shared helpers: statistics, clocks, machine description. Imports no MLX."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def now() -> float:
    """Seconds on the monotonic clock; perf_counter is CLOCK_MONOTONIC on Linux and macOS."""
    return time.perf_counter()


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for an empty list."""
    if not values:
        return None
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    k = (len(v) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def median(values: list[float]) -> float | None:
    return percentile([x for x in values if x is not None], 50)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def rnd(x: float | None, n: int = 4) -> float | None:
    return None if x is None else round(x, n)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
        except Exception:
            pass
    return platform.processor() or platform.machine()


def _gpu() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]
    except Exception:
        return []


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def _git() -> dict:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return {"commit": head or None, "dirty": bool(dirty)}
    except Exception:
        return {"commit": None, "dirty": None}


def machine() -> dict:
    import psutil

    vm = psutil.virtual_memory()
    return {
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "ram_bytes": vm.total,
        "gpus": _gpu(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in ("mlx", "mlx-cuda-13", "mlx-metal", "mlx-lm", "pyzmq", "starlette",
                                               "uvicorn", "httpx", "tokenizers", "transformers", "psutil")},
        "git": _git(),
        "tree": os.environ.get("MLXSUP_BENCH_TREE"),  # e.g. "git archive <commit>" when run from a snapshot
        "load_avg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)
