"""A model's wait queue (supervisor/slot.py, Router.acquire): wait and swap, arrival order, the bounds.

Against test_router.py's fakes (a fake transport, processes and clock): the router and its collaborators are real.
Each test names, in its docstring, the handling it would catch missing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from supervisor import errors
from supervisor.workers import State
from tests.unit.test_router import MIB, World, fake, now, pending, scenario, settle, strict_states  # noqa: F401


def one_at_a_time(tmp_path: Path, **settings: object) -> World:
    return World(tmp_path, max_loaded_models=1, **settings)


async def swap(w: World, gone: str, coming: str) -> None:
    """The idle worker of `gone` was evicted for `coming`: it exits, and `coming`'s worker loads."""
    await settle()
    leaving = w.worker(gone)
    assert leaving.state is State.EVICTING and leaving.evict_reason == "admission"
    fake(leaving).exit(0)
    await settle()
    w.ready(coming)
    await settle()


@scenario
async def test_requests_for_another_model_wait_for_the_swap_and_are_served_in_order(tmp_path: Path) -> None:
    """Catches: a request for a model that cannot load now refused (507) while the loaded one is busy, a busy worker
    evicted under its requests, or the waiting requests served out of their order."""
    w = one_at_a_time(tmp_path)
    streaming = await w.load("m")
    waiting = [asyncio.ensure_future(w.router.acquire("n")) for _ in range(3)]
    await settle()
    assert all(pending(t) for t in waiting) and w.worker("m").state is State.READY
    assert w.router.model_status("n").waiting == 3
    order: list[int] = []
    for i, t in enumerate(waiting):
        t.add_done_callback(lambda _, i=i: order.append(i))
    streaming.release()  # m's request is done: m idles, and goes for n
    await swap(w, "m", "n")
    leases = [t.result() for t in waiting]
    assert order == [0, 1, 2] and {lease.worker.spec.id for lease in leases} == {"n"}
    assert w.router.model_status("n").waiting == 0
    for lease in leases:
        lease.release()


@scenario
async def test_a_busy_model_serves_what_came_before_the_other_models_request_and_then_yields(tmp_path: Path) -> None:
    """Catches: a model that keeps getting requests starving another's waiting one (each new request a new lease)."""
    w = one_at_a_time(tmp_path)
    first = await w.load("m")
    before = await now(w.router.acquire("m"))  # came before n's request: served at once
    for_n = asyncio.ensure_future(w.router.acquire("n"))
    await settle()
    after = asyncio.ensure_future(w.router.acquire("m"))  # came after: waits behind n
    await settle()
    assert pending(for_n) and pending(after) and w.worker("m").leases == 2
    first.release()
    before.release()
    await swap(w, "m", "n")
    n_lease = for_n.result()
    assert pending(after), "m's later request took m back before n's was served"
    n_lease.release()
    await swap(w, "n", "m")
    assert after.result().worker.spec.id == "m"
    after.result().release()


@scenario
async def test_a_full_queue_refuses_at_once_with_retry_after_and_the_queued_ones_complete(tmp_path: Path) -> None:
    """Catches: an unbounded queue (every request accepted however many wait), a refusal with no Retry-After, or a
    refusal that fails those already queued."""
    w = one_at_a_time(tmp_path, max_queued_requests=2)
    streaming = await w.load("m")
    queued = [asyncio.ensure_future(w.router.acquire("n")) for _ in range(2)]
    await settle()
    with pytest.raises(errors.QueueFull) as full:
        await now(w.router.acquire("n"))
    assert full.value.status == 429 and full.value.headers() == {"Retry-After": "1"}
    assert w.router.model_status("n").queue_refused == 1
    assert w.sample("mlxsup_queue_refused_total", model="n", why="full") == 1
    streaming.release()
    await swap(w, "m", "n")
    for lease in [t.result() for t in queued]:
        lease.release()


