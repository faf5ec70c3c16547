"""KV cache events on the wire: vLLM's exact bytes, replay protocol, socket rules, subscriber.

Everything runs on 127.0.0.1 with ephemeral ports (``tcp://127.0.0.1:*``) or sockets the tests
bind themselves, so the file can run next to other tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from support.paths import DATA

from kvroute.engine.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from kvroute.errors import UserError
from kvroute.kvevents import (
    END_SEQ,
    DecodedBatch,
    EngineRestarted,
    EventsReceived,
    GapDetected,
    KVEventDecodeError,
    KVEventPublisher,
    KVEventsConfig,
    KVEventSubscriber,
    MalformedPayload,
    ReplayFailed,
    decode_batch,
    encode_batch,
    publisher_binds,
)
from kvroute.kvevents.wire import decode_native

LOOPBACK_ANY_PORT = "tcp://127.0.0.1:*"
TOP_HASH = 2**64 - 1  # uint64 extremes must survive msgpack


def full_stored() -> BlockStored:
    """A BlockStored with every field away from its default."""
    return BlockStored(
        block_hashes=[TOP_HASH, 12345678901234567890],
        parent_block_hash=42,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=3,
        medium="CPU",
        lora_name="adapter-a",
        extra_keys=[("mm-hash", 7), None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
    )


def plain_stored() -> BlockStored:
    """A first-block BlockStored with vLLM-optional fields left None."""
    return BlockStored(
        block_hashes=[7],
        parent_block_hash=None,
        token_ids=[9, 8, 7, 6],
        block_size=4,
        kv_cache_spec_kind=None,
    )


def sample_batch(ts: float = 1757500000.25) -> EventBatch:
    return EventBatch(
        ts=ts,
        events=[
            full_stored(),
            plain_stored(),
            BlockRemoved(block_hashes=[TOP_HASH, 5], medium="GPU", group_idx=2),
            AllBlocksCleared(),
        ],
    )


# --- vLLM's own declarations, copied from vllm/distributed/kv_events.py -------------------------
# Encoding the same batch with these and with kvroute must give identical bytes.


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmOldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


def vllm_event_classes(base: type) -> dict[str, type]:
    class BlockStored(base):  # type: ignore[misc, valid-type]
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class BlockRemoved(base):  # type: ignore[misc, valid-type]
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(base):  # type: ignore[misc, valid-type]
        pass

    return {c.__name__: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)}


def vllm_encode(batch: EventBatch, base: type) -> bytes:
    classes = vllm_event_classes(base)
    events = []
    for e in batch.events:
        cls = classes[type(e).__name__]
        # Fields kvroute does not model (sliding window, locality, ...) are None, as from an
        # engine without sliding-window layers or offloading.
        events.append(cls(**{name: getattr(e, name, None) for name in cls.__struct_fields__}))
    return msgspec.msgpack.encode(VllmEventBatch(batch.ts, events, batch.data_parallel_rank))


# --- (1) an independent subscriber, written from docs/vllm.md's description ---------------------------

# docs/vllm.md: "BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
# lora_name, extra_keys, group_idx, kv_cache_spec_kind"; "BlockRemoved: block_hashes, medium,
# group_idx"; "AllBlocksCleared: no fields"; older versions send positional arrays, tag first.
DOC_FIELDS = {
    "BlockStored": [
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ],
    "BlockRemoved": ["block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": [],
}


def doc_decode(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """Decode a payload into plain Python the way docs/vllm.md describes it, without kvroute."""
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list), "payload is an array [ts, events, data_parallel_rank]"
    ts, events, *rest = batch
    rank = rest[0] if rest else None
    out = []
    for event in events:
        if isinstance(event, dict):
            fields = dict(event)
        else:
            tag, *values = event
            fields = {"type": tag, **dict(zip(DOC_FIELDS[tag], values))}
        out.append(fields)
    return ts, out, rank


def expected_doc_fields(event: Any) -> dict[str, Any]:
    name = type(event).__name__
    fields = {"type": name}
    for f in DOC_FIELDS[name]:
        value = getattr(event, f)
        if f == "extra_keys" and value is not None:
            value = [list(k) if k is not None else None for k in value]
        fields[f] = value
    return fields


def wait_until_connected(pub: KVEventPublisher, sub: zmq.Socket, timeout: float = 5.0) -> int:
    """PUB drops messages until the subscription has travelled: send ts=-1 probes until one
    arrives, drain the rest; return the highest probe seq seen."""
    deadline = time.monotonic() + timeout
    last_probe = -1
    while time.monotonic() < deadline:
        pub.publish(EventBatch(ts=-1.0))
        if sub.poll(20):
            break
    else:
        raise AssertionError("subscriber never connected")
    pub.flush()
    while sub.poll(50):
        _, seq, _ = sub.recv_multipart()
        last_probe = int.from_bytes(seq, "big")
    return last_probe


class Sockets:
    """Test-side ZeroMQ sockets, all closed at teardown."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.open: list[zmq.Socket] = []

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.open.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.open:
            sock.close()
        self.ctx.term()


