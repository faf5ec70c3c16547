"""The router's client-facing connections, bounded: what a slow or hostile client may hold.

aiohttp's server, as ``web.AppRunner`` builds it, waits for a request head as long as its
keep-alive timeout (an hour by default) and accepts connections until ``accept()`` fails for
want of file descriptors, at which point the listening socket stops answering anyone: valid
clients time out with no answer at all. This module replaces the runner's connection factory
(:class:`GuardedRunner`) with one that

* closes a connection whose request head (request line and headers) is not complete
  ``header_timeout_s`` after it opened, or after the head's first byte on a kept-alive
  connection (slowloris), with a 408 when some of it arrived;
* closes a kept-alive connection idle for ``keepalive_timeout_s`` (aiohttp's own timer);
* at ``max_connections`` closes the connection waiting longest for its request head to admit
  a new one (slow-header connections cannot lock valid clients out), or, when none waits,
  answers the new one with a 503 and closes it, so that the descriptors run out never:
  :func:`default_max_connections` derives the limit from ``RLIMIT_NOFILE``.

Each closure is counted (``kvroute_router_client_timeouts{kind}``,
``kvroute_router_connections_refused``); the body's own timeout and size limits are the
request handler's (:mod:`kvroute.proxy.app`), which sees them before reading it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import resource
import sys
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from kvroute.proxy.metrics import RouterMetrics

logger = logging.getLogger(__name__)

#: Descriptors kept out of the connection limit: the listening socket, logs, the tokenizer's
#: files, health checks and KV event sockets (ZeroMQ: two per worker and a few of its own).
FD_RESERVE = 128
#: Refused connections lingering at once (reading the client's request so that closing does
#: not reset the connection before the 503 is read); beyond it a refusal closes at once.
MAX_LINGERING_REFUSALS = 64
#: How long a refused connection may linger.
REFUSAL_LINGER_S = 1.0

_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)
_REFUSED_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
)


def _canned(template: bytes, status: int, message: str, err_type: str) -> bytes:
    body = (
        b'{"error":{"message":"%s","type":"%s","param":null,"code":%d}}'
        % (message.encode(), err_type.encode(), status)
    )
    return template % (len(body), body)


_HEADER_TIMEOUT_RESPONSE = _canned(
    _TIMEOUT_408, 408, "request head not received in time", "RequestTimeout"
)
_REFUSED_RESPONSE = _canned(
    _REFUSED_503, 503, "too many connections; retry", "ServiceUnavailable"
)


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may hold.

    Attributes:
        header_timeout_s: seconds for a request head to arrive (see the module docstring).
        keepalive_timeout_s: seconds a kept-alive connection may wait for its next request.
        max_connections: open client connections at most; more are answered 503.
    """

    header_timeout_s: float
    keepalive_timeout_s: float
    max_connections: int


def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (what Go and nginx do at
    start: the soft limit is often 1024 while the hard one allows far more); the soft limit
    in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


