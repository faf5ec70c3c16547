"""A worker whose answers a test scripts, on a loopback port: for the router's tests that need
a worker to fail, hang, or answer in some particular way."""

from __future__ import annotations

from aiohttp import web


async def ok_completion(request: web.Request) -> web.Response:
    """An empty completion, after reading the request."""
    await request.read()
    return web.json_response({"id": "c", "object": "text_completion", "choices": [], "usage": {}})


async def ok(request: web.Request) -> web.Response:
    """A bare 200 (a passing ``/health``)."""
    return web.Response()


class FakeWorker:
    """``generate`` answers ``/v1/completions`` and ``/v1/chat/completions``, ``health``
    answers ``/health`` (aiohttp handlers); ``async with`` gives its URL. A handler is
    cancelled when its client leaves, and closing waits at most 0.1 s for the ones still
    running (a hanging handler must not hold the test up)."""

    def __init__(self, generate=ok_completion, health=ok) -> None:
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", generate)
        self.app.router.add_post("/v1/chat/completions", generate)
        self.app.router.add_get("/health", health)

    async def __aenter__(self) -> str:
        self.runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()
