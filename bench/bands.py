"""The host's speeds, told apart: a round's ITL p50 on the GPU host falls into one of two bands, not a spread
(other busy CPUs put the decoding CPU at the slow speed: bench.cpu_siblings). A side's tok/s
ratio then mostly counts how many fast rounds each side got. So the report also compares sides within a band.

`speed_bands(runs, c)` pools the per-round ITL p50s at `c` clients of the sides that decode the same way (in-process
mlx-lm and mlxsup, not mlx_lm.server, whose own speed is another population), sorts them, and splits them at the widest
relative gap between neighbours, if it is at least `min_gap` (15%) and leaves at least two rounds on each side of it.
Per side it gives how many of its rounds were fast and its median ITL p50 in each band. None: one band. Pure.
"""

from __future__ import annotations

from bench.common import median

SAME_DECODE = ("inproc", "mlxsup", "mlxsup_b")


def speed_bands(runs: list[dict], c: int, min_gap: float = 0.15, sides: tuple[str, ...] = SAME_DECODE) -> dict | None:
    rounds = [(r["side"], r["itl_p50_s"]) for r in runs if r.get("c") == c and r.get("itl_p50_s") and r["side"] in sides]
    values = sorted(itl for _, itl in rounds)
    gaps = [(values[i + 1] / values[i], i) for i in range(1, len(values) - 2) if values[i] > 0]
    if not gaps or (best := max(gaps))[0] < 1 + min_gap:
        return None
    split = (values[best[1]] + values[best[1] + 1]) / 2
    per_side: dict[str, dict] = {}
    for side in dict.fromkeys(s for s, _ in rounds):
        mine = [itl for s, itl in rounds if s == side]
        fast, slow = [x for x in mine if x < split], [x for x in mine if x >= split]
        per_side[side] = {"rounds": len(mine), "fast": len(fast), "fast_itl_p50_s": median(fast),
                       "slow_itl_p50_s": median(slow)}
    return {"split_s": split, "sides": per_side}