def default_max_connections(fd_limit: int | None = None) -> int:
    """Client connections that can never exhaust ``fd_limit`` descriptors (default: the
    process's soft ``RLIMIT_NOFILE``): each client connection with a request in flight holds a
    second descriptor, its connection to the worker, and :data:`FD_RESERVE` stay for the
    rest. ``(1024 - 128) // 2 = 448`` under ``ulimit -n 1024``."""
    if fd_limit is None:
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if fd_limit == resource.RLIM_INFINITY:
        fd_limit = 1 << 20
    return max(16, (fd_limit - FD_RESERVE) // 2)


def return_freed_memory_promptly() -> None:
    """Make glibc's malloc give large freed blocks back to the system (serving only).

    glibc raises its mmap threshold each time a large block is freed, so after one 50 MB
    request every later 1 MB buffer comes from the heap, where fragmentation keeps it in the
    RSS long after it is freed (the router stayed at ~800 MB). A fixed 128 KiB threshold keeps
    large buffers in their own mappings, returned when freed. Elsewhere than glibc: no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 128 * 1024)
    mallopt(m_trim_threshold, 1024 * 1024)


class _GuardedHandler(RequestHandler):
    """aiohttp's connection handler with a deadline for each request head."""

    __slots__ = ("_guard", "_head_handle", "_head_bytes", "_head_count")

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._head_handle: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._head_count = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # A new connection must send its first head in time, whether or not it sends a byte.
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_handle is None:
            self._head_count = self._request_count
            self._head_bytes = 0
            self._head_handle = self._loop.call_later(
                self._guard.limits.header_timeout_s, self._head_timed_out
            )
            self._guard.awaiting_head[self] = None

    def _cancel_head_timer(self) -> None:
        if self._head_handle is not None:
            self._head_handle.cancel()
            self._head_handle = None
            if self._guard is not None:
                self._guard.awaiting_head.pop(self, None)

    def shed(self) -> None:
        """Closed to make room for a new connection: it had the oldest unfinished head."""
        self._cancel_head_timer()
        self.force_close()

    def data_received(self, data: bytes) -> None:
        waiting = self._payload_parser is None and not self._messages and not self._request_in_progress
        if waiting and data:
            # The first bytes of a new head on a kept-alive connection start its clock.
            self._arm_head_timer()
            self._head_bytes += len(data)
        super().data_received(data)
        if self._head_handle is not None and self._request_count != self._head_count:
            self._cancel_head_timer()  # a whole head arrived

    def _head_timed_out(self) -> None:
        self._head_handle = None
        self._guard.awaiting_head.pop(self, None)
        if self._request_count != self._head_count or self._request_in_progress or self._force_close:
            return
        self._guard.metrics.client_timeouts.labels("header").inc()
        transport = self.transport
        if transport is not None and self._head_bytes:
            transport.write(_HEADER_TIMEOUT_RESPONSE)
        self.force_close()

    def _process_keepalive(self) -> None:
        closed = self._force_close
        super()._process_keepalive()
        if self._force_close and not closed:
            self._guard.metrics.client_timeouts.labels("idle").inc()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        if self._guard is not None:
            self._guard.open_connections -= 1
            self._guard = None  # counted once
        super().connection_lost(exc)

    def _head_timer_for_next(self) -> None:
        if self._guard is not None and not self._force_close and not self._messages:
            # Back to waiting: the keep-alive timer covers silence; a head that begins starts
            # its own clock (data_received).
            self._cancel_head_timer()

    async def _handle_request(self, request, start_time, request_handler):  # noqa: ANN001, ANN202
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            self._head_timer_for_next()


class _Refusal(asyncio.Protocol):
    """A connection beyond the limit: answered 503, its request read and dropped, closed."""

    def __init__(self, server: GuardedServer) -> None:
        self._server = server
        self._transport: Any = None
        self._handle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses: no isinstance check.)
        self._transport = transport
        server = self._server
        server.metrics.connections_refused.inc()
        transport.write(_REFUSED_RESPONSE)
        if server.lingering >= MAX_LINGERING_REFUSALS or not transport.can_write_eof():
            transport.close()
            return
        server.lingering += 1
        transport.write_eof()
        self._handle = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not served

    def eof_received(self) -> bool:
        return False  # close

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._server.lingering -= 1


class GuardedServer(Server):
    """aiohttp's low-level server with :class:`ConnectionLimits`."""

    def __init__(self, handler: Any, *, limits: ConnectionLimits, metrics: RouterMetrics, **kwargs: Any) -> None:
        kwargs["keepalive_timeout"] = limits.keepalive_timeout_s
        super().__init__(handler, **kwargs)
        self.limits = limits
        self.metrics = metrics
        #: Client connections accepted and not yet lost (counted at accept, before
        #: ``connection_made``, so a burst of accepts cannot overshoot the limit).
        self.open_connections = 0
        #: Connections waiting for a request head, oldest first: at the limit the oldest is
        #: closed to admit a new one, so slow-header connections cannot lock valid clients out.
        self.awaiting_head: dict[_GuardedHandler, None] = {}
        self.lingering = 0
        metrics.connections.set_function(lambda: self.open_connections)

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]
        if self.open_connections >= self.limits.max_connections:
            oldest = next(iter(self.awaiting_head), None)
            if oldest is None:
                return _Refusal(self)  # every connection has a request or is kept alive
            self.metrics.client_timeouts.labels("shed").inc()
            oldest.shed()  # counted out at its connection_lost; admitted meanwhile
            # The shed connection is lost a moment later; until then one over the limit.
        self.open_connections += 1
        return _GuardedHandler(self, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """``web.AppRunner`` whose server is a :class:`GuardedServer`."""

    __slots__ = ("_limits", "_metrics")

    def __init__(self, app: web.Application, *, limits: ConnectionLimits, metrics: RouterMetrics, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._limits = limits
        self._metrics = metrics

    async def _make_server(self) -> Server:
        loop = asyncio.get_running_loop()
        app = self._app
        app._set_loop(loop)
        app.on_startup.freeze()
        await app.startup()
        app.freeze()
        kwargs = dict(self._kwargs)
        kwargs["debug"] = app._debug
        kwargs.update(app._handler_args or {})
        return GuardedServer(
            app._handle, request_factory=app._make_request, loop=loop,
            limits=self._limits, metrics=self._metrics, **kwargs,
        )
