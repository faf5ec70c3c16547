"""vLLM's ``--kv-events-config``: where and how an engine publishes KV cache events.

The field names, defaults and the publisher default rule mirror ``vllm.config.kv_events.
KVEventsConfig`` so a JSON string that works with ``vllm serve --kv-events-config`` works with
kvroute's emulator unchanged, and the other way round. The endpoint helpers encode vLLM's socket
conventions (which side binds, how data-parallel ranks shift ports) in one place, because the
publisher and the subscriber must agree on them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvroute.errors import UserError

#: Publisher kinds vLLM registers by default.
PUBLISHER_KINDS = ("zmq", "null")

_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass
class KVEventsConfig:
    """KV cache event publishing settings, field for field as vLLM's ``KVEventsConfig``.

    ``publisher`` left unset (None) resolves like vLLM: ``"zmq"`` when events are enabled,
    ``"null"`` otherwise; after construction it is always one of :data:`PUBLISHER_KINDS`.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @property
    def publishes(self) -> bool:
        """True when an engine with this config actually puts events on a socket."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse and validate the JSON object given to ``--kv-events-config``.

        Raises:
            UserError: the text is not a JSON object, names a field vLLM does not have, or a
                value has the wrong type or range.
        """
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"--kv-events-config is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise UserError(
                f"--kv-events-config must be a JSON object, got {type(raw).__name__}: {text!r}"
            )
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise UserError(
                f"--kv-events-config has unknown field(s) {', '.join(map(repr, unknown))}; "
                f"vLLM's fields are: {', '.join(known)}"
            )
        config = cls(**raw)
        config.validate()
        return config

    def validate(self) -> None:
        """Check types and ranges the way a user needs to hear about them (one line each)."""
        _expect(self, "enable_kv_cache_events", bool)
        if self.publisher not in PUBLISHER_KINDS:
            raise UserError(
                f"kv-events-config publisher must be one of {', '.join(PUBLISHER_KINDS)}, "
                f"got {self.publisher!r}"
            )
        _expect(self, "endpoint", str)
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _expect(self, "replay_endpoint", str)
            _check_endpoint("replay_endpoint", self.replay_endpoint)
        # buffer_steps 0 would make a replay endpoint that can never answer anything.
        _expect_int(self, "buffer_steps", minimum=1)
        # 0 is ZeroMQ's "no limit" for hwm and Python's "unbounded" for the queue.
        _expect_int(self, "hwm", minimum=0)
        _expect_int(self, "max_queue_size", minimum=0)
        _expect(self, "topic", str)

    def with_port_offset(self, offset: int) -> KVEventsConfig:
        """This config with both endpoints moved by ``offset``, for N workers on consecutive
        ports (worker i uses ``with_port_offset(i)``).

        tcp endpoints get ``port + offset``; ipc/inproc endpoints get the suffix ``_dp<offset>``
        (vLLM's convention for inproc). Offset 0 returns an equal config.

        Raises:
            UserError: negative offset, or a tcp endpoint without a numeric port.
        """
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise UserError(f"port offset must be a non-negative integer, got {offset!r}")
        return dataclasses.replace(
            self,
            endpoint=offset_endpoint(self.endpoint, offset),
            replay_endpoint=(
                None
                if self.replay_endpoint is None
                else offset_endpoint(self.replay_endpoint, offset)
            ),
        )


def publisher_binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds (True) or connects (False) its PUB socket to ``endpoint``.

    vLLM's heuristic, copied exactly: bind for a wildcard (``*`` or ``::`` anywhere) and for
    ipc/inproc; connect otherwise, i.e. to an explicit host, in which case the subscriber must be
    the side that binds. The replay ROUTER socket always binds.
    """
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``endpoint`` with its port increased by ``offset`` (tcp) or ``_dp<offset>`` appended
    (ipc/inproc); unchanged for offset 0 and for an ephemeral tcp port (``*`` or ``0``).

    vLLM's ``ZmqEventPublisher.offset_endpoint_port`` applies the same rule with the data-parallel
    rank as offset, so rank r of a DP engine started with ``tcp://*:5557`` publishes on 5557 + r.
    """
    if offset == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if sep and port in ("*", "0") and base != "tcp":
            # An ephemeral port: every worker binds its own free port (read back from the
            # publisher), so there is nothing to offset.
            return endpoint
        if not sep or not port.isdigit() or base == "tcp":
            raise UserError(
                f"cannot offset the port of {endpoint!r}: it has no numeric port "
                "(use an explicit port such as tcp://*:5557)"
            )
        new_port = int(port) + offset
        if new_port > 65535:
            raise UserError(f"port offset {offset} moves {endpoint!r} past port 65535")
        return f"{base}:{new_port}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{offset}"
    raise UserError(f"cannot offset endpoint {endpoint!r}: expected tcp://, ipc:// or inproc://")


def _check_endpoint(name: str, endpoint: str) -> None:
    if not endpoint.startswith(_ENDPOINT_SCHEMES) or endpoint in _ENDPOINT_SCHEMES:
        raise UserError(
            f"kv-events-config {name} must be a ZeroMQ address like tcp://*:5557, "
            f"tcp://10.0.0.5:5557 or ipc:///tmp/kv.sock, got {endpoint!r}"
        )


def _expect(config: KVEventsConfig, name: str, kind: type) -> Any:
    value = getattr(config, name)
    if not isinstance(value, kind):
        raise UserError(
            f"kv-events-config {name} must be a {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def _expect_int(config: KVEventsConfig, name: str, minimum: int) -> None:
    value = getattr(config, name)
    # bool is an int subclass; `"hwm": true` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"kv-events-config {name} must be an integer, got {value!r}")
    if value < minimum:
        raise UserError(f"kv-events-config {name} must be >= {minimum}, got {value}")


# -- the subscriber's side: where each worker publishes -------------------------------------


@dataclass(frozen=True)
class EventsSource:
    """A worker's KV event sockets (ZeroMQ addresses)."""

    endpoint: str
    replay_endpoint: str | None = None


@dataclass
class EventsSettings:
    """Where each worker publishes its KV events.

    Attributes:
        port: events port on every worker's host (``tcp://<worker host>:<port>``), for
            discovered workers that all publish on the same port (one pod, one IP each).
        replay_port: replay port on every worker's host, or None (gaps then reset the worker).
        per_worker: explicit sockets by worker URL or name; they override ``port``.
        topic: subscription prefix (vLLM's ``topic``).
    """

    port: int | None = None
    replay_port: int | None = None
    per_worker: dict[str, EventsSource] = field(default_factory=dict)
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.port is not None or bool(self.per_worker)

    def source_for(self, endpoint: Any) -> EventsSource | None:
        """The sockets of a worker (anything with a worker ``url`` and ``name``, such as a
        discovery ``Endpoint``): explicit ones first, else ``port`` on the worker's host."""
        explicit = self.per_worker.get(endpoint.url) or self.per_worker.get(endpoint.name)
        if explicit is not None:
            return explicit
        if self.port is None:
            return None
        host = urlsplit(endpoint.url).hostname or ""
        host = f"[{host}]" if ":" in host else host
        replay = f"tcp://{host}:{self.replay_port}" if self.replay_port is not None else None
        return EventsSource(f"tcp://{host}:{self.port}", replay)
