"""Memory an exit did not give back, measured, reported, and counted in admission.

On macOS a killed or crashed MLX process can leave its wired memory stranded until reboot (reports against peers on
macOS 26.x); mlxsup's design rests on a worker's exit returning every byte, so it checks. The measure is the host's
wired memory that no live worker holds: `host wired - sum of the workers' own wired` (memory.py: macOS's
host statistics and each process's `ri_wired_size`). Its lowest value seen is the baseline (what the system and other
programs wire); what stands above it by more than `tolerance` is stranded. It is measured after every worker's exit
(the exit's share: how much it grew) and at every housekeeping (it can come back: then it is no longer counted).
Where the platform reports no wired memory (Linux: psutil has no such figure) nothing is measured and nothing is
stranded. Pure state and arithmetic: the lifecycle measures and acts (admission's ceiling less what is stranded,
crash restarts backed off to their longest while any is).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TOLERANCE = 512 * 2**20  # below this, wired memory moving is noise (the system's own wiring comes and goes)
TOLERANCE_FRACTION = 0.01  # ... or 1% of the host's memory, whichever is more


def tolerance_of(total: int) -> int:
    return max(MIN_TOLERANCE, int(total * TOLERANCE_FRACTION))


@dataclass
class Stranded:
    """What stands above the baseline now (`bytes`), and the baseline (None until first measured)."""

    tolerance: int
    baseline: int | None = None
    bytes: int = 0

    def measure(self, host_wired: int | None, workers_wired: int) -> int:
        """Take a measurement; return how much it grew (the share of whatever ended just before)."""
        if host_wired is None:
            return 0
        unheld = max(0, host_wired - workers_wired)
        self.baseline = unheld if self.baseline is None else min(self.baseline, unheld)
        before, above = self.bytes, unheld - self.baseline
        self.bytes = above if above > self.tolerance else 0
        return max(0, self.bytes - before)