@scenario
async def test_a_request_that_waits_past_its_limit_is_refused_and_leaves_the_queue(tmp_path: Path) -> None:
    """Catches: a wait with no end (a client held for ever behind a model that never idles), or one that stays
    counted in the queue after its refusal."""
    w = one_at_a_time(tmp_path, queue_timeout_s=30.0)
    streaming = await w.load("m")
    waiting = asyncio.ensure_future(w.router.acquire("n"))
    await settle()
    w.clock.advance(29)
    await settle()
    assert pending(waiting)
    w.clock.advance(2)
    with pytest.raises(errors.QueueTimeout, match="waiting for m to finish") as late:
        await now(waiting)
    assert late.value.status == 503 and "Retry-After" in late.value.headers()
    assert w.router.model_status("n").waiting == 0 and not w.router.slots["m"].yield_to
    assert await now(w.router.acquire("m"))  # m no longer yields to a request that is gone
    streaming.release()


@scenario
async def test_a_waiting_client_that_leaves_is_dropped_from_the_queue_at_once(tmp_path: Path) -> None:
    """Catches: a cancelled wait left in the queue (counted against its bound) or still holding the busy model's
    later requests back."""
    w = one_at_a_time(tmp_path)
    streaming = await w.load("m")
    waiting = asyncio.ensure_future(w.router.acquire("n"))
    await settle()
    later = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    assert pending(later) and w.router.model_status("n").waiting == 1
    waiting.cancel()
    await settle()
    assert w.router.model_status("n").waiting == 0 and not w.router.slots["m"].yield_to
    assert later.done() and later.result().worker is w.worker("m")  # m's later request goes on
    later.result().release()
    streaming.release()


@scenario
async def test_a_models_requests_on_its_worker_are_bounded_and_the_rest_wait_their_turn(tmp_path: Path) -> None:
    """Catches: every request handed to the worker however many run (nothing bounds a worker's own queue), or
    the waiting ones not let on as places free up."""
    w = World(tmp_path, max_running_requests=2)
    leases = [await w.load("m"), await now(w.router.acquire("m"))]
    third = asyncio.ensure_future(w.router.acquire("m"))
    fourth = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    assert pending(third) and pending(fourth) and w.worker("m").leases == 2
    leases[0].release()
    await settle()
    assert third.done() and pending(fourth)
    leases[1].release()
    await settle()
    assert fourth.done()
    third.result().release()
    fourth.result().release()


@scenario
async def test_a_model_that_can_never_fit_beside_pinned_ones_is_still_refused_at_once(tmp_path: Path) -> None:
    """Catches: a request queued for a load that no wait can allow (a pinned model holds the only place)."""
    from supervisor.registry import ModelSpec
    w = World(tmp_path, [ModelSpec("m", tmp_path, weights_bytes=100 * MIB, pinned=True),
                         ModelSpec("n", tmp_path, weights_bytes=100 * MIB)], max_loaded_models=1)
    await settle()
    w.ready("m")
    with pytest.raises(errors.InsufficientMemory, match="pinned"):
        await now(w.router.acquire("n"))
    assert w.router.model_status("n").waiting == 0


@scenario
async def test_a_keep_alive_is_the_workers_ttl_or_pin_and_ends_with_it(tmp_path: Path) -> None:
    """Catches: an API's keep_alive ignored by the housekeeping (the model's own TTL evicts it), a negative one that
    memory pressure or admission may still take, or one that outlives the worker it was said to."""
    w = World(tmp_path, default_ttl_s=100.0, housekeeping_s=1.0)
    (await w.load("m")).release()
    assert w.router.keep_alive("m", 600.0) and w.router.model_status("m").ttl_s == 600.0
    w.clock.advance(200)  # past the model's own TTL, not its keep_alive
    await settle()
    assert w.worker("m").state is State.READY
    assert w.router.keep_alive("m", -1.0)
    status = w.router.model_status("m")
    assert status.pinned and status.ttl_s is None and status.ttl_remaining_s is None
    assert [v.pinned for v in w.router.lifecycle.views()] == [True]
    gone = w.worker("m")
    evicting = asyncio.ensure_future(w.router.evict("m", "now"))
    await settle()
    fake(gone).exit(0)
    await now(evicting)
    (await w.load("m")).release()
    assert w.router.model_status("m").ttl_s == 100.0 and not w.router.model_status("m").pinned  # the next worker
    assert not w.router.keep_alive("n", 5.0)  # no worker: nothing to say it to


