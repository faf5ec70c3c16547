"""Retention live: the router refreshes the prefixes each worker's LRU would evict.

The same native state machine as the simulator's (``kvroute._native.Retention``, see
``kvroute_core::retention``), fed from the router's own routing decisions: after the routing
step chose a worker, the retention is polled for that worker (before the request is forwarded,
so its refreshes reach the engine with the request and ride in the step it makes), then told
what was routed (the prompt's block hashes and token ids, the overlap the index credited, the
output budget). Each refresh is a ``POST /v1/completions`` of the prefix's token ids plus one,
``max_tokens`` 1, to that worker: at most ``max_open_per_worker`` open per worker (a refresh
beyond that is dropped and counted, never queued), errors counted and not retried. Refreshes
are not client requests: they appear in ``kvroute_retention_*`` metrics only.

Order matters: the request a refresh is sent ahead of must reach the engine after it. Arriving
first, the request takes its blocks from the head of the LRU free queue, which is where the
prefix about to be refreshed sits, and the refresh then recomputes the whole prefix in the step
the request shares (in the simulator, refreshes arriving 2 ms after their request gave TTFT p99
207-372 ms instead of 114-126 at K = 24, W = 6, c = 8). So the request waits until its
refreshes' bodies are written to their connections (:meth:`LiveRetention.ahead`, at most
``WRITE_WAIT_S``); a client request never waits for a refresh's answer.

Only prompts given as token ids carry what a refresh needs (the ids of the prefix); a text
prompt is routed as usual and not told to the retention.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

import aiohttp
import msgspec
from prometheus_client import Counter, Gauge

from kvroute import _native
from kvroute.routing import RoutingStep

logger = logging.getLogger(__name__)

#: ``--retention`` modes.
MODES = ("off", "on", "auto")
#: Refreshes open at once per worker; more are dropped (counted), never queued.
DEFAULT_MAX_OPEN_PER_WORKER = 4
#: A refresh's whole answer (one token) must come within this, or it counts as an error.
REFRESH_TIMEOUT_S = 30.0
#: Output budget assumed for a body without ``max_tokens`` (vLLM's default is the context).
DEFAULT_OUTPUT_TOKENS = 16
#: The longest a client request waits for its refreshes to be written ahead of it.
WRITE_WAIT_S = 0.02


class _Fields(msgspec.Struct):
    """What retention reads of a completion body besides what routing parsed."""

    model: Any = None
    prompt: Any = None
    max_tokens: Any = None


_decode_fields = msgspec.json.Decoder(_Fields).decode


class _Request(NamedTuple):
    """A routed completion as retention reads it."""

    ids: list[int]
    output_tokens: int
    model: str | None


class RetentionMetrics:
    """``kvroute_retention_*``: refreshes sent, failed, dropped, and their prompt tokens."""

    def __init__(self, registry) -> None:
        self.refreshes = Counter(
            "kvroute_retention_refreshes", "Refresh requests sent (prefix + 1 token, max_tokens 1)",
            ["worker"], registry=registry,
        )
        self.errors = Counter(
            "kvroute_retention_refresh_errors", "Refreshes that failed (not retried)",
            ["worker"], registry=registry,
        )
        self.dropped = Counter(
            "kvroute_retention_refreshes_dropped",
            "Refreshes not sent: the worker already had the most refreshes open", ["worker"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvroute_retention_refresh_prompt_tokens", "Prompt tokens of the refreshes sent",
            registry=registry,
        )
        self.late = Counter(
            "kvroute_retention_refreshes_late",
            "Client requests forwarded before their refreshes were written (waited the limit)",
            registry=registry,
        )
        self.open = Gauge(
            "kvroute_retention_refreshes_open", "Refreshes sent and not answered yet",
            registry=registry,
        )


async def _body_written(_session, context, _params) -> None:
    """``on_request_chunk_sent``: a refresh's body (one chunk) is on its connection."""
    written = context.trace_request_ctx
    if isinstance(written, asyncio.Event):
        written.set()