@pytest.fixture
def zctx():
    sockets = Sockets()
    yield sockets
    sockets.close()


@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_independent_subscriber_decodes_every_field(zctx, wire_format):
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=LOOPBACK_ANY_PORT, topic="kv")
    with KVEventPublisher(config, wire_format, data_parallel_rank=0) as pub:
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        last_probe = wait_until_connected(pub, sub)

        batches = [sample_batch(ts=100.0 + i) for i in range(3)]
        for b in batches:
            pub.publish(b)
        received = []
        while len(received) < 3:
            assert sub.poll(2000), "batch lost"
            received.append(sub.recv_multipart())

    for i, (frames, sent) in enumerate(zip(received, batches)):
        topic, seq, payload = frames
        assert topic == b"kv"
        assert len(seq) == 8 and int.from_bytes(seq, "big") == last_probe + 1 + i
        ts, events, rank = doc_decode(payload)
        assert ts == sent.ts
        assert rank == 0
        assert [e["type"] for e in events] == [type(e).__name__ for e in sent.events]
        for got, want in zip(events, sent.events):
            expected = expected_doc_fields(want)
            if wire_format == "map":
                # vLLM's omit_defaults: None-valued defaulted fields are absent, not null.
                for optional in ("extra_keys", "group_idx", "kv_cache_spec_kind"):
                    if expected.get(optional, 0) is None:
                        assert optional not in got
                        del expected[optional]
            assert {k: got[k] for k in expected} == expected
            if wire_format == "map":
                # The map's keys come in vLLM's declaration order, tag first.
                assert list(got)[: len(expected)] == list(expected)


@pytest.mark.parametrize(
    ("wire_format", "vllm_base"), [("map", VllmKVCacheEvent), ("array", VllmOldKVCacheEvent)]
)
def test_payload_bytes_equal_vllms_own_encoder(wire_format, vllm_base):
    for rank in (None, 0, 3):
        batch = sample_batch()
        batch.data_parallel_rank = rank
        assert encode_batch(batch, wire_format) == vllm_encode(batch, vllm_base)


# --- (2) replay ---------------------------------------------------------------------------------


def replay(zctx, endpoint: str, start: int, timeout_ms: int = 2000) -> list[list[bytes]]:
    dealer = zctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies = []
    while True:
        assert dealer.poll(timeout_ms), "replay did not answer"
        frames = dealer.recv_multipart()
        replies.append(frames)
        if frames[-2] == END_SEQ:
            return replies


def test_replay_returns_buffered_batches_from_start_seq_then_end_marker(zctx):
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=LOOPBACK_ANY_PORT,
        replay_endpoint=LOOPBACK_ANY_PORT,
        buffer_steps=4,
        topic="kv",
    )
    with KVEventPublisher(config) as pub:
        for i in range(6):
            pub.publish(EventBatch(ts=float(i), events=[BlockRemoved(block_hashes=[i])]))
        assert pub.flush(2.0)

        # Current vLLM: [b"", topic, seq, payload] per batch, then [b"", b"", -1, b""].
        replies = replay(zctx, pub.replay_endpoint, start=3)
        *batches, end = replies
        assert [f[:2] for f in batches] == [[b"", b"kv"]] * 3
        assert [int.from_bytes(f[2], "big") for f in batches] == [3, 4, 5]
        assert [decode_batch(f[3]).ts for f in batches] == [3.0, 4.0, 5.0]
        assert end == [b"", b"", END_SEQ, b""]
        assert int.from_bytes(end[2], "big", signed=True) == -1

        # Only the last buffer_steps batches are kept: asking from 0 gets 2..5.
        batches = replay(zctx, pub.replay_endpoint, start=0)[:-1]
        assert [int.from_bytes(f[2], "big") for f in batches] == [2, 3, 4, 5]
        # Beyond the newest: just the end marker.
        assert replay(zctx, pub.replay_endpoint, start=9) == [[b"", b"", END_SEQ, b""]]


# --- (3) bind / connect rule --------------------------------------------------------------------


def test_bind_rule_matches_vllm():
    assert publisher_binds("tcp://*:5557")
    assert publisher_binds("tcp://127.0.0.1:*")
    assert publisher_binds("tcp://[::]:5557")
    assert publisher_binds("ipc:///tmp/kv.sock")
    assert publisher_binds("inproc://kv")
    assert not publisher_binds("tcp://127.0.0.1:5557")
    assert not publisher_binds("tcp://router.internal:5557")


def test_explicit_host_publisher_connects_to_binding_subscriber(zctx):
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(LOOPBACK_ANY_PORT)
    address = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=address)
    with KVEventPublisher(config) as pub:
        assert not pub.binds and pub.endpoint == address
        wait_until_connected(pub, sub)
        pub.publish(sample_batch(ts=7.0))
        assert sub.poll(2000)
        assert decode_batch(sub.recv_multipart()[2]).ts == 7.0


