"""Tests for the random-per-connection TCP balancer (``kvroute.service``) and its CLI."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import re
import signal
import socket
import sys
import time

import aiohttp
import pytest
from aiohttp import web
from scipy.stats import chisquare

from kvroute.cli import main
from kvroute.errors import UserError
from kvroute.service import TcpBalancer, format_hostport, parse_hostport

LOOPBACK = "127.0.0.1"


class RecordingBackend:
    """A tiny TCP server that counts connections and runs ``handler`` on each."""

    def __init__(self, handler=None) -> None:
        self.connections = 0
        self._handler = handler or self._reply_name
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_connect, LOOPBACK, 0)
        self.address = (LOOPBACK, self._server.sockets[0].getsockname()[1])

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self._handler(reader, writer)
        finally:
            writer.close()

    async def _reply_name(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.write(format_hostport(self.address).encode())
        await writer.drain()

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


@contextlib.asynccontextmanager
async def running(*things):
    """Start backends/balancers in order, close them in reverse order."""
    try:
        for thing in things:
            await thing.start()
        yield things
    finally:
        for thing in reversed(things):
            await thing.close()


@contextlib.contextmanager
def refusing_port():
    """A loopback port that refuses connections: bound (so no one else takes it), not listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    try:
        yield LOOPBACK, sock.getsockname()[1]
    finally:
        sock.close()


async def ask(port: int, payload: bytes = b"hello") -> bytes:
    """One request on a new connection: send, half-close, read until the server closes."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(payload)
        writer.write_eof()
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


# --- addresses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:8000", ("127.0.0.1", 8000)),
        ("worker-0.vllm:80", ("worker-0.vllm", 80)),
        ("[::1]:8000", ("::1", 8000)),
        (":9000", ("10.0.0.1", 9000)),
        ("9000", ("10.0.0.1", 9000)),
        ("localhost:0", ("localhost", 0)),
    ],
)
def test_parse_hostport_accepts(text, expected):
    assert parse_hostport(text, default_host="10.0.0.1") == expected
    assert parse_hostport(format_hostport(expected)) == expected


@pytest.mark.parametrize(
    ("text", "default_host", "message"),
    [
        ("127.0.0.1", "h", "missing port"),
        ("127.0.0.1:", "h", "missing port"),
        ("127.0.0.1:http", "h", "not a number"),
        ("127.0.0.1:-1", "h", "not a number"),
        ("127.0.0.1:65536", "h", "out of range"),
        (":8000", None, "missing host"),
        ("8000", None, "missing port"),
        ("::1:8000", "h", "brackets"),
        ("[::1]8000", "h", "[IPv6]:PORT"),
    ],
)
def test_parse_hostport_rejects(text, default_host, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_hostport(text, default_host=default_host)


def test_balancer_rejects_bad_backend_lists():
    with pytest.raises(ValueError, match="at least one"):
        TcpBalancer([])
    with pytest.raises(ValueError, match="duplicate"):
        TcpBalancer([(LOOPBACK, 1), (LOOPBACK, 1)])
    with pytest.raises(ValueError, match="1-65535"):
        TcpBalancer([(LOOPBACK, 0)])


# --- balancing ------------------------------------------------------------------------------


async def test_connections_are_spread_uniformly_and_counted_exactly():
    backends = [RecordingBackend() for _ in range(4)]
    async with running(*backends):
        balancer = TcpBalancer([b.address for b in backends], rng=random.Random(1234))
        async with running(balancer):
            gate = asyncio.Semaphore(50)

            async def one() -> bytes:
                async with gate:
                    return await ask(balancer.port)

            replies = await asyncio.gather(*(one() for _ in range(1000)))
        # Every reply names a real backend, and each backend's own count agrees with the
        # balancer's (and with the replies), so nothing was miscounted or misrouted.
        by_reply = {b.address: replies.count(format_hostport(b.address).encode()) for b in backends}
        seen = {b.address: b.connections for b in backends}
        assert balancer.accepted == 1000
        assert balancer.dropped == 0
        assert balancer.connections_per_backend == seen == by_reply
        assert sum(seen.values()) == 1000
        assert chisquare(list(seen.values())).pvalue > 0.001


async def test_seeded_rng_gives_the_same_assignment_sequence():
    backends = [RecordingBackend() for _ in range(3)]
    async with running(*backends):
        sequences = []
        for _ in range(2):
            balancer = TcpBalancer([b.address for b in backends], rng=random.Random(7))
            async with running(balancer):
                sequences.append([await ask(balancer.port) for _ in range(30)])
        assert sequences[0] == sequences[1]
        assert len(set(sequences[0])) == 3


# --- relaying -------------------------------------------------------------------------------


async def test_large_payloads_pass_unchanged_both_ways_with_half_close():
    """Client → backend and backend → client each carry several MB at the same time.

    The backend echoes what it reads; after the client's EOF (forwarded by the balancer as
    a half-close) it still sends a trailer with the digest of everything it received, which
    only arrives if the other direction kept flowing.
    """

    async def echo_then_digest(reader, writer):
        digest = hashlib.sha256()
        while data := await reader.read(32 * 1024):
            digest.update(data)
            writer.write(data)
            await writer.drain()
        writer.write(b"DIGEST:" + digest.hexdigest().encode())
        await writer.drain()

    backend = RecordingBackend(echo_then_digest)
    async with running(backend):
        balancer = TcpBalancer([backend.address])
        async with running(balancer):
            payload = random.Random(5).randbytes(6 * 1024 * 1024)
            reader, writer = await asyncio.open_connection(LOOPBACK, balancer.port)

            async def send():
                for i in range(0, len(payload), 256 * 1024):
                    writer.write(payload[i : i + 256 * 1024])
                    await writer.drain()
                writer.write_eof()

            _, received = await asyncio.wait_for(asyncio.gather(send(), reader.read()), 15)
            writer.close()
    trailer = b"DIGEST:" + hashlib.sha256(payload).hexdigest().encode()
    assert len(received) == len(payload) + len(trailer)
    assert received == payload + trailer


async def test_backend_half_close_still_lets_the_client_send():
    """The backend sends all it has and shuts its side first; the client's upload still arrives."""
    payload = random.Random(6).randbytes(3 * 1024 * 1024)
    got = asyncio.get_running_loop().create_future()

    async def greet_then_listen(reader, writer):
        writer.write(b"ready")
        writer.write_eof()
        got.set_result(await reader.read())

    backend = RecordingBackend(greet_then_listen)
    async with running(backend):
        balancer = TcpBalancer([backend.address])
        async with running(balancer):
            reader, writer = await asyncio.open_connection(LOOPBACK, balancer.port)
            assert await asyncio.wait_for(reader.read(), 5) == b"ready"  # EOF reached the client
            writer.write(payload)
            writer.write_eof()
            assert await asyncio.wait_for(got, 10) == payload
            writer.close()


