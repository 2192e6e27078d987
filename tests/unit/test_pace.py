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
    pace = Pace(window=4, every=10, margin=0.03, skip=1)
    ways = run(pace, {True: 2.3, False: 2.0}, 40)
    # 10 steps the first way, then the trial: one step not counted (it carries the change) and 4 counted; the other
    # way was faster, so it stays, with trials of the first way that lose again
    assert ways[:10] == [True] * 10 and ways[10:15] == [False] * 5
    assert ways[15:25] == [False] * 10 and pace.way is False and pace.changes == 1
    assert ways.count(True) < 20


def test_a_slower_other_way_is_tried_and_left() -> None:
    pace = Pace(window=4, every=10, margin=0.03, skip=1)
    ways = run(pace, {True: 2.0, False: 2.6}, 60)
    assert pace.way is True and pace.changes == 0
    assert ways[10:15] == [False] * 5 and ways[15] is True  # a trial of 5 steps, then back
    assert ways.count(False) <= 5 * 4  # a trial every 10 counted steps at most


def test_within_the_margin_the_way_in_use_stays() -> None:
    pace = Pace(window=4, every=10, margin=0.05, skip=1)
    run(pace, {True: 2.0, False: 1.94}, 80)  # 3% faster: under the margin
    assert pace.way is True and pace.changes == 0


def test_the_host_changing_speed_changes_the_way_back() -> None:
    """The build ahead pays in the host's slow band and costs in its fast one: the way follows the band."""
    pace = Pace(window=4, every=10, margin=0.03, skip=1)
    run(pace, {True: 2.5, False: 2.9}, 40)  # slow band: ahead faster
    assert pace.way is True
    run(pace, {True: 2.1, False: 1.8}, 40)  # fast band: plain faster
    assert pace.way is False
    run(pace, {True: 2.5, False: 2.9}, 40)
    assert pace.way is True and pace.changes == 2


def test_an_outlier_step_does_not_decide() -> None:
    pace = Pace(window=5, every=10, margin=0.03, skip=0)
    for _ in range(10):
        pace.record(0.002, True)
    assert pace.trial and pace.use() is False
    for t in (0.0021, 0.0021, 0.0001, 0.0021, 0.0021):  # one very fast step among slower ones: the median decides
        pace.record(t, False)
    assert not pace.trial and pace.way is True


def test_a_step_that_ran_before_a_change_is_not_counted() -> None:
    pace = Pace(window=2, every=2, margin=0.03, skip=0)
    pace.record(0.002, True)
    pace.record(0.002, True)
    assert pace.trial  # the other way is tried from the next step
    pace.record(0.001, True)  # the last step of the old way, timed after the change: not the trial's
    assert pace.times[False] == [] and pace.trial