class LiveRetention:
    """One router's retention: the native state machine and the refreshes in flight.

    Args:
        mode: ``on`` or ``auto`` (``off``: build none).
        block_size: the engines' KV block size.
        capacity_blocks: each worker's usable KV blocks (``num_gpu_blocks`` − 1).
        routing: the router's routing step (the retention reads its load and index).
        metrics: where the ``kvroute_retention_*`` metrics go (a registry).
        max_open_per_worker: refreshes open at once per worker.
    """

    def __init__(
        self, mode: str, block_size: int, capacity_blocks: int, routing: RoutingStep, registry,
        max_open_per_worker: int = DEFAULT_MAX_OPEN_PER_WORKER,
    ) -> None:
        if mode not in ("on", "auto"):
            raise ValueError(f"retention mode {mode!r}: use on or auto (off builds none)")
        self.native = _native.Retention(mode, block_size, capacity_blocks)
        self.block_size = block_size
        self.routing = routing
        self.metrics = RetentionMetrics(registry)
        self.max_open = max_open_per_worker
        self._open: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()
        #: Per worker, the refreshes whose bodies are not written yet (set once they are).
        self._unwritten: dict[str, list[asyncio.Event]] = {}
        #: Give it to the session that sends the refreshes: it tells when a body is written.
        self.trace_config = aiohttp.TraceConfig()
        self.trace_config.on_request_chunk_sent.append(_body_written)
        self.session: aiohttp.ClientSession | None = None
        self.headers: dict[str, str] = {}

    @property
    def mode(self) -> str:
        return self.native.mode

    def read(self, raw: bytes) -> _Request | None:
        """What a refresh and the model need of a completion body: its token ids (None for a
        text prompt: nothing to refresh with), output budget and model."""
        try:
            fields = _decode_fields(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        ids = fields.prompt
        if not isinstance(ids, list) or not ids or not isinstance(ids[0], int):
            return None  # text (or a batch): no token ids for a refresh body
        out = fields.max_tokens
        out = out if isinstance(out, int) and out > 0 else DEFAULT_OUTPUT_TOKENS
        model = fields.model if isinstance(fields.model, str) else None
        return _Request(ids, out, model)

    def room_for(self, slots: list[int], block_hashes: list[int], now: float) -> int | None:
        """The slot among ``slots`` a prompt cached nowhere goes to (the one home to the
        fewest prefix families, as ``RetainingPlacement``), or None where the policy decides;
        route it with ``RoutingStep.route_to``."""
        return self.native.room_for(self.routing, slots, block_hashes, now)

    def routed(self, worker, request: _Request, block_hashes: list[int], overlap: int, now: float) -> None:
        """The routing step sent ``request`` to ``worker`` (a pool ``Worker``), crediting
        ``overlap`` blocks: send that worker's refreshes, then tell the retention."""
        if not block_hashes:
            return
        ids, out = request.ids, request.output_tokens
        incoming = max(-(-(len(ids) + out) // self.block_size) - overlap, 0)
        try:
            refreshes = self.native.poll(self.routing, worker.slot, now, incoming)
            self.native.routed(worker.slot, block_hashes, ids, overlap, out, now)
        except (ValueError, OverflowError, TypeError) as exc:  # ids out of range: the worker judges
            logger.debug("retention skipped a prompt: %r", exc)
            return
        for prompt, _hashes, _blocks in refreshes:
            self._fire(worker, request.model, prompt)

    def _fire(self, worker, model: str | None, prompt: list[int]) -> None:
        name = worker.name
        if self.session is None or self._open.get(name, 0) >= self.max_open:
            self.metrics.dropped.labels(name).inc()
            return
        self._open[name] = self._open.get(name, 0) + 1
        self.metrics.open.inc()
        self.metrics.refreshes.labels(name).inc()
        self.metrics.prompt_tokens.inc(len(prompt))
        body = {"prompt": prompt, "max_tokens": 1}
        if model is not None:
            body["model"] = model
        written = asyncio.Event()
        self._unwritten.setdefault(name, []).append(written)
        task = asyncio.get_running_loop().create_task(self._send(worker, body, written))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def ahead(self, worker) -> None:
        """Return once the refreshes just fired for ``worker`` are written to their
        connections (or failed), or after ``WRITE_WAIT_S``: forward its request after this."""
        pending = self._unwritten.pop(worker.name, None)
        if not pending:
            return
        try:
            async with asyncio.timeout(WRITE_WAIT_S):
                for written in pending:
                    await written.wait()
        except TimeoutError:
            self.metrics.late.inc()

    async def _send(self, worker, body: dict, written: asyncio.Event) -> None:
        name = worker.name
        try:
            async with asyncio.timeout(REFRESH_TIMEOUT_S):
                async with self.session.post(
                    worker.url + "/v1/completions", data=msgspec.json.encode(body),
                    headers={"Content-Type": "application/json", **self.headers}, allow_redirects=False,
                    trace_request_ctx=written,
                ) as response:
                    await response.read()
                    if response.status != 200:
                        self.metrics.errors.labels(name).inc()
        except (aiohttp.ClientError, TimeoutError, OSError):
            self.metrics.errors.labels(name).inc()
        finally:
            written.set()
            self._open[name] -= 1
            self.metrics.open.dec()

    def stats(self) -> dict:
        """The state machine's counters (``kvroute._native.Retention.stats``)."""
        return self.native.stats()

    async def close(self) -> None:
        """Cancel the refreshes still open."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
