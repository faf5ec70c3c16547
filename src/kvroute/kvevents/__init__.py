"""KV cache events in vLLM's exact wire format: config, codec, publisher and subscriber.

* :mod:`.config` - ``KVEventsConfig`` (vLLM's ``--kv-events-config``), endpoint rules, and
  ``EventsSettings`` / ``EventsSource`` (where a subscriber finds each worker's sockets).
* :mod:`.wire` - msgpack payloads of both vLLM shapes, sans I/O.
* :mod:`.publisher` - ``KVEventPublisher``, a ``ZmqEventPublisher`` twin for the emulator.
* :mod:`.subscriber` - ``KVEventSubscriber``, async iterator over one engine's items (gaps,
  replays, restarts), over the native consumer ``KvEventConsumer`` (``kvroute-io``), which
  the router runs over its index directly.
"""

from kvroute._native import KvEventConsumer
from kvroute.kvevents.config import (
    PUBLISHER_KINDS,
    EventsSettings,
    EventsSource,
    KVEventsConfig,
    offset_endpoint,
    publisher_binds,
)
from kvroute.kvevents.publisher import KVEventPublisher
from kvroute.kvevents.subscriber import (
    EngineRestarted,
    EventsReceived,
    GapDetected,
    KVEventSubscriber,
    MalformedPayload,
    ReplayFailed,
    SubscriberItem,
)
from kvroute.kvevents.wire import (
    END_SEQ,
    WIRE_FORMATS,
    DecodedBatch,
    KVEventDecodeError,
    decode_batch,
    encode_batch,
    encode_seq,
)

__all__ = [
    "DecodedBatch",
    "END_SEQ",
    "EngineRestarted",
    "EventsReceived",
    "EventsSettings",
    "EventsSource",
    "GapDetected",
    "KVEventDecodeError",
    "KVEventPublisher",
    "KVEventSubscriber",
    "KVEventsConfig",
    "KvEventConsumer",
    "MalformedPayload",
    "PUBLISHER_KINDS",
    "ReplayFailed",
    "SubscriberItem",
    "WIRE_FORMATS",
    "decode_batch",
    "encode_batch",
    "encode_seq",
    "offset_endpoint",
    "publisher_binds",
]
