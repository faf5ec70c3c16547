"""A stand-in for the Kubernetes API server on loopback, for the discovery tests: each test's
subclass routes its resources; LIST answers come from the subclass, and WATCH answers stream
what the test puts on that watch's queue, one JSON event a line, until ``END``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from aiohttp import web

#: Put on a watch's queue: the server ends that watch's response.
END = object()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeKubeApi:
    """Serves GETs of ``routes`` (path → handler) on 127.0.0.1 (an ephemeral port) at
    ``url``; each watch opened is a queue in ``watches``, in order."""

    def __init__(self) -> None:
        self.watches: list[asyncio.Queue] = []
        self._watch_opened = asyncio.Condition()
        self.runner: web.AppRunner | None = None
        self.url = ""

    def routes(self) -> dict[str, Handler]:
        raise NotImplementedError

    async def start(self) -> None:
        app = web.Application()
        for path, handler in self.routes().items():
            app.router.add_get(path, handler)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def close(self) -> None:
        for q in self.watches:
            q.put_nowait(END)
        assert self.runner is not None
        await self.runner.cleanup()

    async def watch_stream(self, index: int, timeout: float = 5.0) -> asyncio.Queue:
        """The queue of watch request ``index`` (0-based), once the client has opened it."""
        async with self._watch_opened:
            await asyncio.wait_for(self._watch_opened.wait_for(lambda: len(self.watches) > index), timeout)
        return self.watches[index]

    async def stream_watch(self, request: web.Request) -> web.StreamResponse:
        """Answer a WATCH: a new queue in ``watches``, its events streamed until ``END``."""
        stream: asyncio.Queue = asyncio.Queue()
        async with self._watch_opened:
            self.watches.append(stream)
            self._watch_opened.notify_all()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        while (item := await stream.get()) is not END:
            await resp.write(json.dumps(item).encode() + b"\n")
        return resp