def test_wildcard_publisher_binds_an_ephemeral_port():
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=LOOPBACK_ANY_PORT)
    with KVEventPublisher(config) as pub:
        assert pub.binds
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.endpoint.rsplit(":", 1)[1].isdigit()


def test_close_is_idempotent_and_frees_the_port(zctx):
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=LOOPBACK_ANY_PORT))
    endpoint = pub.endpoint
    pub.close()
    pub.close()
    with pytest.raises(RuntimeError):
        pub.publish(sample_batch())
    rebound = zctx.socket(zmq.PUB)
    rebound.bind(endpoint)  # raises EADDRINUSE if close() left the listener behind


def test_data_parallel_rank_offsets_endpoints_like_vllm(tmp_path):
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
    )
    with KVEventPublisher(config, data_parallel_rank=2) as pub:
        assert pub.endpoint == f"ipc://{tmp_path}/pub_dp2"
        assert pub.replay_endpoint == f"ipc://{tmp_path}/replay_dp2"


def test_disabled_config_publishes_nothing():
    pub = KVEventPublisher(KVEventsConfig(endpoint=LOOPBACK_ANY_PORT))
    assert not pub.enabled and pub.endpoint is None
    pub.publish(sample_batch())  # silently dropped, like vLLM's NullEventPublisher
    pub.close()


def test_bind_failure_is_a_user_error(zctx):
    taken = zctx.socket(zmq.PUB)
    taken.bind(LOOPBACK_ANY_PORT)
    port = taken.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    with pytest.raises(UserError, match="cannot bind"):
        KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))


# --- (4) codec ----------------------------------------------------------------------------------


@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_round_trip_keeps_every_field(wire_format):
    batch = sample_batch()
    batch.data_parallel_rank = 5
    decoded = decode_batch(encode_batch(batch, wire_format))
    assert decoded == DecodedBatch(batch.ts, batch.events, data_parallel_rank=5, unknown_events=0)


uint64 = st.integers(0, 2**64 - 1)
small_text = st.text(max_size=8)
stored_events = st.builds(
    BlockStored,
    block_hashes=st.lists(uint64, min_size=1, max_size=4),
    parent_block_hash=st.none() | uint64,
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=32),
    block_size=st.integers(1, 256),
    lora_id=st.none() | st.integers(0, 2**31),
    medium=st.none() | st.sampled_from(["GPU", "CPU"]),
    lora_name=st.none() | small_text,
    extra_keys=st.none()
    | st.lists(st.none() | st.tuples(small_text, st.integers(-(2**63), 2**64 - 1)), max_size=3),
    group_idx=st.integers(0, 8),
    kv_cache_spec_kind=st.none() | st.sampled_from(["full_attention", "sliding_window"]),
)
removed_events = st.builds(
    BlockRemoved,
    block_hashes=st.lists(uint64, min_size=1, max_size=4),
    medium=st.none() | st.sampled_from(["GPU", "CPU"]),
    group_idx=st.integers(0, 8),
)
batches = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(stored_events | removed_events | st.just(AllBlocksCleared()), max_size=5),
    data_parallel_rank=st.none() | st.integers(0, 64),
)


@settings(max_examples=150, deadline=None)
@given(batch=batches, wire_format=st.sampled_from(["map", "array"]))
def test_round_trip_of_any_batch(batch, wire_format):
    decoded = decode_batch(encode_batch(batch, wire_format))
    assert (decoded.ts, decoded.events, decoded.data_parallel_rank) == (
        batch.ts, batch.events, batch.data_parallel_rank
    )


def test_mixed_shapes_and_unknown_types_in_one_batch():
    stored = full_stored()
    payload = msgspec.msgpack.encode(
        [
            2.5,
            [
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 1},
                ["BlockStored", stored.block_hashes, 42, stored.token_ids, 4, 3, "CPU", "adapter-a",
                 [["mm-hash", 7], None], 1, "sliding_window"],
                {"type": "BlockPinned", "block_hashes": [1]},
                ["BlockStored", [9], None, [1, 2], 2, None],  # an old vLLM: no medium and later
                ["SomethingNew", 1, 2],
                {"type": "AllBlocksCleared", "locality": "LOCAL"},  # a newer field is ignored
                ["BlockRemoved", [b"\x01" * 24 + (77).to_bytes(8, "big")]],  # bytes hash
            ],
        ]
    )
    decoded = decode_batch(payload)
    assert decoded.ts == 2.5 and decoded.data_parallel_rank is None
    assert decoded.unknown_events == 2
    assert decoded.events == [
        BlockRemoved(block_hashes=[1], medium="GPU", group_idx=1),
        stored,
        BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                    lora_id=None, medium=None, kv_cache_spec_kind=None),
        AllBlocksCleared(),
        BlockRemoved(block_hashes=[77], medium=None),  # low 64 bits, as vLLM converts
    ]


