"""Consume one engine's KV cache events with gap repair: the items an index must act on.

:class:`KVEventSubscriber` is an async iterator over what happened on one worker's event
stream. Besides the batches themselves it reports the three conditions an index must act on:

* a **gap** (``seq > last + 1``): the SUB socket dropped messages (slow consumer, reconnect,
  subscriber started late). The missing batches are asked from the engine's replay socket and
  yielded in order; if that is impossible :class:`ReplayFailed` is yielded, and the index
  should drop what it knows about that worker, because it missed stores or removals.
* a **restart** (``seq`` going backwards, normally to 0): a new engine process, whose cache is
  empty; the index should drop the worker's state.
* a **malformed payload**: the batch is lost; treat it like a failed replay.

Batches delivered both by replay and live are yielded once: a live batch at a seq the replay
already gave is skipped if it is the same bytes, and is a restart if not (an engine that
restarted between a catch-up replay and its next batch). vLLM's protocol has no publisher
identity, so a restarted engine whose first seen ``seq`` is still above the old one's looks like a
gap; nothing can tell those apart.

The work is native: a ``kvroute._native.KvEventConsumer`` (``kvroute-io``'s consumer thread,
the one ``kvroute serve`` feeds its index with) owns the sockets, runs the sequence tracker
(``kvroute-core``'s ``kvevents::sequence``) and decodes; made without an index it posts every
item to an outbox, which this class turns into the items below. The router itself does not
use this class: its consumer applies batches to the index on its own thread
(``crates/kvroute-serve``); this is the item-level view, for tests and tools.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

from kvroute._native import KV_EVENTS_MAX_MESSAGE, KvEventConsumer
from kvroute.kvevents.wire import DecodedBatch, NativeEventBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EventsReceived:
    """A decoded batch; ``replayed`` tells it came from the replay socket, not the live one.
    ``batch`` is a :class:`~kvroute.kvevents.wire.NativeEventBatch` for a subscriber made with
    ``native=True``."""

    seq: int
    batch: DecodedBatch | NativeEventBatch
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class GapDetected:
    """Live ``got`` arrived while ``expected`` was next; a replay attempt follows."""

    expected: int
    got: int


@dataclass(frozen=True, slots=True)
class ReplayFailed:
    """Batches from ``expected`` up to (not including) ``got`` are lost for good; the consumer
    should drop this worker's state. Batches from ``got`` on follow as usual."""

    expected: int
    got: int
    reason: str


@dataclass(frozen=True, slots=True)
class EngineRestarted:
    """The sequence went back from ``last_seq`` to ``new_seq``: a new engine process, empty
    cache. Its batches follow (after a GapDetected if ``new_seq`` is not 0)."""

    last_seq: int | None
    new_seq: int


@dataclass(frozen=True, slots=True)
class MalformedPayload:
    """A message that could not be decoded; ``seq`` is None when even its framing was wrong."""

    seq: int | None
    error: str


SubscriberItem = EventsReceived | GapDetected | ReplayFailed | EngineRestarted | MalformedPayload


def item_of(notice: tuple, native: bool = True) -> SubscriberItem | None:
    """The item a consumer notice (``KvEventConsumer.take_notices``) stands for; None for a
    crash notice. Batches stay native unless ``native`` is False."""
    kind = notice[0]
    if kind == "batch":
        _, _, seq, batch, replayed = notice
        return EventsReceived(seq, batch if native else batch.to_python(), replayed)
    if kind == "gap":
        return GapDetected(notice[2], notice[3])
    if kind == "replay_failed":
        return ReplayFailed(notice[2], notice[3], notice[4])
    if kind == "restarted":
        return EngineRestarted(notice[2], notice[3])
    if kind == "malformed":
        return MalformedPayload(notice[2], notice[3])
    return None


