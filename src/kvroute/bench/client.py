"""The async streaming client and the load generators.

One ``BenchClient`` sends pre-encoded ``BenchRequest`` bodies and turns each streamed response
into a ``RequestRecord``. Measurement rules it keeps (EXPERIMENT.md):

* **A new TCP connection per request** unless ``keep_alive``: a balancer that chooses per
  connection (kube-proxy) must get a fresh choice for every request, or a pooled client stays
  pinned to one worker and flatters the baseline. ``TCPConnector(force_close=True)`` closes the
  connection after each response, so the next request connects again (tests count the
  connections a server accepts).
* **Low overhead**: timestamps are ``time.perf_counter`` taken once per network read, and a
  chunk is decoded by msgspec into a tiny typed struct; nothing else happens per token. All
  events that arrive in one read get that read's timestamp (they did arrive together).

TTFT is measured from just before the request is handed to aiohttp (connection set-up
included, as a user experiences it) to the first chunk that carries generated text; inter-token
latencies are the gaps between content chunks; ``cached_tokens`` comes from the final usage
chunk (``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import aiohttp
import msgspec

from kvroute.bench.prompts import BenchRequest
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
    """What one streamed response told us (filled in while reading)."""

    __slots__ = ("first_content", "content_times", "usage", "error", "done")

    def __init__(self) -> None:
        self.first_content: float | None = None
        self.content_times: list[float] = []
        self.usage: _Usage | None = None
        self.error: str | None = None
        self.done = False

    def feed_event(self, payload: bytes, now: float) -> None:
        """One ``data:`` payload that arrived at ``now``."""
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            chunk = _decode_chunk(payload)
        except msgspec.DecodeError:
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


async def read_sse(content: aiohttp.StreamReader, result: StreamResult) -> None:
    """Read an SSE body incrementally into ``result``.

    vLLM writes one ``data: {...}`` line per event, events separated by a blank line; lines
    may end in ``\\r\\n``. A partial line stays buffered until its end arrives.
    """
    clock = time.perf_counter
    pending = b""
    while True:
        data = await content.readany()
        if not data:
            break
        now = clock()
        if pending:
            data = pending + data
        lines = data.split(b"\n")
        pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                result.feed_event(line[5:].strip(), now)
        if result.done:
            return
    if pending.startswith(b"data:"):
        result.feed_event(pending[5:].strip(), clock())


class BenchClient:
    """Sends requests to one OpenAI-compatible base URL.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:8000``.
        keep_alive: pool connections (off by default: see the module docstring).
        timeout_s: limit for one whole request.

    Use as an async context manager, or call ``close``.
    """

    def __init__(self, url: str, keep_alive: bool = False, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.keep_alive = keep_alive
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        # limit=0: the connector must never queue requests, or the client's own pool would
        # become the concurrency limit and distort TTFT.
        connector = aiohttp.TCPConnector(force_close=not keep_alive, limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=self.timeout,
            headers={"Content-Type": "application/json"},
            skip_auto_headers=("User-Agent",),
        )

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.session.close()

    async def send(self, request: BenchRequest, window_start: float) -> RequestRecord:
        """Send one request and wait for the end of its stream.

        Never raises for a failed request: the failure is recorded (``status`` 0 when no
        response arrived) so it stays in the denominators.
        """
        clock = time.perf_counter
        sent = clock()
        result = StreamResult()
        status = 0
        worker = None
        try:
            async with self.session.post(self.url + request.path, data=request.body) as resp:
                status = resp.status
                worker = resp.headers.get(WORKER_HEADER)
                if status != 200:
                    body = await resp.read()
                    result.error = f"HTTP {status}: {_error_message(body)}"
                else:
                    await read_sse(resp.content, result)
                    if not result.done and result.error is None:
                        result.error = "stream ended without [DONE]"
        except asyncio.TimeoutError:
            result.error = f"timed out after {self.timeout.total:g} s"
        except aiohttp.ClientError as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:_ERROR_BODY_LIMIT]
        except OSError as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:_ERROR_BODY_LIMIT]
        end = clock()
        return _record(request, sent - window_start, sent, end, status, worker, result)


def _error_message(body: bytes) -> str:
    try:
        obj = msgspec.json.decode(body)
        if isinstance(obj, dict):
            err = obj.get("error", obj)
            message = err.get("message", err) if isinstance(err, dict) else err
            return str(message)[:_ERROR_BODY_LIMIT]
    except msgspec.DecodeError:
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
    start = time.perf_counter()

    async def user() -> None:
        nonlocal position
        while position < len(requests):
            request = requests[position]
            position += 1
            await deps.wait(request)
            on_record(await client.send(request, start))
            deps.done(request)

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
    start = time.perf_counter()
    tasks: set[asyncio.Task] = set()

    async def one(request: BenchRequest) -> None:
        await deps.wait(request)
        on_record(await client.send(request, start))
        deps.done(request)

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
