"""The hard unload's last step inside the worker: give back what MLX holds before the process ends.

On macOS a process that ends while the GPU still runs its work, or while MLX still holds its buffers, can leave its
wired memory stranded until reboot (reports against peers on macOS 26: a killed MLX process, a launchd SIGKILL after
5 s). So every exit the worker controls (an evict's settle, SIGTERM, the lifeline's loss: all run worker/shutdown.py's
`finish`) runs `release` in this order: wait for the device to finish (`synchronize`), drop every reference to the
model, its generator and caches, collect them, and clear MLX's buffer cache, handing its memory back to the system;
only then does the process exit. The order is the point: a buffer still referenced is not freed by `clear_cache`,
and one freed while the device still reads it is not safe to free.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import mlx.core as mx

STEPS = ("synchronize", "drop", "collect", "clear_cache")


def release(drop: Callable[[], None], mlx: Any = mx) -> list[str]:
    """Run the steps in order (`drop` drops the references); each that ran is named in the result, in order. A step
    that fails is logged by the caller's phase (shutdown.py) and ends the sequence there."""
    done = []
    mlx.synchronize()
    done.append("synchronize")
    drop()
    done.append("drop")
    gc.collect()
    done.append("collect")
    mlx.clear_cache()
    done.append("clear_cache")
    return done
