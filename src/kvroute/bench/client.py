"""The async streaming client and the load generators.

One ``BenchClient`` sends pre-encoded ``BenchRequest`` bodies and turns each streamed response
into a ``RequestRecord``. Measurement rules it keeps (docs/experiment.md):

* **A new TCP connection per request** unless ``keep_alive``: a balancer that chooses per
  connection (kube-proxy) must get a fresh choice for every request, or a pooled client stays
  pinned to one worker and flatters the baseline. The request says ``Connection: close`` and
  the client closes the connection once the response is read, so the next request connects
  again (tests count the connections a server accepts).
* **Low overhead**: the HTTP exchange is :mod:`kvroute.bench.wire` (httptools' C parser driven
  from the transport's callbacks, no task wake-up per chunk), timestamps are
  ``time.perf_counter`` taken once per network read, and a chunk is decoded by msgspec into a
  tiny typed struct; nothing else happens per token. All events that arrive in one read get
  that read's timestamp (they did arrive together).

TTFT is measured from just before the client frames the request and connects (connection
set-up included, as a user experiences it) to the first chunk that carries generated text;
inter-token latencies are the gaps between content chunks; ``cached_tokens`` comes from the
final usage chunk (``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import gc
import socket
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import SplitResult, urlsplit

import msgspec

from kvroute.aio import WaitTimeout
from kvroute.bench.prompts import BenchRequest
from kvroute.bench.wire import ERROR_BODY_KEEP, BenchConnection, ExchangeError
from kvroute.errors import UNDECODABLE, UserError
from kvroute.records import RequestRecord

#: Response header naming the worker that served a request (set by kvroute's router).
WORKER_HEADER = "x-kvroute-worker"

#: Most bytes of an error body kept in a record.
_ERROR_BODY_LIMIT = 300


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    """The parts of a completion or chat chunk the bench reads; everything else is skipped
    by the decoder without building Python objects."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _has_content(chunk: _Chunk) -> bool:
    for choice in chunk.choices:
        if choice.text:
            return True
        delta = choice.delta
        if delta is not None and (delta.content or delta.reasoning_content):
            return True
    return False


class StreamResult:
    """What one streamed response told us (filled in while reading).

    It is also the SSE decoder: :meth:`feed` takes body bytes as they arrive. vLLM writes one
    ``data: {...}`` line per event, events separated by a blank line; lines may end in
    ``\\r\\n``. A partial line stays buffered until its end arrives.
    """

    __slots__ = ("first_content", "content_times", "usage", "error", "done", "_pending")

    def __init__(self) -> None:
        self.first_content: float | None = None
        self.content_times: list[float] = []
        self.usage: _Usage | None = None
        self.error: str | None = None
        self.done = False
        self._pending = b""

    def feed(self, data: bytes, now: float) -> bool:
        """Body bytes read at ``now``; returns True once ``[DONE]`` has been seen."""
        if self._pending:
            data = self._pending + data
        lines = data.split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                self.feed_event(line[5:].strip(), now)
        return self.done

    def finish(self, now: float) -> None:
        """The body ended: a last line without its newline still counts."""
        pending, self._pending = self._pending, b""
        if not self.done and pending.startswith(b"data:"):
            self.feed_event(pending[5:].strip(), now)

    def feed_event(self, payload: bytes, now: float) -> None:
        """One ``data:`` payload that arrived at ``now``."""
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            chunk = _decode_chunk(payload)
        except UNDECODABLE:
            self.error = f"unparsable stream chunk: {payload[:80]!r}"
            return
        if chunk.error is not None:
            self.error = str(chunk.error.get("message", chunk.error))[:_ERROR_BODY_LIMIT]
        if _has_content(chunk):
            if self.first_content is None:
                self.first_content = now
            self.content_times.append(now)
        if chunk.usage is not None:
            self.usage = chunk.usage


async def read_sse(content, result: StreamResult) -> None:
    """Read an SSE body into ``result`` from a stream with an async ``readany()`` (aiohttp's
    ``StreamReader``; the aiohttp reference client of benchmarks/bench_client_overhead.py),
    one timestamp per read."""
    clock = time.perf_counter
    while True:
        data = await content.readany()
        if not data:
            break
        if result.feed(data, clock()):
            return
    result.finish(clock())


class _ErrorBody:
    """The sink for a non-200 body: keeps its first bytes for the record's error."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = bytearray()

    def feed(self, data: bytes, now: float) -> bool:
        if len(self.data) < ERROR_BODY_KEEP:
            self.data += data[: ERROR_BODY_KEEP - len(self.data)]
        return False

    def finish(self, now: float) -> None:
        pass


def check_bench_url(url: str) -> SplitResult:
    """``url`` split, once it is one the bench can send to.

    Raises:
        UserError: not http(s), no host, or credentials in it.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"bench URL must be http://HOST[:PORT][/PREFIX] or https://..., got {url!r}")
    if parts.username is not None or parts.password is not None:
        # Not sent (an OpenAI-compatible server takes a bearer key): refused rather than dropped.
        raise UserError("the bench URL carries credentials (USER:PASSWORD@), which are not sent; "
                        "give the server's API key with --api-key (or $OPENAI_API_KEY)")
    return parts


