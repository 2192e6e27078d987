"""CPU lists and the daemon/worker split (protocol/placement.py, supervisor/placement.py): pure logic."""

from __future__ import annotations

import pytest

from protocol.placement import format_cpus, parse_cpus
from supervisor.config import ConfigError, Settings, load_file
from supervisor.placement import split
from supervisor.process import worker_argv


@pytest.mark.parametrize("spec,cpus", [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-2,5,7-8", {0, 1, 2, 5, 7, 8}),
                                       (" 1 , 3", {1, 3})])
def test_cpu_lists_read_and_written_back(spec: str, cpus: set[int]) -> None:
    assert parse_cpus(spec) == cpus
    assert parse_cpus(format_cpus(cpus)) == cpus
    assert format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


@pytest.mark.parametrize("spec", ["", "a", "3-1", "-1", "1-", ","])
def test_a_bad_cpu_list_is_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_cpus(spec)


def test_auto_splits_four_cpus_or_more_the_daemon_taking_the_last() -> None:
    assert split({0, 1, 2}, "auto") is None
    four = split({0, 1, 2, 3}, "auto")
    assert four is not None and four.daemon == {3} and four.workers == {0, 1, 2}
    sixteen = split(set(range(16)), "auto")
    assert sixteen is not None and sixteen.daemon == {14, 15} and sixteen.workers == set(range(14))
    odd = split({2, 5, 9, 11}, "auto")  # whatever CPUs this process was given, not 0..n-1
    assert odd is not None and odd.daemon == {11} and odd.workers == {2, 5, 9}


def test_on_splits_two_and_off_never() -> None:
    two = split({0, 1}, "on")
    assert two is not None and two.daemon == {1} and two.workers == {0}
    assert split({0}, "on") is None
    assert split(set(range(8)), "off") is None


def test_a_worker_is_told_its_cpus_before_its_model_arguments() -> None:
    argv = worker_argv("ipc://x", "a#1", 1.0, ["--spare"], "info", ["--cpus", "0-3", "--gpu-cpus", "0-2"])
    assert argv[-5:] == ["--cpus", "0-3", "--gpu-cpus", "0-2", "--spare"]


def test_cpu_split_is_checked_in_the_config(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\ncpu_split = "off"\n')
    assert load_file(path, Settings()).cpu_split == "off"
    path.write_text('[server]\ncpu_split = "half"\n')
    with pytest.raises(ConfigError, match="cpu_split"):
        load_file(path, Settings())
