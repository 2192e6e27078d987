"""worker/pace.py: the faster of two ways of doing a step is found by trials, and kept while it stays faster."""

from __future__ import annotations

from worker.pace import Pace


def run(pace: Pace, ms: dict[bool, float], steps: int) -> list[bool]:
    """`steps` steps, each taking ms[way] for the way it ran in; the ways they ran in."""
    ways = []
    for _ in range(steps):
        way = pace.use()
        ways.append(way)
        pace.record(ms[way] / 1e3, way)
    return ways


def test_a_faster_other_way_is_found_at_the_first_trial_and_kept() -> None:
    pace = Pace(window=4, every=10, margin=0.03)
    ways = run(pace, {True: 2.3, False: 2.0}, 38)
    # 10 steps the first way, then a trial of 4 steps: the other way was faster, so it stays, with trials of the
    # first way that lose
    assert ways == [True] * 10 + [False] * 14 + [True] * 4 + [False] * 10
    assert pace.way is False and pace.changes == 1


def test_a_slower_other_way_is_tried_for_a_window_every_so_often_and_left() -> None:
    pace = Pace(window=4, every=10, margin=0.03)
    ways = run(pace, {True: 2.0, False: 2.6}, 56)
    assert pace.way is True and pace.changes == 0
    # each trial compares 4 fresh steps of the other way: ten steps, four tried, and again
    assert ways == ([True] * 10 + [False] * 4) * 4 and pace.trials == 4


def test_within_the_margin_the_way_in_use_stays() -> None:
    pace = Pace(window=4, every=10, margin=0.05)
    run(pace, {True: 2.0, False: 1.94}, 80)  # 3% faster: under the margin
    assert pace.way is True and pace.changes == 0 and pace.trials > 3


def test_the_host_changing_speed_changes_the_way_back() -> None:
    """The build ahead pays in the host's slow speed and costs in its fast one: the way follows the speed."""
    pace = Pace(window=4, every=10, margin=0.03)
    run(pace, {True: 2.5, False: 2.9}, 40)  # slow: ahead faster
    assert pace.way is True
    run(pace, {True: 2.1, False: 1.8}, 40)  # fast: plain faster
    assert pace.way is False
    run(pace, {True: 2.5, False: 2.9}, 40)
    assert pace.way is True and pace.changes == 2


def test_an_outlier_step_does_not_decide() -> None:
    pace = Pace(window=5, every=10, margin=0.03)
    for _ in range(10):
        pace.record(0.002, True)
    assert pace.trial and pace.use() is False
    for t in (0.0021, 0.0021, 0.0001, 0.0021, 0.0021):  # one very fast step among slower ones: the median decides
        pace.record(t, False)
    assert not pace.trial and pace.way is True


def test_a_new_request_drops_the_last_ones_times_and_its_unfinished_trial() -> None:
    """A request's steps are compared with its own: another context length, maybe another speed of the host."""
    pace = Pace(window=4, every=6, margin=0.03)
    run(pace, {True: 2.0, False: 3.0}, 8)  # 6 steps, then 2 of a trial
    assert pace.trial
    pace.begin()
    assert not pace.trial and pace.use() is True
    ways = run(pace, {True: 9.0, False: 1.0}, 3)  # too few of this request's own for a trial
    assert ways == [True] * 3 and not pace.trial
    ways = run(pace, {True: 9.0, False: 1.0}, 6)
    assert ways == [True, False, False, False, False, False] and pace.way is False
