"""vLLM's KV cache event payloads, byte for byte (sans I/O: bytes in, objects out).

One published message is the ZeroMQ multipart ``[topic, seq, payload]``: ``seq`` is an 8-byte
big-endian unsigned counter starting at 0 per engine process, ``payload`` the msgpack encoding
of an ``EventBatch``. vLLM's encoders are msgspec Structs, so this module declares the same
Structs (same field order, same ``omit_defaults``/``tag``/``array_like`` options) and lets msgspec
produce the bytes; nothing is hand-serialized. Two event shapes exist in the wild:

* ``"map"`` (current vLLM): the batch is ``[ts, events, data_parallel_rank]`` and every event a
  map tagged by ``"type"``: ``{"type": "BlockStored", "block_hashes": [...], ...}``; fields
  holding their default (``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``,
  ``kv_cache_spec_sliding_window`` when None) are left out.
* ``"array"`` (older vLLM, ``array_like=True`` events): every event is a positional array with
  the tag first: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]``.

The decoder accepts both, even mixed in one batch, plus a batch encoded as a map; it ignores
fields it does not know (newer vLLMs append some) and counts events of unknown type instead of
failing, so a router keeps working across vLLM upgrades.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Union

import msgspec

from kvroute.engine.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)
from kvroute.errors import UNDECODABLE

#: Accepted values of ``wire_format``.
WIRE_FORMATS = ("map", "array")

#: The replay stream's end marker: sequence number -1 as a signed 8-byte big-endian integer.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

_UINT64_MASK = (1 << 64) - 1


class KVEventDecodeError(ValueError):
    """A payload is not a msgpack-encoded vLLM event batch (bad bytes or a known event with
    missing or mistyped fields). Events of an unknown type are not an error."""


@dataclass(slots=True)
class DecodedBatch:
    """One decoded payload.

    ``unknown_events`` counts events whose type tag this decoder does not know (a newer vLLM);
    they are skipped, the other events of the batch are kept.
    """

    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None
    unknown_events: int = 0


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian unsigned frame vLLM sends as a message's sequence number."""
    return seq.to_bytes(8, "big")


# --- Encoding: vLLM's own Struct declarations --------------------------------------------------
# Field order and defaults are those of current vllm/distributed/kv_events.py. Defaults decide
# what omit_defaults drops from the map shape, so they must be vLLM's (None), not kvroute's.
# kvroute's events have no kv_cache_spec_sliding_window, locality, ownership or session_id: they
# go out as None, which is what a vLLM engine without sliding windows / offloading sends.
# The "array" shape reuses the same fields positionally (msgspec writes trailing Nones).


class _WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag_field="type"):
    pass


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


# The older positional shape: the same fields, written as arrays with the tag first.
class _ArrayBlockStored(_MapBlockStored, array_like=True, tag="BlockStored"):
    pass


