"""The worker's own memory footprint, as it reports it in Ready, Heartbeat and Bye.

MLX-free (psutil only), so the loop can report it without importing the engine. It is the
resident set size, a figure for the logs and the heartbeat; the supervisor measures each worker
itself (supervisor/memory.py) for its admission decisions.
"""

from __future__ import annotations

import psutil


def process_memory_bytes() -> int:
    """This process's resident set size, in bytes."""
    return int(psutil.Process().memory_info().rss)