async def test_streamed_sse_chunks_arrive_in_order_as_they_are_sent():
    chunks = [f"data: token {i}\n\n".encode() for i in range(6)]
    sent_at: list[float] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await asyncio.sleep(0.05)
            sent_at.append(time.monotonic())
            await response.write(chunk)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/stream", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, LOOPBACK, 0)
    await site.start()
    try:
        backend = (LOOPBACK, runner.addresses[0][1])
        balancer = TcpBalancer([backend])
        async with running(balancer):
            received: list[tuple[float, bytes]] = []
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector) as session:
                async with session.get(f"http://{LOOPBACK}:{balancer.port}/stream") as response:
                    assert response.status == 200
                    async for line in response.content:
                        received.append((time.monotonic(), line))
    finally:
        await runner.cleanup()
    body = b"".join(line for _, line in received)
    assert body == b"".join(chunks)
    first_data_at = next(t for t, line in received if line.startswith(b"data:"))
    # Streaming, not store-and-forward: the first token was read before the last was written.
    assert first_data_at < sent_at[-1]
    assert balancer.connections_per_backend[backend] == 1


# --- refused backends -----------------------------------------------------------------------


async def test_refused_backend_is_retried_on_another():
    live = RecordingBackend()
    with refusing_port() as dead:
        async with running(live):
            balancer = TcpBalancer([dead, live.address], rng=random.Random(3))
            async with running(balancer):
                replies = [await ask(balancer.port) for _ in range(20)]
    assert replies == [format_hostport(live.address).encode()] * 20
    # With 20 connections and two backends the dead one was drawn first at some point
    # (a fixed seed makes this certain, not just likely); each draw cost one retry.
    assert balancer.refused_per_backend[dead] > 0
    assert balancer.connections_per_backend == {dead: 0, live.address: 20}
    assert live.connections == 20
    assert balancer.dropped == 0