class KVEventSubscriber:
    """Async iterator over one engine's KV event stream.

    Args:
        endpoint: the engine's event address. Connects by default (``tcp://host:5557``); with
            ``bind=True`` it binds instead, for engines whose endpoint names an explicit host
            (vLLM then connects to the subscriber). ``tcp://127.0.0.1:*`` with bind picks a free
            port, see :attr:`endpoint`.
        replay_endpoint: the engine's replay ROUTER address, or None (gaps then fail).
        topic: subscription prefix (vLLM's ``topic``, empty for all).
        bind: bind the SUB socket instead of connecting it.
        replay_timeout: seconds to wait for each message of a replay before giving up.
        catch_up: before waiting for live batches, replay everything the engine still buffers
            (see below).
        native: yield batches as :class:`~kvroute.kvevents.wire.NativeEventBatch` (events kept
            in Rust) instead of :class:`DecodedBatch`.

    Raises:
        ValueError: an address that cannot be followed (not ``tcp://HOST:PORT`` or
            ``ipc://PATH``, or a bind that fails).

    Sequence numbers are expected from 0, so a subscriber that starts after the engine first
    replays what the engine still buffers (or reports ReplayFailed when that is not everything).
    Without ``catch_up`` that happens when the first live batch shows the gap, which an idle
    engine may not publish for a long time. With it, the replay is asked for at once. A buffer
    that no longer starts at 0 (the engine has run longer than its buffer) yields ReplayFailed
    first, then what the buffer holds.

    Two ways to consume, with the same items in the same order: ``async for item in
    subscriber``, or ``await subscriber.run(on_item)``, which hands items to a plain callback.
    The consumer thread reads the socket whether or not anyone iterates; items wait in its
    outbox (bounded: past 100,000 it stops reading, and the publisher drops, as it does for a
    slow consumer).
    """

    #: The longest message a connection may carry, in bytes (longer: counted as malformed and
    #: the connection reset).
    MAX_MESSAGE = KV_EVENTS_MAX_MESSAGE
    #: Items handed over between two turns given to the event loop (a replay can bring
    #: thousands at once).
    PAUSE_EVERY = 64

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "",
        bind: bool = False,
        replay_timeout: float = 1.0,
        catch_up: bool = False,
        native: bool = False,
    ) -> None:
        self._consumer = KvEventConsumer()
        try:
            self._endpoint = self._consumer.add_worker(
                "engine", endpoint, replay_endpoint, topic=topic, bind=bind,
                replay_timeout=replay_timeout, catch_up=catch_up,
            )
        except ValueError:
            self._consumer.close()
            raise
        self._native = native
        self._items: deque[SubscriberItem] = deque()
        self._last_seq: int | None = None
        self._taken_since_pause = 0
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The consumer waiting for items or close().
        self._waiter: asyncio.Future[None] | None = None
        self._running = False

    @property
    def endpoint(self) -> str:
        """The SUB socket's address (the bound one, wildcard port resolved, when binding)."""
        return self._endpoint

    @property
    def last_seq(self) -> int | None:
        """The sequence number of the last batch yielded, None before the first."""
        return self._last_seq

    def __aiter__(self) -> KVEventSubscriber:
        return self

    async def __anext__(self) -> SubscriberItem:
        self._taken_since_pause += 1
        if self._taken_since_pause >= self.PAUSE_EVERY:
            self._taken_since_pause = 0
            await asyncio.sleep(0)
        while not self._items:
            if self._closed:
                raise StopAsyncIteration
            await self._wait()
        return self._take()

    async def run(self, on_item: Callable[[SubscriberItem], None]) -> None:
        """Hand every item to ``on_item``, in order, until :meth:`close`, with a turn of the
        event loop every PAUSE_EVERY items. ``on_item`` must not block; an exception it raises
        ends ``run`` with that exception."""
        if self._running:
            raise RuntimeError("run() is already consuming this subscriber")
        self._running = True
        try:
            while not self._closed:
                for _ in range(min(len(self._items), self.PAUSE_EVERY)):
                    on_item(self._take())
                if self._items:
                    await asyncio.sleep(0)
                elif not self._closed:
                    await self._wait()
        finally:
            self._running = False

    async def close(self) -> None:
        """Stop iteration (a pending ``__anext__`` ends with StopAsyncIteration) and close the
        sockets; the consumer thread is waited for at most a few seconds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._unwatch()
        self._wake()
        self._consumer.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _take(self) -> SubscriberItem:
        item = self._items.popleft()
        if isinstance(item, (EventsReceived, MalformedPayload)) and item.seq is not None:
            self._last_seq = item.seq
        return item

    async def _wait(self) -> None:
        """Until the consumer posted items (or close())."""
        self._watch()
        self._collect()
        if self._items or self._closed:
            return
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _watch(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._consumer.notice_fd, self._on_notice)

    def _unwatch(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._consumer.notice_fd)
            self._loop = None

    def _collect(self) -> None:
        native = self._native
        for notice in self._consumer.take_notices():
            item = item_of(notice, native)
            if item is not None:
                self._items.append(item)
            else:  # the consumer thread stopped on a bug: iteration ends
                logger.error("KV event consumer of %s stopped: %s", self._endpoint, notice[-1])
                self._closed = True
                self._wake()

    def _on_notice(self) -> None:
        self._collect()
        if self._items:
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
