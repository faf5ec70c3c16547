"""``kvroute service``: run the random-per-connection TCP balancer (a local Kubernetes Service)."""

from __future__ import annotations

import argparse
import asyncio
import random
import signal

from kvroute import aio
from kvroute.errors import UserError
from kvroute.service import TcpBalancer, format_hostport, parse_hostport

NAME = "service"
HELP = "L4 TCP balancer: a random backend per connection, like a Kubernetes Service"
DESCRIPTION = """\
Listen on one address and relay every new TCP connection, byte for byte, to a backend
chosen uniformly at random. This is what kube-proxy does for a Kubernetes Service, so the
reference experiment's baseline (vLLM replicas behind a Service) runs on one machine.

The choice is made per TCP connection, never per request: HTTP is not parsed. A client
that keeps a connection alive stays on one backend, which hides most of the cache misses
that random balancing causes. To measure fairly, open a new connection per request (what
`kvroute bench` does by default).

A backend that refuses a connection is retried once on another one (kube-proxy would not
have sent traffic to a pod that is not ready). On Ctrl-C or SIGTERM the service stops and
prints how many connections each backend received.

Example: three vLLM workers on ports 8001-8003 behind one address:

  kvroute service --listen 127.0.0.1:8000 \\
      --backend 127.0.0.1:8001 --backend 127.0.0.1:8002 --backend 127.0.0.1:8003 --seed 0
"""

_LOCALHOST = "127.0.0.1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        required=True,
        metavar="HOST:PORT",
        help="address to accept clients on (port 0 picks a free port and prints it); "
        f"':PORT' means {_LOCALHOST}",
    )
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a backend to balance over; repeat once per backend",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed the random choices so the same connection order gives the same assignment",
    )


def run(args: argparse.Namespace) -> int:
    listen = parse_hostport(args.listen, default_host=_LOCALHOST)
    if not args.backend:
        raise UserError("no backend given: add --backend HOST:PORT once per backend")
    backends = [parse_hostport(text, default_host=_LOCALHOST) for text in args.backend]
    try:
        balancer = TcpBalancer(
            backends, host=listen[0], port=listen[1], rng=random.Random(args.seed)
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    aio.run(_serve(balancer))
    print(balancer.summary(), flush=True)
    return 0


async def _serve(balancer: TcpBalancer) -> None:
    """Serve until SIGINT or SIGTERM, then close the balancer (and its relayed connections)."""
    await balancer.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    backends = ", ".join(format_hostport(b) for b in balancer.backends)
    # The first line names the bound port, so a script that asked for port 0 can read it.
    print(
        f"kvroute service: listening on {format_hostport((balancer.host, balancer.port))}, "
        f"random per connection over {len(balancer.backends)} backends: {backends}",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await balancer.close()
