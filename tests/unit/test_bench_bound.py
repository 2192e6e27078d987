"""The bench's bandwidth bound (issue 15): the bandwidth found by GPU name or given, and each side's fraction."""

from __future__ import annotations

from bench.bound import bandwidth_gb_s, bound_lines, decode_bound


def test_bandwidth_by_gpu_name_most_specific_first_or_from_the_option() -> None:
    assert bandwidth_gb_s(["NVIDIA H200, 143771 MiB, 580.1"])[0] == 4800.0
    assert bandwidth_gb_s(["NVIDIA GH200 480GB, 97871 MiB, 550"])[0] == 4000.0
    assert bandwidth_gb_s(["NVIDIA H100 80GB HBM3, 81559 MiB, 580"])[0] == 3350.0
    assert bandwidth_gb_s(["NVIDIA H100 PCIe, 81559 MiB, 580"])[0] == 2000.0
    assert bandwidth_gb_s([], 100.0) == (100.0, "--bandwidth-gbs")
    assert bandwidth_gb_s([])[0] is None


def test_each_side_gets_its_fraction_of_the_bound() -> None:
    summary = {"1": {"inproc": {"itl_p50_s": 0.00144}, "mlxsup": {"itl_p50_s": 0.00223}, "ratios": {}}}
    bound = decode_bound(summary, 2_000_000_000, 4800.0, "table: H200")
    assert bound["bound_ms_per_step"] == 0.4167  # 2.0 GB / 4.8 TB/s
    assert bound["1"]["inproc"] == {"itl_p50_ms": 1.44, "fraction_of_bound": 0.289}
    assert bound["1"]["mlxsup"]["fraction_of_bound"] == 0.187
    assert any("| 1 | mlxsup | 2.230 | 0.187 |" == line for line in bound_lines(bound))
    assert "bound_ms_per_step" not in decode_bound(summary, 2_000_000_000, None, "none")
