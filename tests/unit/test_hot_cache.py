"""The hot cache's bookkeeping: longest-prefix walks, the byte budget, and which blocks go first."""

from __future__ import annotations

from dataclasses import dataclass

from worker.hot_cache import HotCache
from worker.shutdown import run_best_effort


@dataclass(eq=False)
class Blk:  # what HotCache reads of a block: its key, parent, tokens and size
    key: bytes
    parent: bytes = b"root"
    tokens: tuple[int, ...] = ()
    nbytes: int = 100
    snapshot: None = None


def chain(name: str, n: int) -> list[Blk]:
    keys = [f"{name}{i}".encode() for i in range(n)]
    return [Blk(k, keys[i - 1] if i else b"root") for i, k in enumerate(keys)]


def test_prefix_walks_until_the_first_missing_block() -> None:
    hot = HotCache(10_000)
    a = chain("a", 4)
    hot.put(a[:2])
    assert hot.prefix([b.key for b in a]) == a[:2]
    assert hot.prefix([b"zz", a[0].key]) == []  # a prefix, not any match


def test_budget_is_kept_and_old_tails_go_before_their_heads() -> None:
    hot = HotCache(500)
    a, b = chain("a", 3), chain("b", 3)
    hot.put(a)
    hot.put(b)
    assert hot.nbytes == 500 and len(hot) == 5
    assert a[2].key not in hot and a[0].key in hot  # the oldest chain lost its tail, not its head
    hot.prefix([x.key for x in a[:2]])  # a is used again: now b is the least recent
    hot.put(chain("c", 2))
    assert hot.nbytes <= 500
    assert [x.key in hot for x in b] == [True, False, False]


def test_blocks_larger_than_the_budget_and_a_zero_budget_are_refused() -> None:
    hot = HotCache(50)
    hot.put(chain("a", 2))
    assert len(hot) == 0 and hot.nbytes == 0
    off = HotCache(0)
    off.put(chain("a", 1))
    assert not off.enabled and len(off) == 0


def test_clear_reports_what_it_released() -> None:
    hot = HotCache(1000)
    hot.put(chain("a", 3))
    assert hot.clear() == (3, 300)
    assert hot.nbytes == 0 and len(hot) == 0


def test_best_effort_close_runs_every_step() -> None:
    ran = []

    def fails() -> None:
        ran.append("flush")
        raise OSError("disk gone")

    assert run_best_effort("test", [("flush", fails), ("release", lambda: ran.append("release"))]) == ["flush"]
    assert ran == ["flush", "release"]


def test_best_child_is_the_held_block_under_a_parent_that_starts_the_longest_way_alike() -> None:
    hot = HotCache(300)
    system = (1, 2, 3, 4, 5, 6)
    a = Blk(b"a", tokens=system + (7, 7))
    b = Blk(b"b", tokens=system[:3] + (9, 9, 9, 9, 9))
    other = Blk(b"x", parent=b"elsewhere", tokens=system + (8, 8))
    hot.put([a])
    hot.put([b])
    hot.put([other])
    assert hot.best_child(b"root", system + (0, 0)) == (a, 6)
    assert hot.best_child(b"root", (1, 2, 3, 9)) == (b, 4)
    assert hot.best_child(b"root", (5,)) == (None, 0)
    assert hot.best_child(b"nobody", system) == (None, 0)
    hot.prefix([other.key])
    hot.best_child(b"root", system)  # now b is the least recent
    hot.put([Blk(b"c")])  # over the budget: the least recent goes, and the parent index forgets it
    assert b.key not in hot and hot.best_child(b"root", (1, 2, 3, 9)) == (a, 3)
    hot.clear()
    assert hot.best_child(b"root", system) == (None, 0)


def test_a_pinned_chain_outlives_newer_ones_until_only_pins_are_left() -> None:
    hot = HotCache(500)
    a = chain("a", 3)
    hot.pin([b.key for b in a], ttl_s=300)
    hot.put(a)
    for name in "bcd":
        hot.put(chain(name, 3))
    assert all(b.key in hot for b in a) and hot.nbytes <= 500  # the unpinned went, newest kept behind the pins
    big = HotCache(200)
    big.pin([b.key for b in a], ttl_s=300)
    big.put(a)
    assert big.nbytes <= 200 and a[0].key in big  # the budget holds even when every block is pinned


def test_an_expired_pin_protects_nothing() -> None:
    hot = HotCache(300)
    a = chain("a", 3)
    hot.pin([b.key for b in a], ttl_s=-1)
    hot.put(a)
    hot.put(chain("b", 3))
    assert a[0].key not in hot
