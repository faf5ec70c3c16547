"""How long a request takes on this machine as loaded as it is now, for the tests whose
timeouts must hold on a busy machine (a shared two-core runner): they derive their bounds from
it instead of fixing them in seconds."""

from __future__ import annotations

import asyncio
import time

import aiohttp


async def slowest_answer(session: aiohttp.ClientSession, url: str, body: dict, *, rounds: int = 3,
                         concurrency: int = 1) -> float:
    """Seconds the slowest of ``rounds`` waves of ``concurrency`` POSTs of ``body`` to ``url``
    took, each read to its end and answered 200."""

    async def one() -> float:
        t0 = time.monotonic()
        async with session.post(url, json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
        return time.monotonic() - t0

    slowest = 0.0
    for _ in range(rounds):
        slowest = max(slowest, *await asyncio.gather(*(one() for _ in range(concurrency))))
    return slowest
