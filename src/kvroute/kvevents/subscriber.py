"""Consume one engine's KV cache events with gap repair, for the router's index.

:class:`KVEventSubscriber` is an async iterator over what happened on one worker's event
stream. Besides the batches themselves it reports the three conditions an index must act on:

* a **gap** (``seq > last + 1``): the SUB socket dropped messages (slow consumer, reconnect,
  subscriber started late). The subscriber asks the engine's replay socket for the missing
  batches and yields them in order; if that is impossible it yields :class:`ReplayFailed`, and
  the index should drop what it knows about that worker, because it missed stores or removals.
* a **restart** (``seq`` going backwards, normally to 0): a new engine process, whose cache is
  empty; the index should drop the worker's state.
* a **malformed payload**: the batch is lost; treat it like a failed replay.

Batches delivered both by replay and live are yielded once: a live batch at a seq the replay
already gave is skipped if it is the same bytes, and is a restart if not (an engine that
restarted between a catch-up replay and its next batch). vLLM's protocol has no publisher
identity, so a restarted engine whose first seen ``seq`` is still above the old one's looks like a
gap; nothing can tell those apart.

Every one of those decisions is the native ``SequenceTracker`` 's (``kvroute-core``'s
``kvevents::sequence``, a sans-I/O state machine with its own tests); this module does the
ZeroMQ I/O around it and turns its answers into the items below.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

import zmq
import zmq.asyncio

from kvroute._native import SequenceTracker
from kvroute.kvevents.wire import (
    END_SEQ,
    DecodedBatch,
    KVEventDecodeError,
    NativeEventBatch,
    decode_batch,
    decode_native,
    encode_seq,
)


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


def _malformed_frames(lengths: list[int]) -> MalformedPayload:
    return MalformedPayload(None, f"expected [topic, 8-byte seq, payload], got frames of {lengths} bytes")


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
            in Rust, for the native index) instead of :class:`DecodedBatch`.

    Sequence numbers are expected from 0, so a subscriber that starts after the engine first
    replays what the engine still buffers (or reports ReplayFailed when that is not everything).
    Without ``catch_up`` that happens when the first live batch shows the gap, which an idle
    engine may not publish for a long time: a router restarted beside idle engines would route
    blind until then. With it, the replay is asked for at once. A buffer that no longer starts
    at 0 (the engine has run longer than its buffer) yields ReplayFailed first, then what the
    buffer holds: the blocks those batches stored are known, older ones are not.

    Two ways to consume, with the same items in the same order: ``async for item in
    subscriber``, or ``await subscriber.run(on_item)``, which hands items to a plain callback
    from the socket's reader callback itself (see :meth:`run`; what the router uses).
    """

    #: Receive queue size in messages; matches vLLM's default publisher HWM so a busy router
    #: loses nothing the engine did not already drop.
    RCVHWM = 100_000
    #: Items yielded (or replayed messages received) between two turns given to the event
    #: loop: ~0.5 ms of decoding and indexing at most.
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
        # The replay DEALERs are awaited; the live SUB socket is a plain one that the event loop
        # reads from a reader callback (see ``_drain``).
        self._ctx = zmq.asyncio.Context.instance()
        self._replay_endpoint = replay_endpoint
        self._replay_timeout = replay_timeout
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, self.RCVHWM)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        try:
            if bind:
                self._sub.bind(endpoint)
                self._endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._sub.connect(endpoint)
                self._endpoint = endpoint
        except zmq.ZMQError:
            self._sub.close(linger=0)
            raise
        #: Items to yield, in order; a batch waits here undecoded, as ``(seq, payload,
        #: replayed)``, and is decoded when taken (see ``__anext__``).
        self._pending: deque[SubscriberItem | tuple[int, bytes, bool]] = deque()
        self._taken_since_pause = 0
        self._catch_up = catch_up and replay_endpoint is not None
        #: Every sequence decision: in order, gap, replay coverage, restart, duplicate.
        self._tracker = SequenceTracker()
        self._decode = decode_native if native else decode_batch
        self._closed = False
        # Reading the live socket (see ``_drain``). ZMQ_FD is the socket's notification
        # descriptor: readable when its state may have changed, fixed for the socket's life.
        self._fd: int = self._sub.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._armed = False  # ``_drain`` is registered as the descriptor's reader
        self._resume_scheduled = False  # a paused ``_drain`` continues on the next loop turn
        #: A live message ``_drain`` left for the async path (a gap to replay, a restart...).
        self._unusual: list[bytes] | None = None
        #: The consumer waiting for items, an unusual message or close().
        self._waiter: asyncio.Future[None] | None = None
        #: ``run``'s callback while items go straight to it; what it raised, for ``run``.
        self._on_item: Callable[[SubscriberItem], None] | None = None
        self._failure: Exception | None = None

    @property
    def endpoint(self) -> str:
        """The SUB socket's address (the bound one, wildcard port resolved, when binding)."""
        return self._endpoint

    @property
    def last_seq(self) -> int | None:
        """The sequence number of the last batch yielded, None before the first."""
        return self._tracker.last_seq

    def __aiter__(self) -> KVEventSubscriber:
        return self

    async def __anext__(self) -> SubscriberItem:
        # A replay can bring thousands of batches at once (a router started beside an engine
        # that has run for a while), and queued live batches are taken without waiting: the
        # consumer would then decode and apply them all in one go, holding the event loop
        # (and every request the router is relaying) for 100 ms and more. Every
        # PAUSE_EVERY items it lets the loop run other work first.
        self._taken_since_pause += 1
        if self._taken_since_pause >= self.PAUSE_EVERY:
            self._taken_since_pause = 0
            await asyncio.sleep(0)
        if self._catch_up:
            self._catch_up = False
            await self._replay_buffer()
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            await self._next_live()
        return self._materialize(self._pending.popleft())

    async def run(self, on_item: Callable[[SubscriberItem], None]) -> None:
        """Hand every item to ``on_item``, in order, until :meth:`close`.

        The fast way to consume: a live batch that simply follows the last one is decoded and
        handed over inside the socket's reader callback, with no task switch per message
        (iterating costs a future, a task wake-up and two ``epoll_ctl`` calls per batch:
        on a loaded 2-core machine ``benchmarks/kv_events_consume.py`` measured 203 µs of CPU
        per batch iterated, 96 with ``run``, both feeding the Python index). Catch-up, gaps (replay), restarts and malformed framing take the same async
        path as iteration, in this task.
        ``on_item`` must not block; an exception it raises ends ``run`` with that exception.
        """
        if self._on_item is not None:
            raise RuntimeError("run() is already consuming this subscriber")
        try:
            while not self._closed:
                if self._catch_up:
                    self._catch_up = False
                    await self._replay_buffer()
                if self._unusual is not None:
                    frames, self._unusual = self._unusual, None
                    await self._on_live(frames)
                await self._hand_over_pausing(on_item)
                if self._closed:
                    break
                self._on_item = on_item
                self._arm()  # drains what is already queued, straight to on_item
                if self._unusual is None and self._failure is None and not self._closed:
                    await self._wait()
                self._on_item = None
                if self._failure is not None:
                    failure, self._failure = self._failure, None
                    raise failure
        finally:
            self._on_item = None
            self._disarm()

    async def _hand_over_pausing(self, on_item: Callable[[SubscriberItem], None]) -> None:
        """Give ``on_item`` what the async path queued (a replay: maybe thousands), with a turn
        of the event loop every PAUSE_EVERY items."""
        pending = self._pending
        while pending:
            for _ in range(min(len(pending), self.PAUSE_EVERY)):
                on_item(self._materialize(pending.popleft()))
            if pending:
                await asyncio.sleep(0)

    async def close(self) -> None:
        """Stop iteration (a pending ``__anext__`` ends with StopAsyncIteration) and close the
        socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # Stop watching the descriptor before the socket (and so the descriptor) goes.
        self._disarm()
        self._wake()
        self._sub.close(linger=0)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- live stream ---------------------------------------------------------------------

    async def _next_live(self) -> None:
        """Iteration: wait until ``_drain`` queued items, running the async path for a message
        it left (or for close()). The SUB socket is a plain (blocking-API) one read with
        ``NOBLOCK`` from a reader callback on its ``ZMQ_FD``, not a ``zmq.asyncio`` socket,
        which spends a future, callbacks and a raised ``zmq.Again`` per message."""
        if self._unusual is not None:
            frames, self._unusual = self._unusual, None
            await self._on_live(frames)
            return
        # Pull, not push: the socket is read only while a consumer waits (and up to PAUSE_EVERY
        # messages when it starts to), so an iterator nobody advances queues nothing.
        self._arm()
        try:
            if not self._pending and self._unusual is None and not self._closed:
                await self._wait()
        finally:
            self._disarm()

    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _arm(self) -> None:
        """Watch the socket (for ``run``, until an unusual message or close), and take what is
        already queued: ``ZMQ_FD`` only signals changes after the socket was last
        read, so messages that arrived before would otherwise wait for the next one."""
        if self._armed or self._closed:
            return
        loop = self._loop = asyncio.get_running_loop()
        loop.add_reader(self._fd, self._drain)
        self._armed = True
        self._drain()

    def _disarm(self) -> None:
        if self._armed:
            self._armed = False
            self._loop.remove_reader(self._fd)

    def _drain(self) -> None:
        """The socket's reader callback: take the live messages queued on it.

        A message that is simply the next batch is queued, or with :meth:`run` handed to its
        callback at once. Anything else (a gap to replay, a restart, a duplicate of a replayed
        batch, broken framing) stops the reading and is left for the async path. After
        PAUSE_EVERY messages the rest waits for the next loop turn (``ZMQ_FD`` will not signal
        again for messages already queued, so that turn is scheduled here)."""
        self._resume_scheduled = False
        if not self._armed:
            return
        recv = self._sub.recv_multipart
        for _ in range(self.PAUSE_EVERY):
            try:
                frames = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if not self._next_in_order(frames):
                self._unusual = frames
                self._disarm()
                break
        else:
            if not self._resume_scheduled:
                self._resume_scheduled = True
                self._loop.call_soon(self._drain)
        if self._on_item is not None and self._pending:
            self._hand_over()
        if self._pending or self._unusual is not None or self._failure is not None:
            self._wake()

    def _next_in_order(self, frames: list[bytes]) -> bool:
        """Queue a live message that is the batch after the last one; False for any other."""
        seq = self._tracker.in_order(frames)
        if seq is None:
            return False
        self._pending.append((seq, frames[2], False))
        return True

    def _materialize(self, item: SubscriberItem | tuple[int, bytes, bool]) -> SubscriberItem:
        """A queued item as yielded: batches wait undecoded as ``(seq, payload, replayed)``."""
        if type(item) is tuple:
            seq, payload, replayed = item
            try:
                return EventsReceived(seq, self._decode(payload), replayed)
            except KVEventDecodeError as exc:
                return MalformedPayload(seq, str(exc))
        return item

    def _hand_over(self) -> None:
        """``run``: give the queued items to its callback now; what it raises stops the reading
        and ends ``run``."""
        on_item = self._on_item
        pending = self._pending
        try:
            while pending:
                on_item(self._materialize(pending.popleft()))
        except Exception as exc:  # noqa: BLE001 (any error of the callback's ends run with it)
            self._failure = exc
            self._disarm()

    async def _on_live(self, frames: list[bytes]) -> None:
        await self._follow(self._tracker.live(frames))

    async def _follow(self, actions: list[tuple]) -> None:
        """Queue what the tracker's answer says, running the replay it asks for."""
        pending = self._pending
        for action in actions:
            kind = action[0]
            if kind == "batch":
                pending.append(action[1:])  # (seq, payload, replayed), decoded when taken
            elif kind == "gap":
                pending.append(GapDetected(action[1], action[2]))
            elif kind == "replay":
                replayed, failure = await self._replay(action[1])
                await self._follow(self._tracker.replay_done(replayed, failure))
            elif kind == "replay_failed":
                pending.append(ReplayFailed(action[1], action[2], action[3]))
            elif kind == "restarted":
                pending.append(EngineRestarted(action[1], action[2]))
            elif kind == "malformed":
                pending.append(_malformed_frames(action[1]))
            else:  # pragma: no cover (the tracker's vocabulary is closed)
                raise AssertionError(f"unknown tracker action {action!r}")

    # --- replay ----------------------------------------------------------------------------

    async def _replay_buffer(self) -> None:
        """``catch_up``: queue what the engine buffers, from its oldest batch on. Live batches
        already queued on the SUB socket that the replay covered are skipped as duplicates
        later; a failed or empty replay leaves everything to the live stream."""
        replayed, _ = await self._replay(0)
        await self._follow(self._tracker.catch_up_done(replayed))

    async def _replay(self, start_seq: int) -> tuple[list[tuple[int, bytes]], str | None]:
        """Ask the replay socket for every buffered batch from ``start_seq`` on.

        Returns the (seq, payload) pairs received and None, or what was received before the
        failure and a reason. A fresh DEALER per request: a late answer to a timed-out request
        can then never be mistaken for the answer to the next one.
        """
        if self._replay_endpoint is None:
            return [], "no replay endpoint configured"
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        received: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self._replay_endpoint)
            await asyncio.wait_for(
                dealer.send_multipart([b"", encode_seq(start_seq)]), self._replay_timeout
            )
            while True:
                if len(received) % self.PAUSE_EVERY == self.PAUSE_EVERY - 1:
                    await asyncio.sleep(0)  # a queued reply is taken without suspending
                frames = await asyncio.wait_for(dealer.recv_multipart(), self._replay_timeout)
                # Current vLLM: [b"", topic, seq, payload]; before the topic frame was added:
                # [b"", seq, payload]. The end marker has seq -1 and an empty payload in both.
                if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                    return received, f"unexpected replay reply of {len(frames)} frames"
                seq_frame, payload = frames[-2], frames[-1]
                if seq_frame == END_SEQ:
                    return received, None
                received.append((int.from_bytes(seq_frame, "big"), payload))
        except TimeoutError:
            return received, (
                f"no reply from replay endpoint {self._replay_endpoint} "
                f"within {self._replay_timeout:g}s"
            )
        except zmq.ZMQError as exc:
            return received, f"replay endpoint {self._replay_endpoint}: {exc}"
        finally:
            dealer.close(linger=0)
