"""The router's workers: membership from discovery, health, load accounting and KV events.

:class:`WorkerPool` keeps one :class:`Worker` per discovered endpoint. It

* applies each complete endpoint list a discovery source yields (added workers join, removed
  ones are forgotten by the index, ``ready=False`` ones get no new requests);
* checks ``GET /health`` periodically; a worker that fails a check, or refuses a connection,
  leaves the available set and its index entries are dropped (the router would otherwise keep
  steering prefixes to a dead worker); a later passing check brings it back. A worker out of
  the set is checked :data:`UNHEALTHY_CHECKS_PER_INTERVAL` times as often (Envoy's
  ``unhealthy_interval``), so a restarted worker is back within a fraction of the interval;
* ejects outliers: ``eject_after_failures`` consecutive failed requests (first-byte or idle
  timeouts, 5xx answers: a worker alive but not serving) take a worker out for ``eject_base_s`` times its number of ejections in a
  row (at most :data:`MAX_EJECTION_S`); it returns at the first passing health check after
  that (Envoy's outlier detection, simplified). A success resets both counts;
* follows every worker's KV events with one native consumer (``kvroute._native.KvEventConsumer``,
  a thread of ``kvroute-io`` that owns the SUB and replay sockets and applies each batch to the
  shared index itself, so no batch wakes Python): each stream starts with a catch-up replay;
  a gap that replay could not fill, a malformed batch or an engine restart resets that
  worker's entries (the predicted entries of new routing decisions bridge until its events
  have rebuilt them). The pool only adds and removes workers there, logs what the consumer
  reports, and copies its counters into the metrics (:meth:`WorkerPool.sync_event_metrics`,
  on every ``/metrics`` scrape).

Load is the router's own accounting (``WorkerState.in_flight`` / ``in_flight_tokens``), kept
by the routing step (:class:`kvroute.routing.RoutingStep`, the simulator's too) in which every
worker of the pool has a slot: it is exact for this router and never reads zero while work is
in flight, unlike a scraped signal.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from kvroute._native import KvEventConsumer
from kvroute.kvevents import EventsSettings, EventsSource
from kvroute.proxy.discovery import Discovery, Endpoint
from kvroute.proxy.metrics import RouterMetrics
from kvroute.routing import RoutingStep
from kvroute.routing.policies import WorkerState, make_policy

logger = logging.getLogger(__name__)

#: Seconds ``close`` waits for each cancelled background task, and for the event consumer.
_CLOSE_TASK_S = 5.0

#: Seconds the event consumer lets batches gather after taking some: one wake-up of its
#: thread for several engine steps (``benchmarks/kv_events_consume.py``); the index learns of a
#: batch at most this much later, beside engine steps of tens of milliseconds.
EVENTS_COALESCE_S = 0.002

#: The consumer's counters and the metric each one feeds (a ``RouterMetrics`` attribute).
_EVENT_METRICS = (
    ("events", "events"),
    ("unknown_events", "events_unknown"),
    ("malformed", "events_malformed"),
    ("gaps", "event_gaps"),
    ("replay_failures", "replay_failures"),
    ("restarts", "engine_restarts"),
)

#: How many times as often as a healthy worker one out of the available set is checked.
UNHEALTHY_CHECKS_PER_INTERVAL = 4

#: Longest ejection, whatever the number of ejections in a row.
MAX_EJECTION_S = 300.0
#: Most bytes of a health check's answer read.
_HEALTH_BODY_BYTES = 64 * 1024


class Worker:
    """One worker as the router tracks it.

    Attributes:
        endpoint: as discovery last reported it.
        slot: its slot in the routing step (which keeps its load accounting).
        state: a snapshot of that load accounting (what the policies read).
        healthy: passed its last health check and accepted its last connection.
        events: its KV event sockets, or None (predicted mode only).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        events: EventsSource | None,
        metrics: RouterMetrics,
        policy: str,
        routing: RoutingStep,
    ) -> None:
        self.endpoint = endpoint
        self.routing = routing
        self.slot = routing.add_worker(endpoint.name)
        self.healthy = True
        #: Failed requests since the last success (outlier ejection).
        self.consecutive_failures = 0
        #: Ejections since the last success; each lengthens the next.
        self.ejections = 0
        #: Monotonic time before which health checks may not bring it back.
        self.ejected_until = 0.0
        self.events = events
        #: True while the pool's event consumer follows its stream.
        self.subscribed = False
        #: The consumer's counters as last copied into the metrics.
        self.events_seen: dict[str, int] = {}
        # Children of labelled metrics, looked up once: labels() costs a dict lookup and a
        # lock on every request otherwise.
        self.decisions = metrics.decisions.labels(policy, endpoint.name)

    @property
    def state(self) -> WorkerState:
        return self.routing.state(self.slot)

    @property
    def name(self) -> str:
        return self.endpoint.name

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def available(self) -> bool:
        return self.healthy and self.endpoint.ready