def test_batch_encoded_as_a_map_is_accepted():
    payload = msgspec.msgpack.encode(
        {"ts": 1.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 0}
    )
    assert decode_batch(payload) == DecodedBatch(1.0, [AllBlocksCleared()], data_parallel_rank=0)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # reserved msgpack byte
        msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}]])[:-3],  # truncated
        msgspec.msgpack.encode("not a batch"),
        msgspec.msgpack.encode([1.0, "events"]),
        msgspec.msgpack.encode([1.0, [7]]),  # an event that is neither map nor array
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),  # fields missing
        msgspec.msgpack.encode([1.0, [["BlockRemoved", "not-a-list"]]]),
        msgspec.msgpack.encode([1.0, []]) + b"\x00",  # trailing bytes
        # an event's type tag that is not UTF-8
        msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}]]).replace(b"AllBlocks", b"\x80llBlocks"),
        msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]]]).replace(b"AllBlocks", b"\x80llBlocks"),
    ],
)
def test_malformed_payload_raises_decode_error(payload):
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


GOLDEN = json.loads((DATA / "golden" / "kvevents_payloads.json").read_text())


def event_from_json(fields: dict[str, Any]) -> Any:
    fields = dict(fields)
    kind = fields.pop("type")
    if kind == "BlockStored" and fields["extra_keys"] is not None:
        fields["extra_keys"] = [None if k is None else tuple(k) for k in fields["extra_keys"]]
    return {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}[
        kind
    ](**fields)


@pytest.mark.parametrize("case", GOLDEN["encode"], ids=lambda c: f"{c['name']}-{c['wire_format']}")
def test_payload_bytes_equal_the_recorded_msgspec_payloads(case):
    batch = case["batch"]
    events = [event_from_json(e) for e in batch["events"]]
    payload = bytes.fromhex(case["payload"])
    assert encode_batch(EventBatch(batch["ts"], events, batch["data_parallel_rank"]), case["wire_format"]) == payload
    assert decode_batch(payload) == DecodedBatch(batch["ts"], events, batch["data_parallel_rank"], 0)


@pytest.mark.parametrize("case", GOLDEN["decode"], ids=lambda c: c["name"])
def test_hand_built_payloads_decode_as_recorded(case):
    want = case["expected"]
    expected = DecodedBatch(
        want["ts"], [event_from_json(e) for e in want["events"]], want["data_parallel_rank"], want["unknown_events"]
    )
    assert decode_batch(bytes.fromhex(case["payload"])) == expected


@pytest.mark.parametrize(
    "payload",
    [
        b"\x91" * 10_000 + b"\xc0",
        msgspec.msgpack.encode([1.0, [["Unknown", []]]]).replace(b"\x90", b"\x91" * 10_000 + b"\xc0"),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "new": []}]]).replace(
            b"\x90", b"\x91" * 10_000 + b"\xc0"
        ),
    ],
    ids=["batch", "unknown-event", "unknown-field"],
)
def test_msgpack_nested_ten_thousand_deep_is_malformed(payload):
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_decode_native_keeps_the_events_in_rust_until_asked():
    batch = sample_batch()
    batch.data_parallel_rank = 2
    native = decode_native(encode_batch(batch))
    assert (native.ts, native.data_parallel_rank, native.unknown_events, len(native)) == (batch.ts, 2, 0, 4)
    assert native.events == batch.events
    assert native.to_python() == decode_batch(encode_batch(batch))
    with pytest.raises(KVEventDecodeError, match="not a KV event batch"):
        decode_native(b"\x92\xc0")


def test_unknown_wire_format_is_rejected():
    with pytest.raises(ValueError):
        encode_batch(sample_batch(), "json")
    with pytest.raises(UserError):
        KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True), wire_format="json")


# --- (5) KVEventSubscriber ----------------------------------------------------------------------


async def take_iterating(sub: KVEventSubscriber, n: int, timeout: float = 5.0) -> list[Any]:
    """The next ``n`` items, by ``async for``."""
    items = []

    async def collect() -> None:
        async for item in sub:
            items.append(item)
            if len(items) == n:
                return

    await asyncio.wait_for(collect(), timeout)
    return items


class RunTaker:
    """The next ``n`` items, from ``sub.run(callback)`` (started at the first call, running
    until the subscriber is closed): the same items in the same order as iterating."""

    def __init__(self) -> None:
        self.runs: dict[KVEventSubscriber, tuple[asyncio.Task, list[Any], list[int]]] = {}

    async def __call__(self, sub: KVEventSubscriber, n: int, timeout: float = 5.0) -> list[Any]:
        if sub not in self.runs:
            items: list[Any] = []
            self.runs[sub] = (asyncio.ensure_future(sub.run(items.append)), items, [0])
        task, items, taken = self.runs[sub]
        deadline = asyncio.get_running_loop().time() + timeout
        while len(items) < taken[0] + n:
            if task.done():
                task.result()  # raises what run() raised
                raise AssertionError(f"run() ended after {len(items)} items")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{len(items) - taken[0]} of {n} items")
            await asyncio.sleep(0.002)
        got = items[taken[0] : taken[0] + n]
        taken[0] += n
        return got

    async def finish(self) -> None:
        for task, _, _ in self.runs.values():
            # close() ends run(); a test that did not close gets it cancelled.
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.fixture(params=["iterate", "run"])
async def take(request):
    """Both ways of consuming a subscriber, for every test of its semantics."""
    if request.param == "iterate":
        yield take_iterating
        return
    taker = RunTaker()
    yield taker
    await taker.finish()


