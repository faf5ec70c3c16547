"""vLLM's KV cache event payloads, byte for byte (sans I/O: bytes in, objects out).

One published message is the ZeroMQ multipart ``[topic, seq, payload]``: ``seq`` is an 8-byte
big-endian unsigned counter starting at 0 per engine process, ``payload`` the msgpack encoding
of an ``EventBatch``. Two event shapes exist in the wild:

* ``"map"`` (current vLLM): the batch is ``[ts, events, data_parallel_rank]`` and every event a
  map tagged by ``"type"``: ``{"type": "BlockStored", "block_hashes": [...], ...}``; fields
  holding their default (``extra_keys``, ``kv_cache_spec_kind``,
  ``kv_cache_spec_sliding_window`` when None) are left out.
* ``"array"`` (older vLLM, ``array_like=True`` events): every event is a positional array with
  the tag first: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]``.

The codec is native (``kvroute-core``'s ``kvevents::codec``): it writes the bytes vLLM's msgspec
Structs write (``tests/data/golden/kvevents_payloads.json`` holds payloads recorded from them),
and its decoder accepts both shapes, even mixed in one batch, plus a batch encoded as a map; it
ignores fields it does not know (newer vLLMs append some), reads bytes block hashes as the low
64 bits of the digest, and counts events of unknown type instead of failing, so a router keeps
working across vLLM upgrades. Nesting deeper than 32 levels is malformed.

:func:`decode_native` is the router's path: the events stay in Rust (a
``kvroute._native.NativeEventBatch``) for the index to apply there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute import _native
from kvroute.engine.events import EventBatch, KVCacheEvent

#: Accepted values of ``wire_format``.
WIRE_FORMATS = ("map", "array")

#: The replay stream's end marker: sequence number -1 as a signed 8-byte big-endian integer.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

#: A decoded batch held in Rust (see :func:`decode_native`).
NativeEventBatch = _native.NativeEventBatch


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
    return _native.encode_batch(batch, check_wire_format(wire_format))


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode a published payload of any known shape into ``kvroute.engine.events`` objects.

    Raises:
        KVEventDecodeError: the bytes are not msgpack, not an event batch, or a known event
            misses required fields.
    """
    return _native.decode_batch(payload)


def decode_native(payload: bytes) -> NativeEventBatch:
    """Decode a payload without creating a Python object per event: the batch's ``ts``,
    ``data_parallel_rank``, ``unknown_events`` and ``len()`` are read from Python, its events
    by the native index (``events`` builds them as Python objects on demand).

    Raises:
        KVEventDecodeError: as :func:`decode_batch`.
    """
    return _native.decode_native(payload)
