"""The embedding queue's packing (worker/embed_queue.py): pure logic, no model, no clock."""

from __future__ import annotations

from worker.embed_queue import BATCH_TOKENS, FIRST_BATCH_TOKENS, EmbedQueue, Pick, budget


def _ids(*lengths: int) -> list[list[int]]:
    return [[7] * n for n in lengths]


def _run(queue: EmbedQueue, picks: list[Pick]) -> list[str]:
    """Give every pick a row (its length); the rids this completed."""
    return [p.rid for p in queue.fill(picks, [[float(len(p.seqs[i]))] for p, i in picks])]


def test_a_batch_packs_inputs_of_every_request_shortest_first_within_the_budget() -> None:
    q = EmbedQueue()
    q.add("a", _ids(5, 1, 3), "A")
    q.add("b", _ids(2, 4), "B")
    picks = q.take(3 * 3)  # three inputs of up to 3 tokens
    assert [(p.rid, len(p.seqs[i])) for p, i in picks] == [("a", 1), ("b", 2), ("a", 3)]
    assert _run(q, picks) == []
    picks = q.take(100)
    assert sorted(len(p.seqs[i]) for p, i in picks) == [4, 5]
    assert sorted(_run(q, picks)) == ["a", "b"]
    assert not len(q) and q.take(100) == []


def test_rows_come_back_in_each_requests_own_order() -> None:
    q = EmbedQueue()
    q.add("a", _ids(9, 1, 5, 3), "A")
    done = []
    while len(q):
        picks = q.take(9)
        done += q.fill(picks, [[float(len(p.seqs[i]))] for p, i in picks])
    assert [p.rows for p in done] == [[[9.0], [1.0], [5.0], [3.0]]]


def test_a_batch_holds_one_input_whatever_the_budget() -> None:
    q = EmbedQueue()
    q.add("a", _ids(50, 60), "A")
    assert len(q.take(1)) == 1
    assert len(q.take(1)) == 1
    assert q.take(1) == []  # all taken, none filled yet: nothing more to batch


def test_short_requests_behind_a_long_one_are_answered_before_it() -> None:
    """Catches: first come, first served batching, where a request of many inputs holds up every later one."""
    q = EmbedQueue()
    q.add("long", _ids(*[8] * 20), "L")
    budget_tokens = 2 * 8  # two long inputs a batch
    done = _run(q, q.take(budget_tokens))
    q.add("s1", _ids(2), "S")
    q.add("s2", _ids(3, 2), "S")
    steps = 0
    while "s1" not in done or "s2" not in done:
        done += _run(q, q.take(budget_tokens))
        steps += 1
    assert steps <= 2 and "long" not in done  # at most one more long batch: the shorts ride shortest first
    while len(q):
        done += _run(q, q.take(budget_tokens))
    assert done[-1] == "long"


def test_a_long_input_is_not_starved_by_a_stream_of_short_requests() -> None:
    """Catches: pure shortest-first, where a request whose input is longer than every later one never runs."""
    q = EmbedQueue()
    q.add("long", _ids(40), "L")
    done: list[str] = []
    for step in range(6):
        q.add(f"s{step}", _ids(2, 2), "S")  # a new short request every batch, enough to fill it alone
        done += _run(q, q.take(8))
        if "long" in done:
            break
    assert "long" in done and step <= 2  # round-robin anchoring: its turn comes within the pending requests' count


def test_a_withdrawn_request_drops_its_rows_and_leaves_the_rest() -> None:
    q = EmbedQueue()
    q.add("a", _ids(2, 2), "A")
    q.add("b", _ids(2), "B")
    picks = q.take(100)
    assert q.remove("a") is not None and q.remove("a") is None
    assert _run(q, picks) == ["b"]
    assert not len(q)
    q.add("c", _ids(1), "C")
    assert [p.rid for p in q.clear()] == ["c"] and not len(q)


def test_the_budget_follows_the_measured_speed_within_its_bounds() -> None:
    assert budget(None) == FIRST_BATCH_TOKENS
    assert budget(100.0) == 50
    assert budget(1e9) == BATCH_TOKENS
    assert budget(0.001) == 1
