"""An L4 TCP balancer that picks a backend at random per connection, like a Kubernetes Service.

The reference experiment's baseline is a Kubernetes Service in front of the vLLM replicas.
kube-proxy balances at the TCP level: when a client opens a connection it picks one ready
pod at random and NATs the whole connection to it; it never looks at HTTP. Two consequences
matter for prefix caching and are reproduced here:

* the choice is per *connection*, not per request: a client that reuses a keep-alive
  connection stays on one backend (so a fair benchmark opens a new connection per request);
* the choice ignores content, so every shared prefix eventually lands on every backend.

``TcpBalancer`` does the same locally with asyncio streams: accept, choose uniformly at
random, connect, then copy bytes both ways unchanged. Half-closes are forwarded (an EOF from
one side becomes ``write_eof`` towards the other while the opposite direction keeps
flowing), and an error on either side tears the pair down, as a reset would through NAT.

One deliberate difference from iptables-mode kube-proxy: a backend that refuses the
connection is retried once on another backend. kube-proxy only forwards to pods that pass
their readiness probe, so a client there rarely meets a refusal; the retry stands in for that
filtering without running health checks.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import socket
from collections.abc import Sequence

from kvroute.errors import UserError

logger = logging.getLogger(__name__)

Address = tuple[str, int]

#: Bytes read per relay step. Large enough that multi-megabyte bodies need few wake-ups,
#: small enough that one connection cannot buffer much more than it can write (the writer's
#: ``drain`` applies backpressure after every chunk).
_RELAY_CHUNK = 64 * 1024


def parse_hostport(text: str, default_host: str | None = None) -> Address:
    """Parse ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) into ``(host, port)``.

    ``:PORT`` or a bare ``PORT`` take ``default_host`` when one is given. Port 0 is accepted
    (it means "any free port" when listening); callers that need a real port check for it.

    Raises:
        UserError: on a missing or non-numeric port, a port outside 0-65535, or a missing host.
    """
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise UserError(f"bad address {text!r}: expected [IPv6]:PORT, e.g. [::1]:8000")
        port_text = rest[1:]
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
        if ":" in host:
            raise UserError(f"bad address {text!r}: write IPv6 hosts in brackets, e.g. [::1]:8000")
    elif text.isdigit() and default_host is not None:
        host, port_text = "", text
    else:
        raise UserError(
            f"bad address {text!r}: missing port, expected HOST:PORT, e.g. 127.0.0.1:8000"
        )
    if not host:
        if default_host is None:
            raise UserError(f"bad address {text!r}: missing host, expected HOST:PORT")
        host = default_host
    if not port_text:
        raise UserError(f"bad address {text!r}: missing port, expected HOST:PORT")
    if not port_text.isdigit():
        raise UserError(f"bad address {text!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise UserError(f"bad address {text!r}: port {port} is out of range 0-65535")
    return host, port


def format_hostport(address: Address) -> str:
    """Inverse of ``parse_hostport``: IPv6 literals get brackets so the result parses back."""
    host, port = address
    try:
        bracket = ipaddress.ip_address(host).version == 6
    except ValueError:
        bracket = False
    return f"[{host}]:{port}" if bracket else f"{host}:{port}"


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    """Disable Nagle's algorithm so small streamed writes (SSE tokens) are not held back.

    Without it a relay that forwards token-sized writes waits for the previous segment's ACK
    before sending the next one, adding delayed-ACK latency to inter-token times. asyncio's
    and uvloop's TCP transports currently enable it by default; setting it here keeps the
    guarantee from resting on an event loop's default.
    """
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes from ``reader`` to ``writer`` until EOF, then half-close ``writer``.

    Raises OSError (reset, broken pipe) when either side fails; the caller then tears down
    the whole connection.
    """
    while data := await reader.read(_RELAY_CHUNK):
        writer.write(data)
        await writer.drain()
    # Forward the half-close: the peer learns "no more data" while it may still answer.
    if writer.can_write_eof():
        writer.write_eof()