async def test_client_connection_is_closed_when_every_backend_refuses():
    with refusing_port() as dead_a, refusing_port() as dead_b:
        balancer = TcpBalancer([dead_a, dead_b], rng=random.Random(0))
        async with running(balancer):
            reader, writer = await asyncio.open_connection(LOOPBACK, balancer.port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                assert await asyncio.wait_for(reader.read(), 5) == b""
            except ConnectionResetError:
                pass  # an abort may reach the client as a reset rather than an EOF
            writer.close()
    assert balancer.accepted == 1
    assert balancer.dropped == 1
    # The retry went to the other backend, not the same refused one.
    assert balancer.refused_per_backend == {dead_a: 1, dead_b: 1}


# --- shutdown -------------------------------------------------------------------------------


async def test_close_stops_listening_and_ends_relayed_connections():
    backend_saw_close = asyncio.get_running_loop().create_future()

    async def hold_open(reader, writer):
        with contextlib.suppress(ConnectionError):
            await reader.read()
        backend_saw_close.set_result(True)

    backend = RecordingBackend(hold_open)
    async with running(backend):
        balancer = TcpBalancer([backend.address])
        await balancer.start()
        port = balancer.port
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        writer.write(b"ping")
        await writer.drain()
        for _ in range(100):  # wait until the balancer has the backend connection
            if balancer.connections_per_backend[backend.address]:
                break
            await asyncio.sleep(0.01)
        assert balancer.active == 1
        await asyncio.wait_for(balancer.close(), 5)
        await asyncio.wait_for(balancer.close(), 5)  # idempotent
        assert balancer.active == 0
        assert await asyncio.wait_for(backend_saw_close, 5)
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        with pytest.raises(OSError):
            await asyncio.open_connection(LOOPBACK, port)


async def test_start_on_a_busy_port_is_a_user_error():
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen()
        balancer = TcpBalancer([(LOOPBACK, 9)], port=busy.getsockname()[1])
        with pytest.raises(UserError, match="cannot listen"):
            await balancer.start()
        await balancer.close()


# --- command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--listen", "127.0.0.1", "--backend", "127.0.0.1:8001"], "missing port"),
        (["--listen", "127.0.0.1:99999", "--backend", "127.0.0.1:8001"], "out of range"),
        (["--listen", "127.0.0.1:0", "--backend", "127.0.0.1"], "missing port"),
        (["--listen", "127.0.0.1:0", "--backend", "127.0.0.1:abc"], "not a number"),
        (["--listen", "127.0.0.1:0", "--backend", "127.0.0.1:0"], "1-65535"),
        (["--listen", "127.0.0.1:0"], "no backend"),
        (["--listen", ":0", "--backend", ":8001", "--backend", "127.0.0.1:8001"], "duplicate"),
    ],
)
def test_cli_bad_addresses_are_one_line_errors(argv, message, capsys):
    assert main(["service", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("kvroute service: error:")
    assert message in err


def test_cli_busy_listen_port_is_a_one_line_error(capsys):
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["service", "--listen", f"{LOOPBACK}:{port}", "--backend", f"{LOOPBACK}:9"]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "cannot listen" in err


def test_cli_help_teaches_per_connection_balancing(capsys):
    with pytest.raises(SystemExit):
        main(["service", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "random" in out
    assert "kube-proxy" in out
    assert "new connection per request" in out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_cli_subprocess_relays_and_exits_cleanly_on_signal(signum):
    backend = RecordingBackend()
    async with running(backend):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvroute",
            "service",
            "--listen",
            f"{LOOPBACK}:0",
            "--backend",
            format_hostport(backend.address),
            "--seed",
            "1",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            banner = (await asyncio.wait_for(process.stdout.readline(), 15)).decode()
            assert "listening on" in banner, banner
            port = int(banner.split("listening on ")[1].split(",")[0].rsplit(":", 1)[1])
            # A payload bigger than one read, with a half-close, through uvloop's streams.
            assert await ask(port, b"x" * 200_000) == format_hostport(backend.address).encode()
            process.send_signal(signum)
            stdout, stderr = await asyncio.wait_for(process.communicate(), 10)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert process.returncode == 0, stderr.decode()
    summary = stdout.decode()
    assert "1 connections accepted, 0 dropped" in summary
    assert re.search(rf"{re.escape(format_hostport(backend.address))}\s+1 connections", summary)
    assert backend.connections == 1
