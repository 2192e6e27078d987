"""The bench's view of the host's two speeds (bench/bands.py) and of where a run's wall goes (ramp, tail): pure logic
on made-up rounds."""

from __future__ import annotations

import pytest

from bench.bands import speed_bands
from bench.report import _wall_and_bands
from bench.run import summarize


def rounds(c: int, **itls_ms: list[float]) -> list[dict]:
    return [{"c": c, "side": side, "round": i, "itl_p50_s": x / 1e3} for side, xs in itls_ms.items()
            for i, x in enumerate(xs)]


def test_rounds_split_at_the_widest_gap_and_each_side_counts_its_fast_ones() -> None:
    runs = rounds(8, inproc=[4.6, 4.7, 7.0, 6.9], mlxsup=[5.1, 7.3, 7.2, 7.4]) + rounds(32, inproc=[9.0])
    bands = speed_bands(runs, 8)
    assert bands is not None and 5.1e-3 < bands["split_s"] < 6.9e-3
    assert bands["sides"]["inproc"] == {"rounds": 4, "fast": 2, "fast_itl_p50_s": pytest.approx(4.65e-3),
                                        "slow_itl_p50_s": pytest.approx(6.95e-3)}
    assert bands["sides"]["mlxsup"]["fast"] == 1 and bands["sides"]["mlxsup"]["slow_itl_p50_s"] == pytest.approx(7.3e-3)


def test_one_band_when_no_gap_is_wide_or_one_round_stands_alone() -> None:
    assert speed_bands(rounds(8, inproc=[5.0, 5.2, 5.4], mlxsup=[5.3, 5.6, 5.7]), 8) is None  # gaps under 15%
    assert speed_bands(rounds(8, inproc=[2.0, 5.0, 5.1], mlxsup=[5.2, 5.3]), 8) is None  # one fast round: no band
    assert speed_bands(rounds(8, inproc=[5.0]), 1) is None  # no rounds at that concurrency


def test_a_run_says_how_long_its_ramp_and_tail_took() -> None:
    records = [{"start": 0.0, "times": [0.10, 0.2, 1.0], "completion_tokens": 3},
               {"start": 0.05, "times": [0.15, 0.3, 1.25], "completion_tokens": 3}]
    s = summarize(records, 3)
    assert s["ramp_s"] == pytest.approx(0.2) and s["tail_s"] == pytest.approx(0.3)  # last first token 0.2; ends 1.0, 1.3
    summary = {"8": {"inproc": {"ramp_s": 0.2, "tail_s": 0.3}, "mlxsup": {"ramp_s": 0.25},
                     "bands": speed_bands(rounds(8, inproc=[4.6, 4.7, 7.0], mlxsup=[5.1, 7.3]), 8)}}
    assert _wall_and_bands(summary)[3:] == ["| 8 | inproc | 200 / 300 ms | 2 of 3 | 4.65 / 7.00 ms |",
                                            "| 8 | mlxsup | 250 / - ms | 1 of 2 | 5.10 / 7.30 ms |"]
    row = {"ramp_s": 0.1}
    one = {"1": {"inproc": row, "mlx_lm.server": row, "bands": None}, "8": {"inproc": row}}  # no gap; not computed
    assert [line.split(" | ")[3] for line in _wall_and_bands(one)[3:]] == ["one band", "", ""]
