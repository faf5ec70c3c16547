"""KV events between emulated workers and a router in one test: the workers publish on
loopback ports of their own choosing, and the router subscribes to each worker's."""

import json

from kvroute.router import EventsSettings, EventsSource

#: ``kv_events_config`` for emulated workers: ZMQ on ephemeral loopback ports, with replay.
EVENTS = json.dumps({
    "enable_kv_cache_events": True, "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
})


def events_for(workers) -> EventsSettings:
    """The router's events settings for started emulated ``workers``, keyed by their URLs."""
    return EventsSettings(per_worker={
        w.url: EventsSource(w.kv_events_endpoint, w.kv_events_replay_endpoint) for w in workers
    })