class WorkerPool:
    """Membership, health and KV events of the router's workers.

    Args:
        index: the router's ``KvIndex`` (``reset_worker`` / ``remove_worker``); the event
            consumer applies batches to it from its own thread.
        metrics: where to count events, gaps and health failures.
        session: HTTP session for health checks.
        events: where workers publish KV events.
        policy_name: the policy's name (a label of the decisions metric).
        health_interval_s: seconds between health checks (0 disables them).
        health_timeout_s: a check slower than this fails.
        eject_after_failures: consecutive failed requests that eject a worker (0: never).
        eject_base_s: length of a first ejection; the n-th in a row lasts n times as long.
        routing: the router's routing step (workers get their slots there); by default one
            of the pool's own, for the load accounting alone.
    """

    def __init__(
        self,
        index,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        events: EventsSettings,
        policy_name: str,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 1.0,
        *,
        eject_after_failures: int = 3,
        eject_base_s: float = 5.0,
        routing: RoutingStep | None = None,
    ) -> None:
        self.index = index
        self.routing = routing if routing is not None else RoutingStep(make_policy("round-robin"))
        self.metrics = metrics
        self.session = session
        self.events = events
        self.policy_name = policy_name
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.eject_after_failures = eject_after_failures
        self.eject_base_s = eject_base_s
        self.workers: dict[str, Worker] = {}
        self._available: list[Worker] = []
        self._available_slots: list[int] = []
        self._tasks: list[asyncio.Task] = []
        self.first_update = asyncio.Event()
        #: The KV event consumer, made with the first worker that publishes events.
        self.consumer: KvEventConsumer | None = None
        self._notice_loop: asyncio.AbstractEventLoop | None = None

    # --- membership ---------------------------------------------------------------------------

    def available(self) -> list[Worker]:
        """Workers that may take a new request, in a stable order (do not mutate)."""
        return self._available

    def available_slots(self) -> list[int]:
        """The routing-step slots of :meth:`available`, aligned (do not mutate)."""
        return self._available_slots

    def _recompute(self) -> None:
        self._available = [w for w in self.workers.values() if w.available]
        self._available_slots = [w.slot for w in self._available]
        self.metrics.workers_available.set(len(self._available))

    def update(self, endpoints: list[Endpoint]) -> None:
        """Make the pool match ``endpoints`` (a discovery source's complete list)."""
        wanted = {e.name: e for e in endpoints}
        for name in [n for n in self.workers if n not in wanted]:
            worker = self.workers.pop(name)
            self._stop_events(worker)
            self.index.remove_worker(name)
            self.routing.remove_worker(name)
            logger.info("worker %s left the pool", name)
        for name, endpoint in wanted.items():
            worker = self.workers.get(name)
            if worker is None:
                worker = Worker(
                    endpoint, self.events.source_for(endpoint), self.metrics, self.policy_name, self.routing
                )
                self.workers[name] = worker
                self._start_events(worker)
                logger.info("worker %s joined the pool (%s)", name, endpoint.url)
            elif worker.endpoint != endpoint:
                worker.endpoint = endpoint
        self._recompute()
        self.first_update.set()

    def mark_failed(self, worker: Worker, reason: str) -> None:
        """Take ``worker`` out until a health check passes; forget what it cached."""
        if not worker.healthy:
            return
        logger.warning("worker %s taken out: %s", worker.name, reason)
        worker.healthy = False
        self.index.remove_worker(worker.name)
        self._recompute()

    def record_failure(self, worker: Worker, reason: str) -> None:
        """A request to ``worker`` failed (a timeout or a 5xx); enough of them in a row eject it."""
        worker.consecutive_failures += 1
        limit = self.eject_after_failures
        if limit and worker.consecutive_failures >= limit and worker.healthy:
            worker.ejections += 1
            period = min(self.eject_base_s * worker.ejections, MAX_EJECTION_S)
            worker.ejected_until = time.monotonic() + period
            self.metrics.ejections.labels(worker.name).inc()
            self.mark_failed(
                worker, f"ejected for {period:g}s after {worker.consecutive_failures} failures in a row ({reason})"
            )

    def record_success(self, worker: Worker) -> None:
        """A request to ``worker`` was answered in full."""
        if worker.consecutive_failures:
            worker.consecutive_failures = 0
            worker.ejections = 0

    def _mark_healthy(self, worker: Worker) -> None:
        if worker.healthy or time.monotonic() < worker.ejected_until:
            return
        worker.consecutive_failures = 0
        logger.info("worker %s is healthy again", worker.name)
        worker.healthy = True
        self._recompute()

    # --- background tasks ---------------------------------------------------------------------

    def start(self, discovery: Discovery) -> None:
        """Follow ``discovery`` and, if enabled, check health, until :meth:`close`."""
        self._tasks.append(asyncio.ensure_future(self._follow(discovery)))
        if self.health_interval_s > 0:
            self._tasks.append(asyncio.ensure_future(self._health_loop()))

    async def _follow(self, discovery: Discovery) -> None:
        try:
            async for endpoints in discovery.watch():
                self.update(endpoints)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("worker discovery stopped; keeping the last worker list")
            self.first_update.set()

    async def _health_loop(self) -> None:
        tick = 0
        while True:
            await asyncio.sleep(self.health_interval_s / UNHEALTHY_CHECKS_PER_INTERVAL)
            tick += 1
            every = tick % UNHEALTHY_CHECKS_PER_INTERVAL == 0
            now = time.monotonic()
            # Healthy workers every interval; the others (not still ejected) every tick.
            workers = [w for w in self.workers.values()
                       if every or (not w.healthy and now >= w.ejected_until)]
            if not workers:
                continue
            results = await asyncio.gather(*(self._check(w) for w in workers))
            for worker, problem in zip(workers, results, strict=True):
                if self.workers.get(worker.name) is not worker:
                    continue  # left the pool meanwhile
                if problem is None:
                    self._mark_healthy(worker)
                else:
                    self.metrics.health_failures.labels(worker.name).inc()
                    self.mark_failed(worker, f"health check: {problem}")

    async def _check(self, worker: Worker) -> str | None:
        """None when ``GET /health`` answers 200 in time, else what went wrong.

        A redirect is a failure and is never followed: following it would let a worker (or
        whoever took over its address) make the router fetch any URL, and a redirect target's
        200 would keep a worker healthy that is not. Only the first 64 KiB of the answer are
        read (a health check needs its status, not its body)."""
        try:
            async with self.session.get(
                worker.url + "/health", allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=self.health_timeout_s),
            ) as response:
                await response.content.read(_HEALTH_BODY_BYTES)
                if 300 <= response.status < 400:
                    return f"status {response.status} (a redirect: not followed)"
                return None if response.status == 200 else f"status {response.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return str(exc) or type(exc).__name__

    # --- KV events ----------------------------------------------------------------------------

    def _start_events(self, worker: Worker) -> None:
        """Have the consumer follow ``worker``'s stream, starting with a catch-up replay (so a
        router (re)started beside running engines knows their caches before their next step);
        the consumer drops the worker's entries first, since that replay repeats every store
        the index may already have counted."""
        source = worker.events
        if source is None:
            return
        consumer = self._event_consumer()
        try:
            consumer.add_worker(
                worker.name, source.endpoint, source.replay_endpoint, topic=self.events.topic, catch_up=True
            )
        except ValueError as exc:  # an address the consumer cannot follow
            logger.error("worker %s: %s", worker.name, exc)
            return
        worker.subscribed = True
        worker.events_seen = {}

    def _stop_events(self, worker: Worker) -> None:
        if worker.subscribed and self.consumer is not None:
            self.sync_event_metrics()  # the last counts before they go
            self.consumer.remove_worker(worker.name)
            worker.subscribed = False

    def _event_consumer(self) -> KvEventConsumer:
        if self.consumer is None:
            self.consumer = KvEventConsumer(self.index, coalesce_s=EVENTS_COALESCE_S)
            try:
                self._notice_loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a test driving the pool by hand): read at sync
                self._notice_loop = None
            else:
                self._notice_loop.add_reader(self.consumer.notice_fd, self._on_notices)
        return self.consumer

    def _on_notices(self) -> None:
        """The consumer posted notices (rare: each is a worker reset): log them, and bring the
        metrics up to date."""
        for notice in self.consumer.take_notices():
            kind, name = notice[0], notice[1]
            if kind == "replay_failed":
                _, _, expected, got, reason = notice
                logger.warning("worker %s: KV events %d..%d lost (%s); its index entries are reset",
                               name, expected, got - 1, reason)
            elif kind == "restarted":
                logger.info("worker %s: engine restarted; its index entries are reset", name)
            elif kind == "malformed":
                logger.warning("worker %s: malformed KV event batch %s: %s; its index entries are reset",
                               name, notice[2], notice[3])
            elif kind == "crashed":
                logger.error("the KV event consumer stopped: %s; the index gets no more events", notice[2])
        self.sync_event_metrics()

    def sync_event_metrics(self) -> None:
        """Copy the consumer's counters into the ``kvroute_router_kv_*`` metrics (they count
        in Rust; this adds what they counted since the last copy)."""
        if self.consumer is None:
            return
        counts = self.consumer.counters()
        for worker in self.workers.values():
            now = counts.get(worker.name)
            if now is None or not worker.subscribed:
                continue
            seen = worker.events_seen
            for key, metric in _EVENT_METRICS:
                delta = now[key] - seen.get(key, 0)
                if delta > 0:
                    getattr(self.metrics, metric).labels(worker.name).inc(delta)
            worker.events_seen = now

    async def close(self) -> None:
        """Stop discovery, health checks and the event consumer (each waited for a bounded
        time)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                # Bounded: a task that ignores its cancel must not keep the router from closing.
                await asyncio.wait_for(task, _CLOSE_TASK_S)
            except TimeoutError:
                logger.warning("a background task did not stop within %gs of its cancel: %r", _CLOSE_TASK_S, task)
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
        consumer, self.consumer = self.consumer, None
        if consumer is not None:
            if self._notice_loop is not None:
                self._notice_loop.remove_reader(consumer.notice_fd)
                self._notice_loop = None
            # Bounded (sockets have linger 0: this takes milliseconds), the GIL released.
            if not consumer.close(_CLOSE_TASK_S):
                logger.warning("the KV event consumer did not stop within %gs", _CLOSE_TASK_S)
        for worker in self.workers.values():
            worker.subscribed = False