class FakeEngine:
    """A hand-driven publisher (XPUB, so the test knows when the subscription arrived) with an
    optional ROUTER replay socket that serves a fixed buffer, in current vLLM's reply framing
    (with a topic frame) or the older one (``topic_frame=False``)."""

    def __init__(
        self, with_replay: bool = True, answer_replay: bool = True, topic_frame: bool = True
    ) -> None:
        self.topic_frame = [b""] if topic_frame else []
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.bind(LOOPBACK_ANY_PORT)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = None
        self.replay_endpoint = None
        self.replay_requests: list[int] = []
        self.buffer: dict[int, bytes] = {}
        self.task = None
        if with_replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            # A ROUTER drops what exceeds its send high-water mark (1,000 messages) while the
            # reader lags, as vLLM's replay socket does; a dropped replay is a failed replay
            # (tested on its own). These tests are about the replayed batches, so none drop.
            self.router.setsockopt(zmq.SNDHWM, 0)
            self.router.bind(LOOPBACK_ANY_PORT)
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            if answer_replay:
                self.task = asyncio.ensure_future(self.serve_replay())

    async def wait_subscribed(self) -> None:
        assert (await asyncio.wait_for(self.pub.recv(), 5.0))[0] == 1

    async def send(self, seq: int) -> None:
        """Publish batch ``seq`` live (ts = seq) and keep it for replay; a batch the test put
        in the buffer beforehand goes out as it is (an engine replays the bytes it sent)."""
        payload = self.buffer.setdefault(
            seq, encode_batch(EventBatch(ts=float(seq), events=[BlockRemoved([seq])]))
        )
        await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            for seq in sorted(self.buffer):
                if seq >= start_seq:
                    frames = [client, b"", *self.topic_frame, seq.to_bytes(8, "big"), self.buffer[seq]]
                    await self.router.send_multipart(frames)
            await self.router.send_multipart([client, b"", *self.topic_frame, END_SEQ, b""])

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.ctx.destroy(linger=0)


def received(items: list[Any]) -> list[tuple[int, bool]]:
    return [(i.seq, i.replayed) for i in items if isinstance(i, EventsReceived)]


@pytest.mark.parametrize("topic_frame", [True, False], ids=["current-replay", "older-replay"])
async def test_gap_is_filled_by_replay_and_duplicates_are_skipped(topic_frame, take):
    engine = FakeEngine(topic_frame=topic_frame)
    sub = KVEventSubscriber(engine.endpoint, engine.replay_endpoint)
    try:
        await engine.wait_subscribed()
        await engine.send(0)
        engine.buffer[1] = encode_batch(EventBatch(ts=1.0))  # sent while the SUB "dropped" them
        engine.buffer[2] = encode_batch(EventBatch(ts=2.0))
        engine.buffer[4] = encode_batch(EventBatch(ts=4.0))  # already out when replay runs
        await engine.send(3)
        items = await take(sub, 6)
        await engine.send(4)  # the live copy of a replayed batch: skipped
        await engine.send(5)
        items += await take(sub, 1)
    finally:
        await sub.close()
        engine.close()
    assert engine.replay_requests == [1]
    assert items[1] == GapDetected(expected=1, got=3)
    assert received(items) == [(0, False), (1, True), (2, True), (3, False), (4, True), (5, False)]
    assert [i.batch.ts for i in items if isinstance(i, EventsReceived)] == [0, 1, 2, 3, 4, 5]


async def test_a_long_replay_lets_the_event_loop_run_other_work(take):
    """A router started beside a busy engine replays thousands of batches; taking them all
    without a pause would hold the loop (and every request it relays) for 100 ms or more."""
    engine = FakeEngine()
    sub = KVEventSubscriber(engine.endpoint, engine.replay_endpoint)
    n = 2000
    turns = 0
    stop = asyncio.Event()

    async def other_work() -> None:
        nonlocal turns
        while not stop.is_set():
            turns += 1
            await asyncio.sleep(0)

    try:
        await engine.wait_subscribed()
        await engine.send(0)
        for seq in range(1, n):
            engine.buffer[seq] = encode_batch(EventBatch(ts=float(seq), events=[BlockRemoved([seq])]))
        await engine.send(n)
        first = await take(sub, 2)  # batch 0, then the gap: the replay is now queued
        ticker = asyncio.ensure_future(other_work())
        turns_before = turns
        items = await take(sub, n)
        turns_during = turns - turns_before
        stop.set()
        await ticker
    finally:
        await sub.close()
        engine.close()
    assert received(first + items) == [(0, False)] + [(s, True) for s in range(1, n)] + [(n, False)]
    assert turns_during >= n // 100  # the loop got a turn at least every ~100 batches


