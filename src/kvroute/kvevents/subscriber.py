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

Batches delivered both by replay and live are yielded once. vLLM's protocol has no publisher
identity, so a restarted engine whose first seen ``seq`` is still above the old one's looks like a
gap; nothing can tell those apart.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Union

import zmq
import zmq.asyncio

from kvroute.kvevents.wire import END_SEQ, DecodedBatch, KVEventDecodeError, decode_batch, encode_seq


@dataclass(frozen=True, slots=True)
class EventsReceived:
    """A decoded batch; ``replayed`` tells it came from the replay socket, not the live one."""

    seq: int
    batch: DecodedBatch
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


SubscriberItem = Union[EventsReceived, GapDetected, ReplayFailed, EngineRestarted, MalformedPayload]


def _coverage_problem(replayed_seqs: list[int], expected: int, got: int) -> str | None:
    """Why the replayed sequence numbers do not exactly fill ``expected .. got - 1``, or None."""
    if replayed_seqs == list(range(expected, got)):
        return None
    if not replayed_seqs:
        return "replay returned nothing older than the live batch"
    if replayed_seqs[0] != expected:
        # The ring buffer already dropped the oldest missing batches.
        return f"replay buffer starts at {replayed_seqs[0]}, not {expected}"
    return "replay skipped sequence numbers"


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


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

    Sequence numbers are expected from 0, so a subscriber that starts after the engine first
    replays what the engine still buffers (or reports ReplayFailed when that is not everything).
    Without ``catch_up`` that happens when the first live batch shows the gap, which an idle
    engine may not publish for a long time: a router restarted beside idle engines would route
    blind until then. With it, the replay is asked for at once. A buffer that no longer starts
    at 0 (the engine has run longer than its buffer) yields ReplayFailed first, then what the
    buffer holds: the blocks those batches stored are known, older ones are not.
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
    ) -> None:
        # The replay DEALERs are awaited; the live SUB socket is a plain one that the event loop
        # polls itself (see ``_receive_live``).
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
        self._last: int | None = None  # last seq yielded (batch or malformed)
        self._last_live: int | None = None  # highest seq seen on the live socket
        self._closed = False
        #: Set while ``_receive_live`` waits for the socket: (file descriptor watched, future
        #: that a readable descriptor or close() completes).
        self._waiting: tuple[int, asyncio.Future[None]] | None = None

    @property
    def endpoint(self) -> str:
        """The SUB socket's address (the bound one, wildcard port resolved, when binding)."""
        return self._endpoint

    @property
    def last_seq(self) -> int | None:
        """The sequence number of the last batch yielded, None before the first."""
        return self._last

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
            frames = await self._receive_live()
            if frames is None:
                raise StopAsyncIteration
            await self._on_live(frames)
        item = self._pending.popleft()
        if type(item) is tuple:
            seq, payload, replayed = item
            try:
                return EventsReceived(seq, decode_batch(payload), replayed)
            except KVEventDecodeError as exc:
                return MalformedPayload(seq, str(exc))
        return item

    async def close(self) -> None:
        """Stop iteration (a pending ``__anext__`` ends with StopAsyncIteration) and close the
        socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._waiting is not None:
            # Stop watching the descriptor before the socket (and so the descriptor) goes.
            fd, waiter = self._waiting
            asyncio.get_running_loop().remove_reader(fd)
            if not waiter.done():
                waiter.set_result(None)
        self._sub.close(linger=0)

    async def __aenter__(self) -> KVEventSubscriber:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- live stream ---------------------------------------------------------------------

    async def _receive_live(self) -> list[bytes] | None:
        """Next live multipart message, or None once close() was called.

        The SUB socket is a plain (blocking-API) one, read with ``NOBLOCK`` and waited on
        through its ``ZMQ_FD`` with ``loop.add_reader``, not a ``zmq.asyncio`` socket: under
        load several batches are queued at every visit, and taking each with a direct call
        spares the future, the callbacks and the ``zmq.Again`` raised through them that an
        asyncio socket spends per message (about a tenth of the router's CPU per request).
        """
        sub = self._sub
        while not self._closed:
            try:
                return sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            await self._readable()
        return None

    async def _readable(self) -> None:
        """Wait until the SUB socket may hold a message, or close() is called.

        ``ZMQ_FD`` signals that the socket's state changed, not that a message is there, and
        only changes after the socket was last asked (the failed ``recv`` just now); a message
        that arrived in between shows in ``ZMQ_EVENTS``, checked once the reader is armed.
        """
        loop = asyncio.get_running_loop()
        fd = self._sub.getsockopt(zmq.FD)
        waiter: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _wake, waiter)
        self._waiting = (fd, waiter)
        try:
            if not self._sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await waiter
        finally:
            self._waiting = None
            if not self._closed:
                loop.remove_reader(fd)

    async def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._pending.append(
                MalformedPayload(
                    None,
                    "expected [topic, 8-byte seq, payload], got frames of "
                    f"{[len(f) for f in frames]} bytes",
                )
            )
            return
        _, seq_frame, payload = frames
        seq = int.from_bytes(seq_frame, "big")
        if self._last_live is not None and seq <= self._last_live:
            self._pending.append(EngineRestarted(self._last, seq))
            self._last = self._last_live = None
        elif self._last is not None and seq <= self._last:
            # Already yielded from a replay that ran ahead of the live stream.
            self._last_live = seq
            return
        self._last_live = seq
        expected = 0 if self._last is None else self._last + 1
        if seq == expected:
            self._deliver(seq, payload, replayed=False)
            return
        self._pending.append(GapDetected(expected, seq))
        replayed, failure = await self._replay(expected)
        missing = [(s, p) for s, p in replayed if s < seq]
        if failure is None:
            failure = _coverage_problem([s for s, _ in missing], expected, seq)
        if failure is None:
            for s, p in missing:
                self._deliver(s, p, replayed=True)
        else:
            self._pending.append(ReplayFailed(expected, seq, failure))
        self._deliver(seq, payload, replayed=False)
        # Batches newer than the live one that the replay already brought: yield them now, in
        # order, and their live copies will be skipped as duplicates.
        for s, p in replayed:
            if s == self._last + 1:
                self._deliver(s, p, replayed=True)

    def _deliver(self, seq: int, payload: bytes, replayed: bool) -> None:
        self._pending.append((seq, payload, replayed))  # decoded by __anext__
        self._last = seq

    # --- replay ----------------------------------------------------------------------------

    async def _replay_buffer(self) -> None:
        """``catch_up``: queue what the engine buffers, from its oldest batch on. Live batches
        already queued on the SUB socket that the replay covered are skipped as duplicates
        later; a failed or empty replay leaves everything to the live stream."""
        replayed, _ = await self._replay(0)
        run = replayed[:1]
        for seq, payload in replayed[1:]:
            if seq != run[-1][0] + 1:
                break  # a hole: the live stream's first gap asks again from there
            run.append((seq, payload))
        if not run:
            return
        if run[0][0] != 0:
            self._pending.append(ReplayFailed(0, run[0][0], f"replay buffer starts at {run[0][0]}, not 0"))
        for seq, payload in run:
            self._deliver(seq, payload, replayed=True)

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
        except asyncio.TimeoutError:
            return received, (
                f"no reply from replay endpoint {self._replay_endpoint} "
                f"within {self._replay_timeout:g}s"
            )
        except zmq.ZMQError as exc:
            return received, f"replay endpoint {self._replay_endpoint}: {exc}"
        finally:
            dealer.close(linger=0)