@scenario
async def test_a_request_with_more_choices_than_places_takes_them_together_and_never_waits_on_itself(
        tmp_path: Path) -> None:
    """Catches: a request's choices acquired one by one, the last waiting for a place the first ones hold until the
    request ends (a stall until queue_timeout_s, every later request behind it)."""
    w = World(tmp_path, max_running_requests=2)
    (await w.load("m")).release()
    leases = await now(w.router.acquire_many("m", 3))  # more than the limit: it runs alone, all at once
    assert len(leases) == 3 and w.worker("m").leases == 3
    later = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    assert pending(later)  # the worker is full: a later request waits its turn
    for lease in leases:
        lease.release()
    await settle()
    assert later.done()
    later.result().release()
    two = asyncio.ensure_future(w.router.acquire_many("m", 2))
    await settle()
    assert two.done() and len(two.result()) == 2


@scenario
async def test_a_resumed_request_goes_first_and_an_explicit_load_never_waits_for_a_place(tmp_path: Path) -> None:
    """Catches: a resume queued behind every request that came after its own (failing on resume_timeout_s while newer
    ones are served), or `mlxsup load` of a loaded, saturated model waiting for one of its requests to end."""
    w = World(tmp_path, max_running_requests=1)
    held = await w.load("m")
    queued = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    resumed = asyncio.ensure_future(w.router._acquire_unbounded("m"))
    await settle()
    assert pending(queued) and pending(resumed)
    loaded = await now(w.router.acquire("m", explicit=True, queued=False))  # answered at once: it is loaded
    loaded.release()
    held.release()
    await settle()
    assert resumed.done() and pending(queued)  # the resume first, though it came later
    resumed.result().release()
    await settle()
    assert queued.done()
    queued.result().release()


@scenario
async def test_a_client_that_leaves_as_its_wait_times_out_is_cancelled_not_refused(tmp_path: Path) -> None:
    """Catches: the queue's timer swallowing an outside cancel that came in the same turn (QueueTimeout raised to a
    caller that cancelled)."""
    w = World(tmp_path, max_loaded_models=1, queue_timeout_s=5.0)
    held = await w.load("m")
    waiting = asyncio.ensure_future(w.router.acquire("n"))
    await settle()
    w.clock.advance(6)  # the timer's cancel ...
    waiting.cancel()  # ... and the client's, in the same turn
    await settle()
    assert waiting.cancelled()
    assert w.router.model_status("n").waiting == 0
    held.release()


@scenario
async def test_with_one_running_request_each_models_waiters_take_it_after_its_load_before_the_other_models(
        tmp_path: Path) -> None:
    """Catches: a model's earlier waiters, woken by its Ready and letting their load's leases go one by one (one place
    each), finding it evicted by a later waiter of the other model that saw it idle in between: the swaps go round
    for ever, neither model serving a request."""
    w = one_at_a_time(tmp_path, max_running_requests=1)
    streaming = await w.load("m")
    asked = []
    for model in ["n", "m", "n", "m"]:  # one at a time, each queued before the next: arrival order
        asked.append(asyncio.ensure_future(w.router.acquire(model)))
        await settle()
    assert all(pending(t) for t in asked)
    streaming.release()
    for i, (gone, coming) in enumerate([("m", "n"), ("n", "m"), ("m", "n"), ("n", "m")]):
        await swap(w, gone, coming)
        assert w.worker(coming).state is State.READY, f"{coming}'s waiter lost its load to {gone}'s"
        assert asked[i].done() and all(pending(t) for t in asked[i + 1:]), f"request {i} not served in its turn"
        lease = asked[i].result()
        assert lease.worker is w.worker(coming)
        lease.release()
