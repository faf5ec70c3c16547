"""A Python relay's floor: an aiohttp + uvloop streaming proxy that does nothing but pass
requests through (``kvroute serve`` was built on this stack before its native data plane).

Each ``/v1/completions`` or ``/v1/chat/completions`` body goes to a random worker over a
keep-alive aiohttp client session and the answer is relayed as it arrives, chunk by chunk,
the way ``kvroute serve`` relays it (headers leave with the first chunk). No parsing of the
body, no tokenizing, no index, no KV events, no metrics, no load accounting: what remains is
the HTTP and event-loop work any router on this stack pays per request. ``peers.py --routers
floor`` measures it beside the real routers, so their CPU per request splits into "the stack"
and "the routing".

    python benchmarks/peers/aiohttp_floor.py --port 8100 --worker http://127.0.0.1:8001 ...
"""

from __future__ import annotations

import argparse
import asyncio
import random

import aiohttp
import uvloop
from aiohttp import web


class _Relayed(web.StreamResponse):
    _send_headers_immediately = False  # as kvroute serve: headers leave with the first chunk


async def serve(port: int, workers: list[str]) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        url = random.choice(workers) + request.path
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as upstream:
            response = _Relayed(
                status=upstream.status,
                headers={"Content-Type": upstream.headers.get("Content-Type", "application/json")},
            )
            await response.prepare(request)
            while chunk := await upstream.content.readany():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def models(request: web.Request) -> web.Response:
        async with session.get(workers[0] + "/v1/models") as upstream:
            return web.Response(body=await upstream.read(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", relay)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="port to listen on (127.0.0.1)")
    parser.add_argument("--worker", action="append", required=True, help="worker base URL (repeat)")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.worker))


if __name__ == "__main__":
    main()
