"""A KV cache event publisher that behaves on the wire like vLLM's ``ZmqEventPublisher``.

The emulated engine calls :meth:`KVEventPublisher.publish` once per step; a background thread
encodes each batch, numbers it and sends ``[topic, seq, payload]`` on a PUB socket, keeping the
last ``buffer_steps`` payloads so a subscriber that noticed a gap can ask the ROUTER replay socket
for them. This is vLLM's design (queue + thread + ring buffer): the engine step never waits for
serialization or the network, and ZeroMQ sockets, which are not thread-safe, are only ever used
by that one thread until :meth:`close`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque

import zmq

from kvroute.engine.events import EventBatch
from kvroute.errors import UserError
from kvroute.kvevents.config import KVEventsConfig, offset_endpoint, publisher_binds
from kvroute.kvevents.wire import END_SEQ, WIRE_FORMATS, encode_batch, encode_seq

logger = logging.getLogger(__name__)


class KVEventPublisher:
    """Publishes engine event batches like a vLLM engine started with ``config``.

    As vLLM's ``EventPublisherFactory`` does, a config that does not enable events (or selects
    the ``"null"`` publisher) yields a publisher that opens no socket and drops every batch.

    Args:
        config: the engine's ``--kv-events-config``.
        wire_format: ``"map"`` (current vLLM) or ``"array"`` (older positional events).
        data_parallel_rank: stamped on batches that carry none. Like vLLM, a rank r > 0 also
            moves both endpoints by r (``tcp://*:5557`` -> port 5557 + r); to give N
            independent emulated engines consecutive ports use
            ``config.with_port_offset(i)`` and leave the rank None or 0.

    Sockets: the PUB socket binds when the endpoint is a wildcard or ipc/inproc, and connects
    to an explicit host (then the subscriber binds); the replay ROUTER socket always binds. Use
    ``tcp://127.0.0.1:*`` for an ephemeral port and read :attr:`endpoint` for the one chosen.
    """

    #: Seconds :meth:`close` waits for queued batches to go out (vLLM's SHUTDOWN_TIMEOUT).
    SHUTDOWN_TIMEOUT = 1.0
    #: How long the thread waits for a batch before looking at the replay socket again; this
    #: bounds the latency of a replay request on an idle engine.
    _IDLE_POLL_S = 0.05

    def __init__(
        self,
        config: KVEventsConfig,
        wire_format: str = "map",
        data_parallel_rank: int | None = None,
    ) -> None:
        if wire_format not in WIRE_FORMATS:
            raise UserError(
                f"KV events wire format must be one of {', '.join(WIRE_FORMATS)}, got {wire_format!r}"
            )
        config.validate()
        self._config = config
        self._wire_format = wire_format
        self._rank = data_parallel_rank
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)

        self._closed = False
        self._close_lock = threading.Lock()
        self._stop_now = False
        # publish() and the thread count batches so flush() can wait for "all sent".
        self._progress = threading.Condition()
        self._accepted = 0
        self._handled = 0

        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._endpoint: str | None = None
        self._replay_endpoint: str | None = None
        self._binds = False
        if config.publishes:
            self._open_sockets(data_parallel_rank or 0)
            self._thread = threading.Thread(
                target=self._run, daemon=True, name=f"kv-events-publisher:{self._endpoint}"
            )
            self._thread.start()

    # --- public API --------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """False for a disabled / ``"null"`` config: nothing is ever sent."""
        return self._thread is not None

    @property
    def endpoint(self) -> str | None:
        """The PUB address in use: the bound address (wildcard ports resolved) or the one
        connected to; None when disabled."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The bound replay ROUTER address, or None when replay is off or publishing disabled."""
        return self._replay_endpoint

    @property
    def binds(self) -> bool:
        """Whether the PUB socket bound (True) or connected (False)."""
        return self._binds

    def publish(self, batch: EventBatch) -> None:
        """Queue one step's events for sending; returns at once.

        Thread-safe. Like vLLM it blocks only when ``max_queue_size`` batches are already
        waiting (the sender thread cannot keep up), and raises RuntimeError after close().
        """
        if self._closed:
            raise RuntimeError("KV event publisher is closed")
        if self._thread is None:
            return
        if batch.data_parallel_rank is None and self._rank is not None:
            # vLLM stamps the batch in place; a copy keeps the caller's object untouched.
            batch = dataclasses.replace(batch, data_parallel_rank=self._rank)
        with self._progress:
            self._accepted += 1
        self._queue.put(batch)

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait until every batch published so far has been sent (and is replayable).

        Returns False if that did not happen within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._progress:
            while self._handled < self._accepted:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._progress.wait(remaining)
        return True

    def close(self) -> None:
        """Send what is queued (up to SHUTDOWN_TIMEOUT), then release the sockets and ports.

        Idempotent. Sockets close with linger 0 and the private ZeroMQ context is terminated,
        so a bound port is free again when this returns.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            try:
                self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT)
            except queue.Full:
                pass
            self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)
            if self._thread.is_alive():
                logger.warning(
                    "KV event publisher %s: %d batches still queued after %.1fs, dropping them",
                    self._endpoint, self._queue.qsize(), self.SHUTDOWN_TIMEOUT,
                )
                self._stop_now = True
                self._thread.join()
        self._close_sockets()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- sockets -----------------------------------------------------------------------------

    def _open_sockets(self, rank_offset: int) -> None:
        endpoint = offset_endpoint(self._config.endpoint, rank_offset)
        replay_endpoint = (
            None
            if self._config.replay_endpoint is None
            else offset_endpoint(self._config.replay_endpoint, rank_offset)
        )
        # A private context: terminating it on close() guarantees the listening sockets are
        # gone, so the next publisher (an engine "restart") can bind the same port at once.
        self._ctx = zmq.Context()
        action, address = "open", endpoint
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(self._config.hwm)
            self._binds = publisher_binds(endpoint)
            if self._binds:
                action = "bind"
                self._pub.bind(endpoint)
                self._endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                action = "connect"
                self._pub.connect(endpoint)
                self._endpoint = endpoint
            if replay_endpoint is not None:
                action, address = "bind", replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # vLLM leaves ROUTER's default send HWM (1000 messages), which silently cuts a
                # longer replay short; room for the whole buffer plus the end marker avoids that
                # without changing a byte on the wire.
                self._replay.setsockopt(zmq.SNDHWM, self._config.buffer_steps + 1)
                self._replay.bind(replay_endpoint)
                self._replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise UserError(f"cannot {action} KV events endpoint {address}: {exc}") from exc

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # --- sender thread -----------------------------------------------------------------------

    def _run(self) -> None:
        assert self._pub is not None
        seq = 0
        while not self._stop_now:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    logger.exception("KV event replay on %s failed", self._replay_endpoint)
            try:
                batch = self._queue.get(timeout=self._IDLE_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                break
            # As in vLLM the number is taken before encoding: a batch that cannot be sent
            # leaves a gap that subscribers see (and cannot replay), rather than vanishing.
            current, seq = seq, seq + 1
            try:
                payload = encode_batch(batch, self._wire_format)
                self._pub.send_multipart((self._topic, encode_seq(current), payload))
                self._buffer.append((current, payload))
            except Exception:
                logger.exception(
                    "KV event publisher %s: cannot send batch %d", self._endpoint, current
                )
            with self._progress:
                self._handled += 1
                self._progress.notify_all()

    def _serve_replay(self) -> None:
        """Answer one replay request exactly as current vLLM's ``_service_replay`` does.

        Request (from a DEALER): ``[b"", start_seq (8 bytes, big-endian)]``; the ROUTER sees it
        prefixed with the peer identity. Reply, as the DEALER receives it: ``[b"", topic, seq,
        payload]`` for every buffered batch with ``seq >= start_seq``, oldest first, then
        ``[b"", b"", END_SEQ, b""]``. (vLLM before the topic frame was added sent ``[b"", seq,
        payload]`` and ``[b"", END_SEQ, b""]``; :class:`KVEventSubscriber` reads both.)
        """
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV event replay: ignoring a request of %d frames", len(frames))
            return
        client_id, _, start_frame = frames
        start_seq = int.from_bytes(start_frame, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client_id, b"", self._topic, encode_seq(seq), payload)
                )
        self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))