async def test_catch_up_replays_the_buffer_before_any_live_batch(take):
    """A router restarted beside an idle engine learns its cache at once."""
    engine = FakeEngine()
    for seq in range(3):  # published before the subscriber existed
        engine.buffer[seq] = encode_batch(EventBatch(ts=float(seq), events=[BlockRemoved([seq])]))
    sub = KVEventSubscriber(engine.endpoint, engine.replay_endpoint, catch_up=True)
    try:
        await engine.wait_subscribed()
        items = await take(sub, 3)  # no live batch at all
        await engine.send(2)  # the live copy of a replayed batch: skipped
        await engine.send(3)
        items += await take(sub, 1)
    finally:
        await sub.close()
        engine.close()
    assert engine.replay_requests == [0]
    assert received(items) == [(0, True), (1, True), (2, True), (3, False)]


async def test_an_engine_restarted_after_the_catch_up_is_not_taken_for_duplicates(take):
    """The router replays engine A's buffer (0..2); A restarts before its next batch, and the
    new engine's live batch 0 has a seq the replay already gave. It is not the same batch, so
    it is a restart (the index must reset), not a duplicate to skip."""
    engine = FakeEngine()
    for seq in range(3):
        engine.buffer[seq] = encode_batch(EventBatch(ts=100.0 + seq, events=[BlockRemoved([100 + seq])]))
    sub = KVEventSubscriber(engine.endpoint, engine.replay_endpoint, catch_up=True)
    try:
        await engine.wait_subscribed()
        items = await take(sub, 3)
        engine.buffer.clear()  # the new engine's buffer
        await engine.send(0)
        await engine.send(1)
        items += await take(sub, 3)
    finally:
        await sub.close()
        engine.close()
    assert received(items[:3]) == [(0, True), (1, True), (2, True)]
    assert items[3] == EngineRestarted(last_seq=2, new_seq=0)
    assert received(items[4:]) == [(0, False), (1, False)]
    assert [i.batch.ts for i in items[4:]] == [0.0, 1.0]


async def test_catch_up_from_a_wrapped_buffer_reports_the_loss_then_delivers_the_rest(take):
    engine = FakeEngine()
    for seq in (5, 6):  # 0..4 rotated out
        engine.buffer[seq] = encode_batch(EventBatch(ts=float(seq)))
    sub = KVEventSubscriber(engine.endpoint, engine.replay_endpoint, catch_up=True)
    try:
        await engine.wait_subscribed()
        items = await take(sub, 3)
    finally:
        await sub.close()
        engine.close()
    assert items[0] == ReplayFailed(0, 5, "replay buffer starts at 5, not 0")
    assert received(items) == [(5, True), (6, True)]


async def test_catch_up_without_an_answer_leaves_it_to_the_live_stream(take):
    engine = FakeEngine(answer_replay=False)
    sub = KVEventSubscriber(engine.endpoint, engine.replay_endpoint, replay_timeout=0.2, catch_up=True)
    try:
        await engine.wait_subscribed()
        await engine.send(0)
        items = await take(sub, 1)
    finally:
        await sub.close()
        engine.close()
    assert received(items) == [(0, False)]


async def test_late_subscriber_replays_from_zero_with_real_publisher(take):
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=LOOPBACK_ANY_PORT, replay_endpoint=LOOPBACK_ANY_PORT
    )
    pub = KVEventPublisher(config)
    for i in range(3):  # nobody listens yet: lost on the PUB socket, kept in the replay buffer
        pub.publish(EventBatch(ts=float(i), events=[BlockRemoved([i])]))
    assert pub.flush()
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            pub.publish(EventBatch(ts=-1.0))
            await asyncio.sleep(0.02)

    prober = asyncio.ensure_future(probe())
    try:
        items = await take(sub, 10)
    finally:
        stop.set()
        await prober
        await sub.close()
        pub.close()
    gap = items[0]
    assert isinstance(gap, GapDetected) and gap.expected == 0 and gap.got >= 3
    seqs = [seq for seq, _ in received(items)]
    assert seqs == list(range(len(seqs)))  # complete, in order, no duplicates
    assert [i.batch.ts for i in items[1:4]] == [0.0, 1.0, 2.0]
    assert all(i.replayed for i in items[1:4])


async def test_gap_without_replay_endpoint_reports_replay_failed(take):
    engine = FakeEngine(with_replay=False)
    sub = KVEventSubscriber(engine.endpoint, replay_endpoint=None)
    try:
        await engine.wait_subscribed()
        await engine.send(0)
        await engine.send(2)
        items = await take(sub, 4)
    finally:
        await sub.close()
        engine.close()
    assert items[1:3] == [GapDetected(1, 2), ReplayFailed(1, 2, "no replay endpoint configured")]
    assert received(items) == [(0, False), (2, False)]


