"""Waiting for a condition that another task or process brings about: polled, with a deadline
that only bounds a hang (a loaded machine gets there late, never wrongly)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Return once ``predicate()`` holds; fail the test if it still does not after ``timeout``
    seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
