"""A lean HTTP/1.1 client connection for the bench: one streamed POST at a time.

Why not aiohttp here: the bench measures TTFT, so every microsecond its own client spends
between "send" and "first token seen" is added to the figure. aiohttp's client builds a
request object, a header multidict, a connector key, a response object and a stream reader
per request, and wakes the reading task once per chunk; at 200 requests/s that machinery is
most of the client's share of TTFT. This module does only what a benchmark needs:

* the request is framed from a head built once per (client, path) and the body the
  ``BenchRequest`` already holds, and written with one ``transport.write``;
* the response is parsed by httptools' ``HttpResponseParser`` (llhttp, in C: status line,
  headers, chunked and content-length framing) straight from ``data_received``, and each body
  piece goes to a :class:`BodySink` in the same callback, so no task wakes per chunk; the
  sending task is woken once, when the exchange is over.

The split follows h11's sans-I/O idea loosely: :class:`BenchConnection` only turns bytes into
callbacks and knows when an exchange has ended; what a body means (SSE events, an error body)
is the sink's business (client.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import httptools

#: Most bytes of a non-200 body kept (enough for any JSON error; the rest is discarded).
ERROR_BODY_KEEP = 64 * 1024


class BodySink(Protocol):
    """Where the body of a response goes, piece by piece, as it arrives."""

    def feed(self, data: bytes, now: float) -> bool:
        """Body bytes read at ``now``; returns True when nothing more is needed (the SSE
        stream said ``[DONE]``), which ends the exchange before the message's framing does."""

    def finish(self, now: float) -> None:
        """The body ended (its framing said so, or the server closed a body without one)."""


class ExchangeError(Exception):
    """The response could not be read: the connection broke or the bytes were not HTTP."""


class BenchConnection(asyncio.Protocol):
    """One TCP (or TLS) connection, carrying one exchange at a time.

    Use: ``await start(request_bytes, sink_for_status, to_message_end)``; or, for a new
    connection, give the same arguments to the constructor: the request is then written from
    ``connection_made``, one event-loop turn before the connecting task would resume to
    write it, and ``exchange`` is the future to await. The exchange ends
    when the sink is done (``[DONE]``), or, with ``to_message_end`` (a connection to be
    reused), only once the message's framing is complete too; also when the connection is
    lost. It fails with :class:`ExchangeError` when the response is broken or cut short.
    Afterwards ``status`` and ``worker`` describe the response, ``answered_at`` is the
    perf_counter of the read that completed it (the sink's end: ``[DONE]`` or the body's
    end), and ``reusable`` says whether the connection may carry another exchange.
    """

    def __init__(
        self, worker_header: bytes, request: bytes | None = None,
        sink_for_status: Callable[[int], BodySink] | None = None, to_message_end: bool = False,
    ) -> None:
        self._worker_header = worker_header.lower()
        self._first = (request, sink_for_status, to_message_end) if request is not None else None
        self._sink_for_status: Callable[[int], BodySink] | None = None
        self.transport: asyncio.Transport | None = None
        self.exchange: asyncio.Future | None = None
        self.status = 0
        self.worker: str | None = None
        self.closed = False
        self.reusable = False
        self.answered_at: float | None = None
        self._to_message_end = False
        self._parser: httptools.HttpResponseParser | None = None
        self._sink: BodySink | None = None
        self._framed = False  # Content-Length or Transfer-Encoding: the body's end is known
        self._now = 0.0

    # -- driving an exchange ------------------------------------------------------------------

    def start(
        self, request: bytes, sink_for_status: Callable[[int], BodySink], to_message_end: bool = False
    ) -> asyncio.Future:
        """Write one request and return the future of its exchange. ``sink_for_status`` is
        called with the status code once the headers are in and returns the body's sink."""
        self._sink_for_status = sink_for_status
        self._to_message_end = to_message_end
        self.status = 0
        self.worker = None
        self.reusable = False
        self.answered_at = None
        self._sink = None
        self._framed = False
        self._parser = httptools.HttpResponseParser(self)
        self.exchange = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.exchange

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection at once (timeout, cancellation): nothing more is read."""
        if self.transport is not None:
            self.transport.abort()

    def _end(self, error: str | None = None) -> None:
        exchange = self.exchange
        if exchange is not None and not exchange.done():
            if error is None:
                exchange.set_result(None)
            else:
                exchange.set_exception(ExchangeError(error))

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self._first is not None:
            first, self._first = self._first, None
            self.start(*first)

    def data_received(self, data: bytes) -> None:
        # One timestamp per network read: everything in this read arrived together.
        self._now = time.perf_counter()
        parser = self._parser
        if parser is None:
            return  # bytes nobody asked for (an idle pooled connection); the next start resets
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail("unexpected protocol upgrade")
        except httptools.HttpParserError as exc:
            self._fail(f"invalid HTTP response: {exc}")

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        sink = self._sink
        # Break the reference cycles (parser ↔ self, transport ↔ self, the sink's closure) so
        # that a finished connection is freed by its reference count, not left for the cyclic
        # collector: thousands a second would mean frequent collections inside the window.
        self._parser = self._sink = self._sink_for_status = self.transport = None
        if self.exchange is None or self.exchange.done():
            return
        if sink is not None and exc is None and (self.answered_at is not None or not self._framed):
            # The sink had all it needed (keep-alive: waiting only for the framing's end), or
            # a body without Content-Length or chunked framing ends when the server closes.
            if self.answered_at is None:
                self.answered_at = time.perf_counter()
                sink.finish(self.answered_at)
            self._end()
            return
        reason = "server closed the connection before the response ended"
        if exc is not None:
            reason += f" ({type(exc).__name__}: {exc})"
        self._end(reason)

    def _fail(self, reason: str) -> None:
        self._end(reason)
        self.abort()

    # -- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == self._worker_header:
            self.worker = value.decode("utf-8", "replace")
        elif name == b"content-length" or name == b"transfer-encoding":
            self._framed = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._sink = self._sink_for_status(self.status)

    def on_body(self, body: bytes) -> None:
        if self._sink.feed(body, self._now) and self.answered_at is None:
            self.answered_at = self._now
            if not self._to_message_end:
                self._end()

    def on_message_complete(self) -> None:
        self.reusable = not self.closed and self._parser.should_keep_alive()
        if self.answered_at is None:
            self.answered_at = self._now
            self._sink.finish(self._now)
        self._end()