class TcpBalancer:
    """Accepts TCP connections and relays each to a backend chosen uniformly at random.

    Args:
        backends: ``(host, port)`` of each backend; at least one, no duplicates (a duplicate
            would silently double that backend's share).
        host, port: where to listen; port 0 binds a free port, see ``port`` after ``start``.
        rng: source of the random choices; pass a seeded ``random.Random`` for reproducible
            assignments.
        connect_timeout: seconds to wait for a backend to accept before trying another.

    Counters (read them at any time; the experiment reports them next to the workers' own):
        accepted: client connections accepted.
        connections_per_backend: connections successfully opened to each backend.
        refused_per_backend: connection attempts each backend refused or timed out.
        dropped: client connections closed because no backend accepted them.
    """

    def __init__(
        self,
        backends: Sequence[Address],
        host: str = "127.0.0.1",
        port: int = 0,
        rng: random.Random | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        backends = [(str(h), int(p)) for h, p in backends]
        if not backends:
            raise ValueError("at least one backend is needed")
        if len(set(backends)) != len(backends):
            raise ValueError("duplicate backends: each backend may appear only once")
        for backend in backends:
            if not 0 < backend[1] <= 65535:
                raise ValueError(f"backend {format_hostport(backend)}: port must be 1-65535")
        self.backends: list[Address] = backends
        self.host = host
        self._requested_port = port
        self._rng = rng if rng is not None else random.Random()
        self._connect_timeout = connect_timeout
        self._server: asyncio.Server | None = None
        self._closing = False
        self._relays: set[asyncio.Task] = set()
        self.accepted = 0
        self.dropped = 0
        self.connections_per_backend: dict[Address, int] = {b: 0 for b in backends}
        self.refused_per_backend: dict[Address, int] = {b: 0 for b in backends}

    async def start(self) -> None:
        """Bind and start accepting. Raises UserError when the address cannot be bound."""
        if self._server is not None or self._closing:
            raise RuntimeError("TcpBalancer.start() may be called only once")
        try:
            self._server = await asyncio.start_server(
                self._handle, self.host, self._requested_port, limit=_RELAY_CHUNK
            )
        except OSError as exc:
            where = format_hostport((self.host, self._requested_port))
            raise UserError(f"cannot listen on {where}: {exc.strerror or exc}") from exc
        logger.info(
            "listening on %s, %d backends, random per connection",
            format_hostport((self.host, self.port)),
            len(self.backends),
        )

    @property
    def port(self) -> int:
        """The bound port (the ephemeral one chosen by the OS when started with port 0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the balancer is not listening")
        return self._server.sockets[0].getsockname()[1]

    @property
    def active(self) -> int:
        """Client connections currently being relayed (or connecting to a backend)."""
        return len(self._relays)

    async def close(self) -> None:
        """Stop listening and abort every relayed connection. Safe to call more than once."""
        if self._closing:
            return
        self._closing = True
        if self._server is not None:
            self._server.close()
        relays = list(self._relays)
        for task in relays:
            task.cancel()
        await asyncio.gather(*relays, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        logger.info("closed: %s", self.summary())

    def summary(self) -> str:
        """Multi-line account of the counters, for logs and the CLI's exit message."""
        lines = [
            f"{self.accepted} connections accepted, {self.dropped} dropped (no backend accepted)"
        ]
        width = max(len(format_hostport(b)) for b in self.backends)
        for backend in self.backends:
            count = self.connections_per_backend[backend]
            line = f"  {format_hostport(backend):<{width}}  {count:>8} connections"
            if refused := self.refused_per_backend[backend]:
                line += f", {refused} refused"
            lines.append(line)
        return "\n".join(lines)

    def reseed(self, seed: int) -> None:
        """Restart the backend choices from ``seed`` (one draw per connection from here on)."""
        self._rng.seed(seed)

    async def _handle(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        """One client connection: choose a backend, connect (retrying once), relay, clean up."""
        if self._closing:
            # Accepted in the instant before close() stopped the listener.
            client_writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._relays.add(task)
        self.accepted += 1
        backend_writer: asyncio.StreamWriter | None = None
        clean = False
        try:
            _set_nodelay(client_writer)
            connected = await self._connect()
            if connected is None:
                self.dropped += 1
                return
            backend_reader, backend_writer = connected
            _set_nodelay(backend_writer)
            clean = await self._relay(client_reader, client_writer, backend_reader, backend_writer)
        except asyncio.CancelledError:
            # close() or loop shutdown cut this connection. Nobody awaits a connection handler,
            # and asyncio's stream callback logs a cancelled one as an error, so end quietly.
            return
        finally:
            self._relays.discard(task)
            for writer in (client_writer, backend_writer):
                if writer is None:
                    continue
                if clean:
                    writer.close()
                else:
                    # A failed side (or close()) ends the pair at once, as a TCP reset would.
                    writer.transport.abort()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Open a connection to a random backend; on refusal try one other. None if both fail."""
        backend = self._rng.choice(self.backends)
        for attempt in range(2):
            if attempt:
                # Drawn only after a refusal, so a seeded balancer's choices are one draw per
                # connection. With a single backend the retry goes to the same one: it may have
                # just restarted.
                others = [b for b in self.backends if b != backend]
                backend = self._rng.choice(others) if others else backend
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(*backend, limit=_RELAY_CHUNK), self._connect_timeout
                )
            except (TimeoutError, OSError) as exc:
                self.refused_per_backend[backend] += 1
                # Warn once per backend; the exit summary has the totals.
                log = logger.warning if self.refused_per_backend[backend] == 1 else logger.debug
                log(
                    "backend %s did not accept a connection: %s",
                    format_hostport(backend),
                    str(exc) or type(exc).__name__,
                )
                continue
            self.connections_per_backend[backend] += 1
            return reader, writer
        return None

    @staticmethod
    async def _relay(
        client_reader: asyncio.StreamReader,
        client_writer: asyncio.StreamWriter,
        backend_reader: asyncio.StreamReader,
        backend_writer: asyncio.StreamWriter,
    ) -> bool:
        """Copy both directions until both have ended. True if both ended with a clean EOF."""
        upstream = asyncio.ensure_future(_pipe(client_reader, backend_writer))
        downstream = asyncio.ensure_future(_pipe(backend_reader, client_writer))
        try:
            # Each direction ends on its own EOF (half-close); an error in either ends both.
            await asyncio.wait((upstream, downstream), return_when=asyncio.FIRST_EXCEPTION)
        finally:
            upstream.cancel()
            downstream.cancel()
            await asyncio.gather(upstream, downstream, return_exceptions=True)
        return not any(t.cancelled() or t.exception() is not None for t in (upstream, downstream))