class _ArrayBlockRemoved(_MapBlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ArrayAllBlocksCleared(_MapAllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


_WIRE_TYPES = {
    "map": (_MapBlockStored, _MapBlockRemoved, _MapAllBlocksCleared),
    "array": (_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared),
}


def _enc_hook(obj: Any) -> Any:
    # The engine model may hand over numpy integers (token ids, hashes); msgpack has one int type.
    if isinstance(obj, numbers.Integral):
        return int(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__} in a KV event")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def _to_wire(event: KVCacheEvent, wire_format: str) -> msgspec.Struct:
    stored_t, removed_t, cleared_t = _WIRE_TYPES[wire_format]
    if isinstance(event, BlockStored):
        return stored_t(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
        )
    if isinstance(event, BlockRemoved):
        return removed_t(
            block_hashes=event.block_hashes, medium=event.medium, group_idx=event.group_idx
        )
    if isinstance(event, AllBlocksCleared):
        return cleared_t()
    raise TypeError(f"not a KV cache event: {event!r}")


def check_wire_format(wire_format: str) -> str:
    """Return ``wire_format`` if it is one of :data:`WIRE_FORMATS`, else raise ValueError."""
    if wire_format not in WIRE_FORMATS:
        raise ValueError(f"wire format must be one of {', '.join(WIRE_FORMATS)}, got {wire_format!r}")
    return wire_format


def encode_batch(batch: EventBatch, wire_format: str = "map") -> bytes:
    """The msgpack payload vLLM would publish for ``batch``.

    Args:
        batch: one engine step's events.
        wire_format: ``"map"`` (current vLLM: events are maps tagged by ``"type"``) or
            ``"array"`` (older vLLM: positional arrays, tag first).
    """
    check_wire_format(wire_format)
    wire = _WireBatch(
        ts=batch.ts,
        events=[_to_wire(e, wire_format) for e in batch.events],
        data_parallel_rank=batch.data_parallel_rank,
    )
    return _encoder.encode(wire)


# --- Decoding -----------------------------------------------------------------------------------
# Separate, more lenient Structs: every field after the ones all vLLM versions sent is optional
# (the oldest BlockStored stopped at lora_id, the oldest BlockRemoved had only block_hashes),
# block hashes may be bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), and unknown map fields or
# extra trailing array items are ignored by msgspec's defaults.

_Hash = Union[int, bytes]


class _BatchArrayIn(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _BatchMapIn(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _StoredFields(msgspec.Struct, gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _RemovedFields(msgspec.Struct, gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None


class _MapStoredIn(_StoredFields, tag_field="type", tag="BlockStored"):
    pass


class _MapRemovedIn(_RemovedFields, tag_field="type", tag="BlockRemoved"):
    pass


class _MapClearedIn(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class _ArrayStoredIn(_StoredFields, array_like=True, tag="BlockStored"):
    pass


class _ArrayRemovedIn(_RemovedFields, array_like=True, tag="BlockRemoved"):
    pass


class _ArrayClearedIn(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


_ArrayEvent = _ArrayStoredIn | _ArrayRemovedIn | _ArrayClearedIn
_MapEvent = _MapStoredIn | _MapRemovedIn | _MapClearedIn


def _make_typed_batch_decoders(array_like: bool) -> tuple[msgspec.msgpack.Decoder, ...]:
    """Decoders of a whole batch of one envelope shape whose events all share one shape,
    the batch's own shape first (vLLM's), then the other."""
    decoders = []
    for event_type in ((_ArrayEvent, _MapEvent) if array_like else (_MapEvent, _ArrayEvent)):
        typed = msgspec.defstruct(
            "_BatchTypedIn",
            [("ts", float), ("events", list[event_type]), ("data_parallel_rank", int | None, None)],
            array_like=array_like,
            gc=False,
        )
        decoders.append(msgspec.msgpack.Decoder(typed))
    return tuple(decoders)


_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
#: The common case in one call: a batch whose events all share one shape and have known tags.
#: Anything else fails these decoders (at its first odd event) and takes the event-by-event path.
_typed_batch_decoders = {True: _make_typed_batch_decoders(True), False: _make_typed_batch_decoders(False)}
_batch_array_decoder = msgspec.msgpack.Decoder(_BatchArrayIn)
_batch_map_decoder = msgspec.msgpack.Decoder(_BatchMapIn)
_map_event_decoder = msgspec.msgpack.Decoder(_MapEvent)
_array_event_decoder = msgspec.msgpack.Decoder(_ArrayEvent)


def _is_msgpack_map(first_byte: int) -> bool:
    # fixmap 0x80-0x8f, map16 0xde, map32 0xdf
    return 0x80 <= first_byte <= 0x8F or first_byte in (0xDE, 0xDF)


def _hash64(value: int | bytes) -> int:
    # vLLM's maybe_convert_block_hash: low 64 bits of the big-endian digest.
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _UINT64_MASK
    return value


def _hashes64(values: list[int | bytes]) -> list[int]:
    # Integers (vLLM's default) pass through without a call per hash.
    if bytes not in set(map(type, values)):
        return values
    return [_hash64(h) for h in values]


_REMOVED_TYPES = frozenset({_ArrayRemovedIn, _MapRemovedIn})


def _from_wire(event: msgspec.Struct) -> KVCacheEvent:
    if type(event) in _REMOVED_TYPES:
        # The most common event (vLLM sends one per evicted block), so checked first, built
        # with positional arguments and no call for the usual single integer hash.
        hashes = event.block_hashes
        group = event.group_idx
        return BlockRemoved(
            hashes if len(hashes) == 1 and type(hashes[0]) is int else _hashes64(hashes),
            event.medium,
            0 if group is None else group,
        )
    if isinstance(event, _StoredFields):
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=_hashes64(event.block_hashes),
            parent_block_hash=None if parent is None else _hash64(parent),
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            # vLLM types these as tuples (one per block, or None); msgpack only has arrays.
            extra_keys=(
                None
                if event.extra_keys is None
                else [tuple(k) if isinstance(k, list) else k for k in event.extra_keys]
            ),
            # An absent group means vLLM's single KV cache group, which kvroute numbers 0.
            group_idx=0 if event.group_idx is None else event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
        )
    return AllBlocksCleared()


def _event_tag(raw: msgspec.Raw) -> Any:
    """The type tag of an event that failed typed decoding, or None if it has none."""
    try:
        generic = msgspec.msgpack.decode(raw)
    except UNDECODABLE:
        return None
    if isinstance(generic, dict):
        return generic.get("type")
    if isinstance(generic, list) and generic:
        return generic[0]
    return None


def _decode_event(raw: msgspec.Raw, index: int) -> KVCacheEvent | None:
    """Decode one event of either shape; None means "unknown type, skip it"."""
    data = memoryview(raw)
    if not data:
        raise KVEventDecodeError(f"event {index} is empty")
    first = data[0]
    if _is_msgpack_map(first):
        decoder = _map_event_decoder
    elif 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):  # fixarray, array16, array32
        decoder = _array_event_decoder
    else:
        raise KVEventDecodeError(f"event {index} is neither a map nor an array")
    try:
        return _from_wire(decoder.decode(raw))
    except msgspec.ValidationError as exc:
        tag = _event_tag(raw)
        if isinstance(tag, str) and tag in _KNOWN_TAGS:
            raise KVEventDecodeError(f"event {index} ({tag}) is malformed: {exc}") from exc
        # A tag we have never heard of: a newer vLLM's event type. Skipping it keeps the router
        # running; the caller sees the count.
        return None
    except UNDECODABLE as exc:  # broken msgpack or text inside one event
        raise KVEventDecodeError(f"event {index} is malformed: {exc}") from exc


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode a published payload of any known shape.

    Raises:
        KVEventDecodeError: the bytes are not msgpack, not an event batch, or a known event
            misses required fields.
    """
    if not payload:
        raise KVEventDecodeError("empty payload")
    is_map = _is_msgpack_map(payload[0])
    for typed_decoder in _typed_batch_decoders[not is_map]:
        try:
            typed = typed_decoder.decode(payload)
        except UNDECODABLE:  # ValidationError included: the careful path says why
            continue
        return DecodedBatch(
            ts=typed.ts,
            events=[_from_wire(e) for e in typed.events],
            data_parallel_rank=typed.data_parallel_rank,
            unknown_events=0,
        )
    decoder = _batch_map_decoder if is_map else _batch_array_decoder
    try:
        envelope = decoder.decode(payload)
    except UNDECODABLE as exc:
        raise KVEventDecodeError(f"not a KV event batch: {exc}") from exc
    events: list[KVCacheEvent] = []
    unknown = 0
    for index, raw in enumerate(envelope.events):
        event = _decode_event(raw, index)
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return DecodedBatch(
        ts=envelope.ts,
        events=events,
        data_parallel_rank=envelope.data_parallel_rank,
        unknown_events=unknown,
    )
