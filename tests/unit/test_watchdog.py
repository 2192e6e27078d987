"""The unit tests' loop watchdog (tests/unit/watchdog.py) catches a loop that stops yielding."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.watchdog import LoopBlocked, run_watched


def test_a_loop_spinning_on_a_finished_future_fails_the_test() -> None:
    """Catches: a watchdog that cannot fire while the loop is blocked (as asyncio.wait_for cannot)."""

    async def spin() -> None:
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        while True:
            await done  # a finished future: never yields

    async def test() -> None:
        await asyncio.wait_for(spin(), 1)  # cannot fire: its timer never runs

    with pytest.raises(LoopBlocked, match="stuck in"):
        run_watched(test(), limit_s=0.5)


def test_a_loop_that_turns_passes_through() -> None:
    async def test() -> int:
        await asyncio.sleep(0.6)  # past the limit, yielding all along
        return 7

    assert run_watched(test(), limit_s=0.5) == 7
