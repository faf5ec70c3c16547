"""kvroute.aio.WaitTimeout: the per-wait timeout of the router's relay and the bench client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from kvroute.aio import WaitTimeout


async def _under(timeout: WaitTimeout, work: Awaitable[None]) -> str:
    """Run ``work`` the way the relay and the bench do under ``timeout``."""
    try:
        await work
        return "finished"
    except asyncio.CancelledError:
        if timeout.expired():
            return "timed out"
        raise
    finally:
        timeout.stop()


async def _wait_under(limit_s: float, sleeps: list[tuple[bool, float]]) -> str:
    """Sleep through ``sleeps`` ((counted as a wait?, seconds) each) under one WaitTimeout."""
    timeout = WaitTimeout(limit_s)

    async def work() -> None:
        for counted, seconds in sleeps:
            if counted:
                timeout.waiting()
            await asyncio.sleep(seconds)
            timeout.done_waiting()

    return await _under(timeout, work())


async def test_only_marked_waits_count_each_on_its_own():
    # Three waits of 0.06 s and 0.3 s outside any wait: none reaches 0.1 s.
    assert await _wait_under(0.1, [(True, 0.06), (False, 0.3), (True, 0.06), (True, 0.06)]) == "finished"
    assert await _wait_under(0.1, [(True, 0.06), (True, 0.3)]) == "timed out"


async def test_its_cancel_is_taken_back_and_the_task_goes_on():
    assert await _wait_under(0.05, [(True, 1.0)]) == "timed out"
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0.01)  # no cancel left pending


async def test_a_cancel_from_outside_at_the_same_moment_still_propagates():
    async def waiter() -> str:
        timeout = WaitTimeout(0.05, waiting=True)  # a plain deadline
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + 0.05, asyncio.current_task().cancel)  # Ctrl-C, say
        return await _under(timeout, asyncio.sleep(1.0))

    with pytest.raises(asyncio.CancelledError):
        await asyncio.ensure_future(waiter())