async def test_unresponsive_replay_endpoint_times_out_into_replay_failed(take):
    engine = FakeEngine(answer_replay=False)
    sub = KVEventSubscriber(engine.endpoint, engine.replay_endpoint, replay_timeout=0.2)
    try:
        await engine.wait_subscribed()
        await engine.send(0)
        await engine.send(5)
        started = time.monotonic()
        items = await take(sub, 4)
        elapsed = time.monotonic() - started
    finally:
        await sub.close()
        engine.close()
    failed = items[2]
    assert isinstance(failed, ReplayFailed) and (failed.expected, failed.got) == (1, 5)
    assert "no reply" in failed.reason
    assert elapsed < 2.0
    assert received(items) == [(0, False), (5, False)]


async def test_partial_replay_buffer_reports_replay_failed(take):
    engine = FakeEngine()
    sub = KVEventSubscriber(engine.endpoint, engine.replay_endpoint)
    try:
        await engine.wait_subscribed()
        await engine.send(0)
        engine.buffer = {3: encode_batch(EventBatch(ts=3.0))}  # 1 and 2 already rotated out
        await engine.send(4)
        items = await take(sub, 4)
    finally:
        await sub.close()
        engine.close()
    assert items[2] == ReplayFailed(1, 4, "replay buffer starts at 3, not 1")
    # The consumer drops the worker's state; what follows the loss is still delivered.
    assert received(items) == [(0, False), (4, False)]


@pytest.mark.parametrize("jump", [10**9, 2**64 - 1])
async def test_a_sequence_jump_of_any_size_costs_no_memory(take, jump):
    """The old subscriber built list(range(expected, got)): 2 GB at a jump of 5e7."""
    engine = FakeEngine()
    sub = KVEventSubscriber(engine.endpoint, engine.replay_endpoint)
    try:
        await engine.wait_subscribed()
        await engine.send(0)
        await engine.send(jump)
        items = await take(sub, 4)
    finally:
        await sub.close()
        engine.close()
    assert items[1:3] == [
        GapDetected(1, jump),
        ReplayFailed(1, jump, "replay returned nothing older than the live batch"),
    ]
    assert received(items) == [(0, False), (jump, False)]
    assert sub.last_seq == jump


async def test_malformed_payload_is_reported_and_stream_continues(take):
    engine = FakeEngine(with_replay=False)
    sub = KVEventSubscriber(engine.endpoint, replay_endpoint=None)
    try:
        await engine.wait_subscribed()
        await engine.pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1garbage"])
        await engine.pub.send_multipart([b"", b"short"])
        await engine.send(1)
        items = await take(sub, 3)
    finally:
        await sub.close()
        engine.close()
    assert isinstance(items[0], MalformedPayload) and items[0].seq == 0
    assert isinstance(items[1], MalformedPayload) and items[1].seq is None
    assert received(items) == [(1, False)]


async def test_new_publisher_on_same_endpoint_is_an_engine_restart(take):
    # Explicit-host endpoint: the engines connect, the subscriber binds and outlives them.
    sub = KVEventSubscriber(LOOPBACK_ANY_PORT, replay_endpoint=None, bind=True)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=sub.endpoint)

    async def run_engine(ts: float, extra: int) -> list[Any]:
        """Publish ts-marked probes until the subscriber yields one, then `extra` more."""
        with KVEventPublisher(config) as pub:
            seen: list[Any] = []

            async def until_first() -> None:
                async for item in sub:
                    seen.append(item)
                    if isinstance(item, EventsReceived):
                        return

            waiter = asyncio.ensure_future(until_first())
            while not waiter.done():
                pub.publish(EventBatch(ts=ts))
                await asyncio.wait([waiter], timeout=0.02)
            await waiter
            for _ in range(extra):
                pub.publish(EventBatch(ts=ts))
            assert pub.flush()
            if extra:
                seen += await take(sub, extra)
            return seen

    try:
        first = await asyncio.wait_for(run_engine(1.0, extra=30), 5.0)
        last_seq = sub.last_seq
        second = await asyncio.wait_for(run_engine(2.0, extra=0), 5.0)
    finally:
        await sub.close()
    assert last_seq >= 30 and all(i.batch.ts == 1.0 for i in first if isinstance(i, EventsReceived))
    restart = second[0]
    assert isinstance(restart, EngineRestarted) and restart.last_seq == last_seq
    assert restart.new_seq < last_seq
    events = [i for i in second if isinstance(i, EventsReceived)]
    assert events[0].seq == restart.new_seq and events[0].batch.ts == 2.0


async def test_close_ends_a_pending_iteration():
    engine = FakeEngine(with_replay=False)
    sub = KVEventSubscriber(engine.endpoint, replay_endpoint=None)
    try:
        pending = asyncio.ensure_future(sub.__anext__())
        await asyncio.sleep(0.05)
        await sub.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(pending, 1.0)
        await sub.close()  # idempotent
    finally:
        engine.close()