def openai_base_url(url: str) -> str:
    """The server's base URL, whether ``url`` names it or its OpenAI API root: vLLM and
    ``kvroute emulate`` print ``http://HOST:PORT/v1``, the bench appends ``/v1/...`` itself."""
    return url.rstrip("/").removesuffix("/v1")


class BenchClient:
    """Sends requests to one OpenAI-compatible base URL.

    Args:
        url: base URL, ``http://`` or ``https://`` (TLS with the default certificate checks),
            with an optional path prefix, e.g. ``http://127.0.0.1:8000`` or
            ``https://gw.example/team-a``.
        keep_alive: pool connections (off by default: see the module docstring).
        timeout_s: limit for one whole request (connection set-up included).
        api_key: sent as ``Authorization: Bearer KEY`` (a server started with ``--api-key``).

    Use as an async context manager, or call ``close``. The host name is resolved once, on
    the first request (as aiohttp's DNS cache would within its 300 s), so no request pays
    for a lookup.

    Raises:
        UserError: the URL is not http(s), has no host, or carries credentials.
    """

    def __init__(
        self, url: str, keep_alive: bool = False, timeout_s: float = 600.0, api_key: str | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.keep_alive = keep_alive
        self.timeout_s = timeout_s
        parts = check_bench_url(self.url)
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.encode()
        authority = parts.netloc
        if api_key is not None and (not api_key or any(c in api_key for c in "\r\n")):
            raise UserError("the API key must be one non-empty line")
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self._head_tail = (
            f" HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\n{auth}"
            f"Connection: {'keep-alive' if keep_alive else 'close'}\r\nContent-Length: "
        ).encode()
        self._heads: dict[str, bytes] = {}
        self._addresses: list[tuple[str, int]] | None = None
        self._worker_header = WORKER_HEADER.encode()
        self._idle: list[BenchConnection] = []  # keep-alive: connections ready for a request

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def send(self, request: BenchRequest, window_start: float) -> RequestRecord:
        """Send one request and wait for the end of its stream.

        Never raises for a failed request: the failure is recorded (``status`` 0 when no
        response arrived) so it stays in the denominators.
        """
        loop = asyncio.get_running_loop()
        clock = time.perf_counter
        sent = clock()
        result = StreamResult()
        error_body = None

        def sink_for_status(status: int):
            nonlocal error_body
            if status == 200:
                return result
            error_body = _ErrorBody()
            return error_body

        deadline = WaitTimeout(self.timeout_s, waiting=True)  # the whole request is one wait
        conn = None
        finished = False
        # Keep-alive reads each response to the end of its framing (the chunked terminator may
        # come after [DONE]) so that the connection can carry the next request.
        exchange = (self._frame(request), sink_for_status, self.keep_alive)
        try:
            conn = self._pooled()
            if conn is None:
                conn = await self._connect(loop, exchange)  # writes the request once connected
                await conn.exchange
            else:
                await conn.start(*exchange)
            finished = True
        except asyncio.CancelledError:
            if not deadline.expired():
                raise
            result.error = f"timed out after {self.timeout_s:g} s"
        except ExchangeError as exc:
            result.error = str(exc)[:_ERROR_BODY_LIMIT]
        except OSError as exc:
            result.error = f"cannot connect to {self._host}:{self._port}: {type(exc).__name__}: {exc}"[
                :_ERROR_BODY_LIMIT
            ]
        finally:
            deadline.stop()
            if conn is not None:
                self._release(conn, finished)
        # The end is the read that completed the answer, not this task's wake-up after it.
        end = conn.answered_at if finished and conn.answered_at is not None else clock()
        status = 0 if conn is None else conn.status
        worker = None if conn is None else conn.worker
        if error_body is not None and finished:
            result.error = f"HTTP {status}: {_error_message(bytes(error_body.data))}"
        elif status == 200 and finished and not result.done and result.error is None:
            result.error = "stream ended without [DONE]"
        return _record(request, sent - window_start, sent, end, status, worker, result)

    def _frame(self, request: BenchRequest) -> bytes:
        """Request line, headers and body as one buffer (one write, one segment burst)."""
        head = self._heads.get(request.path)
        if head is None:
            head = self._heads[request.path] = b"POST " + self._prefix + request.path.encode() + self._head_tail
        body = request.body
        return b"%s%d\r\n\r\n%s" % (head, len(body), body)

    def _pooled(self) -> BenchConnection | None:
        """An idle connection still open (keep-alive), if any."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop, exchange: tuple) -> BenchConnection:
        """A new connection that starts ``exchange`` (its ``BenchConnection`` arguments) as
        soon as it is made."""
        if self._addresses is None:
            infos = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
            self._addresses = list(dict.fromkeys(info[4][:2] for info in infos))
        server_hostname = self._host if self._ssl is not None else None
        error: OSError | None = None
        for address in list(self._addresses):  # in resolver order, as aiohttp tries them
            try:
                _, conn = await loop.create_connection(
                    lambda: BenchConnection(self._worker_header, *exchange),
                    *address, ssl=self._ssl, server_hostname=server_hostname,
                )
            except OSError as exc:
                error = exc
                continue
            if address != self._addresses[0]:
                # Try the address that answered first from now on ("localhost" resolving
                # to ::1 first for a server listening on 127.0.0.1 only would otherwise
                # cost every request a refused connection attempt).
                self._addresses.remove(address)
                self._addresses.insert(0, address)
            return conn
        raise error

    def _release(self, conn: BenchConnection, finished: bool) -> None:
        """After an exchange: pool the connection (keep-alive, and the server keeps it open),
        close it (the default), or abort it (a failed or cancelled exchange)."""
        if not finished:
            conn.abort()
        elif self.keep_alive and conn.reusable:
            self._idle.append(conn)
        else:
            conn.close()


def _error_message(body: bytes) -> str:
    try:
        obj = msgspec.json.decode(body)
        if isinstance(obj, dict):
            err = obj.get("error", obj)
            message = err.get("message", err) if isinstance(err, dict) else err
            return str(message)[:_ERROR_BODY_LIMIT]
    except UNDECODABLE:
        pass
    return body[:_ERROR_BODY_LIMIT].decode("utf-8", "replace")


def _record(
    request: BenchRequest, send_time: float, sent: float, end: float, status: int,
    worker: str | None, result: StreamResult,
) -> RequestRecord:
    usage = result.usage
    cached = None
    prompt_tokens = request.prompt_tokens
    output_tokens = len(result.content_times)
    if usage is not None:
        if usage.prompt_tokens is not None:
            prompt_tokens = usage.prompt_tokens
        if usage.completion_tokens is not None:
            output_tokens = usage.completion_tokens
        if usage.prompt_tokens_details is not None:
            cached = usage.prompt_tokens_details.cached_tokens
    times = result.content_times
    ok = status == 200 and result.error is None
    return RequestRecord(
        index=request.index,
        prefix_id=request.prefix_id,
        send_time=send_time,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        ttft_s=None if result.first_content is None else result.first_content - sent,
        e2e_s=end - sent if ok else None,
        output_tokens=output_tokens,
        status=status,
        error=result.error,
        worker=worker,
        session_id=request.session_id,
        itl_s=[b - a for a, b in zip(times, times[1:])],
    )


# -- load generation -----------------------------------------------------------------------

OnRecord = Callable[[RequestRecord], None]


@contextmanager
def _frozen_heap() -> Iterator[None]:
    """Hide everything alive before the measured window from the cyclic collector while it
    runs (``gc.freeze``), as ``kvroute serve`` does: a full collection would otherwise walk
    the tokenizer, the workload and every earlier trial's records, a pause of milliseconds
    that lands inside some request's TTFT. The young collections stay as they are: the
    client frees what it allocates by reference count, so they find little and stay short.
    Left alone when something else already manages the collector (disabled, or frozen)."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _Dependencies:
    """Completion events for requests that a later request must wait for (session turns)."""

    def __init__(self, requests: Sequence[BenchRequest]) -> None:
        needed = {r.after for r in requests if r.after is not None}
        self.events = {i: asyncio.Event() for i in needed}

    async def wait(self, request: BenchRequest) -> None:
        if request.after is not None:
            await self.events[request.after].wait()

    def done(self, request: BenchRequest) -> None:
        event = self.events.get(request.index)
        if event is not None:
            event.set()


async def run_closed_loop(
    client: BenchClient,
    requests: Sequence[BenchRequest],
    concurrency: int,
    on_record: OnRecord,
) -> float:
    """``concurrency`` clients, each sending its next request (in the fixed order) when its
    previous one completes. Returns the window's start (perf_counter)."""
    deps = _Dependencies(requests)
    position = 0

    async def user() -> None:
        nonlocal position
        while position < len(requests):
            request = requests[position]
            position += 1
            await deps.wait(request)
            on_record(await client.send(request, start))
            deps.done(request)

    with _frozen_heap():
        start = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(max(1, concurrency))))
    return start


async def run_open_loop(
    client: BenchClient,
    requests: Sequence[BenchRequest],
    offsets: Sequence[float],
    on_record: OnRecord,
) -> float:
    """Send request i at ``offsets[i]`` seconds after the start, whatever is in flight (a
    Poisson schedule, or a trace's timestamps). A request that falls behind schedule is sent
    at once. Returns the window's start (perf_counter)."""
    deps = _Dependencies(requests)
    tasks: set[asyncio.Task] = set()

    async def one(request: BenchRequest) -> None:
        await deps.wait(request)
        on_record(await client.send(request, start))
        deps.done(request)

    with _frozen_heap():
        start = time.perf_counter()
        try:
            for request, offset in zip(requests, offsets):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
    return start


async def run_sequential(client: BenchClient, requests: Sequence[BenchRequest], on_record: OnRecord) -> None:
    """One request at a time (the warmup: each prefix reaches a worker before the next)."""
    start = time.perf_counter()
    for request in requests:
        on_record(await client.send(request, start))