async def test_run_takes_a_backlog_beyond_one_reader_callback():
    """Batches queued before reading starts: the descriptor signals once, so the reader
    callback must schedule its own continuation after PAUSE_EVERY of them."""
    engine = FakeEngine(with_replay=False)
    sub = KVEventSubscriber(engine.endpoint, replay_endpoint=None)
    n = 5 * KVEventSubscriber.PAUSE_EVERY + 3
    try:
        await engine.wait_subscribed()
        for seq in range(n):
            await engine.send(seq)
        await asyncio.sleep(0.2)  # all queued on the SUB socket
        items = await RunTaker()(sub, n)
    finally:
        await sub.close()
        engine.close()
    assert received(items) == [(seq, False) for seq in range(n)]


async def test_run_ends_with_what_the_callback_raised_and_refuses_a_second_consumer():
    engine = FakeEngine(with_replay=False)
    sub = KVEventSubscriber(engine.endpoint, replay_endpoint=None)
    seen = []

    def on_item(item: Any) -> None:
        seen.append(item.seq)
        if item.seq == 1:
            raise ValueError("index broke")

    try:
        await engine.wait_subscribed()
        running = asyncio.ensure_future(sub.run(on_item))
        await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="already consuming"):
            await sub.run(on_item)
        for seq in range(3):
            await engine.send(seq)
        with pytest.raises(ValueError, match="index broke"):
            await asyncio.wait_for(running, 5.0)
    finally:
        await sub.close()
        engine.close()
    assert seen == [0, 1]


async def test_close_ends_run():
    engine = FakeEngine(with_replay=False)
    sub = KVEventSubscriber(engine.endpoint, replay_endpoint=None)
    try:
        running = asyncio.ensure_future(sub.run(lambda item: None))
        await asyncio.sleep(0.05)
        await sub.close()
        await asyncio.wait_for(running, 1.0)
    finally:
        engine.close()

# --- (6) KVEventsConfig -------------------------------------------------------------------------


def test_config_defaults_and_publisher_rule_match_vllm():
    assert KVEventsConfig() == KVEventsConfig.from_json("{}")
    assert KVEventsConfig().publisher == "null"
    enabled = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert enabled.publisher == "zmq" and enabled.endpoint == "tcp://*:5557"
    full = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000",'
        ' "replay_endpoint": "tcp://*:6001", "buffer_steps": 50, "hwm": 10, "max_queue_size": 0,'
        ' "topic": "kv@w0"}'
    )
    assert (full.endpoint, full.replay_endpoint, full.buffer_steps, full.topic) == (
        "tcp://*:6000", "tcp://*:6001", 50, "kv@w0"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{enable_kv_cache_events: true}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"enable_kv_cache_event": true}', "unknown field"),
        ('{"enable_kv_cache_events": "yes"}', "must be a bool"),
        ('{"publisher": "kafka"}', "publisher must be one of"),
        ('{"endpoint": "localhost:5557"}', "ZeroMQ address"),
        ('{"replay_endpoint": 5558}', "must be a str"),
        ('{"buffer_steps": "100"}', "must be an integer"),
        ('{"buffer_steps": 0}', "must be >= 1"),
        ('{"hwm": true}', "must be an integer"),
        ('{"max_queue_size": -1}', "must be >= 0"),
        ('{"topic": null}', "must be a str"),
    ],
)
def test_config_from_json_rejects_bad_input(text, message):
    with pytest.raises(UserError, match=message):
        KVEventsConfig.from_json(text)


def test_with_port_offset_moves_both_ports():
    config = KVEventsConfig(endpoint="tcp://*:5557", replay_endpoint="tcp://10.0.0.5:5600")
    moved = config.with_port_offset(3)
    assert (moved.endpoint, moved.replay_endpoint) == ("tcp://*:5560", "tcp://10.0.0.5:5603")
    assert config.endpoint == "tcp://*:5557"  # a new config, the old one untouched
    assert KVEventsConfig().with_port_offset(2).replay_endpoint is None
    assert KVEventsConfig(endpoint="ipc:///tmp/kv").with_port_offset(1).endpoint == "ipc:///tmp/kv_dp1"
    assert config.with_port_offset(0) == config
    # Ephemeral ports stay ephemeral: each worker binds its own free port.
    assert KVEventsConfig(endpoint="tcp://127.0.0.1:*").with_port_offset(1).endpoint == "tcp://127.0.0.1:*"
    assert KVEventsConfig(endpoint="tcp://*:0").with_port_offset(4).endpoint == "tcp://*:0"
    with pytest.raises(UserError):
        KVEventsConfig(endpoint="tcp://127.0.0.1").with_port_offset(1)
    with pytest.raises(UserError):
        config.with_port_offset(-1)
    with pytest.raises(UserError):
        KVEventsConfig(endpoint="tcp://*:65535").with_port_offset(1)
