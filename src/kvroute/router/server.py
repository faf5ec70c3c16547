"""The live router (``kvroute serve``): an OpenAI-compatible HTTP proxy that sends each request
to the worker holding most of its prefix, fed by the workers' KV events or by its own
predictions.

The data plane is native (``crates/kvroute-serve``: tokio and hyper) and serves every request
on its own threads, without the interpreter: the edge limits, parsing the body, tokenizing and
hashing the prompt, the routing step (the same ``kvroute_core`` step as the simulator),
forwarding, relaying the answer event by event, retries before the first byte, health checks
and outlier ejection. Python turns the configuration into the server's arguments and, for a
discovery source that changes (worker file, DNS, Kubernetes), follows it and hands each
complete worker list over.

The workers' KV events are followed by the native consumer (``kvroute-io``) on a thread of
its own and applied to the index the routing step reads; chats are rendered with the
tokenizer's chat template; retention (``--retention on|auto``) sends its refreshes from the
native server; without ``--tokenizer`` prompts are tokenized with kvroute's synthetic
tokenizer (the emulator's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kvroute._native import NativeRouter, check_serve_config
from kvroute.errors import UserError
from kvroute.kvevents import EventsSettings
from kvroute.router.config import RouterConfig, predicted_settings, retention_capacity
from kvroute.router.discovery import Discovery, Endpoint, StaticDiscovery
from kvroute.router.resources import default_max_connections
from kvroute.router.status import WorkerStatus, metric_value
from kvroute.routing.index import KvIndex

logger = logging.getLogger(__name__)

#: Response header naming the worker that served the request.
WORKER_HEADER = "x-kvroute-worker"


def worker_specs(config: RouterConfig, endpoints: Sequence[Endpoint]) -> list[dict[str, Any]]:
    """``kvroute_serve::WorkerSpec``'s fields per endpoint, as ``NativeRouter`` takes them."""
    events = config.events or EventsSettings()
    specs = []
    for e in endpoints:
        source = events.source_for(e) if events.enabled else None
        sockets = None if source is None else {"endpoint": source.endpoint, "replay_endpoint": source.replay_endpoint}
        specs.append({"url": e.url, "name": e.name, "events": sockets, "ready": e.ready})
    return specs


def native_config(config: RouterConfig, workers: list[dict[str, Any]]) -> dict[str, Any]:
    """``config`` as ``NativeRouter`` takes it: ``kvroute_serve::ServeConfig``'s fields, with
    the choices that depend on several settings made here (the predicted entries' TTL and
    capacity, retention's mode and capacity, the connection limit)."""
    events = config.events or EventsSettings()
    ttl, capacity = predicted_settings(config)
    meshed = config.mesh_bind is not None or config.peers
    mesh = {"bind": config.mesh_bind, "peers": list(config.peers)} if meshed else None
    return dict(
        host=config.host, port=config.port, threads=config.threads, workers=workers,
        events_topic=events.topic,
        policy={"name": config.policy, "seed": config.seed, "options": dict(config.policy_options)},
        block_size=config.block_size, hash_seed=config.hash_seed, tokenizer=config.tokenizer,
        prompt_cache_bytes=config.prompt_cache_bytes, predicted_ttl_s=ttl, predicted_capacity_blocks=capacity,
        index_max_bytes=config.index_max_bytes, max_body_bytes=config.max_body_bytes,
        max_buffered_body_bytes=config.max_buffered_body_bytes, max_json_depth=config.max_json_depth,
        offload_bytes=config.offload_bytes, header_timeout_s=config.header_timeout_s,
        keepalive_timeout_s=config.keepalive_timeout_s, send_timeout_s=config.send_timeout_s,
        body_timeout_s=config.body_timeout_s,
        max_connections=default_max_connections() if config.max_connections is None else config.max_connections,
        connect_timeout_s=config.connect_timeout_s, first_byte_timeout_s=config.first_byte_timeout_s,
        stream_idle_timeout_s=config.stream_idle_timeout_s, max_attempts=config.max_attempts,
        health_interval_s=config.health_interval_s or None, health_timeout_s=config.health_timeout_s,
        eject_after_failures=config.eject_after_failures, eject_base_s=config.eject_base_s,
        api_key=config.api_key, metrics_public=config.metrics_public,
        worker_api_key=config.worker_api_key, forward_authorization=config.forward_authorization,
        retention=config.retention_mode(), retention_capacity_blocks=retention_capacity(config),
        kv_capacity_blocks=config.kv_capacity_blocks, max_loras=config.max_loras, mesh=mesh,
    )


def check_config(config: RouterConfig) -> None:
    """Refuse ``config`` as the router would (:class:`ConfigError`), without starting one: the
    data plane's ``ServeConfig::validate`` is the one check of the settings."""
    try:
        check_serve_config(native_config(config, []))
    except ValueError as exc:
        raise _config_error(exc) from None


class ConfigError(UserError):
    """A setting the router cannot run with: :attr:`field` is its ``RouterConfig`` name (None
    when the failure is no one setting's, such as an address in use); the CLI names its flag."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message if field is None else f"{field} {message}")
        self.field = field
        self.message = message


def _config_error(exc: ValueError) -> ConfigError:
    """The native router's refusal (``ValueError((field, message))`` or ``ValueError(message)``)."""
    if len(exc.args) == 2:
        field, message = exc.args
        return ConfigError(_NATIVE_FIELDS.get(field, field), message)
    return ConfigError(None, str(exc))


#: ``ServeConfig`` fields whose ``RouterConfig`` setting has another name (``native_config``).
_NATIVE_FIELDS = {"events_topic": "events", "mesh": "mesh_bind", "retention_capacity_blocks": "kv_capacity_blocks"}


class Router:
    """A running router (``config.threads`` serving threads) and, when ``config.discovery`` is
    a source that changes, the task that follows it. Built by :func:`start_router`.

    Attributes:
        url: ``http://host:port`` it listens on (an Endpoint Picker's ``/metrics`` and
            ``/health`` only).
        grpc_address: ``host:port`` of an Endpoint Picker's ext_proc (None for the proxy).
        native: the ``kvroute._native.NativeRouter``.
        max_body_bytes / max_body_source: the body limit and where it came from.
    """

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        discovery = config.discovery or StaticDiscovery(config.workers)  # validates the URLs
        if isinstance(discovery, StaticDiscovery):
            workers, self._discovery = worker_specs(config, discovery.endpoints), None
        else:
            workers, self._discovery = [], discovery
        native = native_config(config, workers)
        try:
            self.native = NativeRouter(native, grpc_port=config.grpc_port)
        except ValueError as exc:
            raise _config_error(exc) from None
        self._follow_task: asyncio.Task | None = None
        self._peers_task: asyncio.Task | None = None
        host = f"[{config.host}]" if ":" in config.host else config.host
        self.url = f"http://{host}:{self.native.port}"
        grpc = self.native.grpc_port
        self.grpc_address: str | None = None if grpc is None else f"{host}:{grpc}"
        self.max_body_bytes: int = self.native.max_body_bytes
        self.max_body_source: str = self.native.max_body_source
        self.max_connections: int = native["max_connections"]

    async def start(self) -> None:
        """Follow the peer discovery (if any), and the worker discovery (if any) until its
        first list is in."""
        if self.config.peer_discovery is not None:
            self._peers_task = asyncio.ensure_future(self._follow_peers(self.config.peer_discovery))
        if self._discovery is None:
            return
        first = asyncio.Event()
        self._follow_task = asyncio.ensure_future(self._follow(first))
        await first.wait()

    async def _follow(self, first: asyncio.Event) -> None:
        try:
            async for endpoints in self._discovery.watch():
                self.native.set_workers(worker_specs(self.config, endpoints))
                first.set()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("worker discovery stopped; keeping the last worker list")
        finally:
            first.set()

    async def _follow_peers(self, discovery: Discovery) -> None:
        """Make every ready endpoint ``discovery`` yields a peer (its ``host:port``), beside
        the configured ``peers``, as the list changes."""
        try:
            async for endpoints in discovery.watch():
                found = {urlsplit(e.url).netloc for e in endpoints if e.ready}
                self.set_peers(sorted(found | set(self.config.peers)))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("peer discovery stopped; keeping the last peer list")

    @property
    def in_flight(self) -> int:
        return self.native.in_flight

    # --- inspection (for tests and tools; /metrics says the same over HTTP) ---------------------

    @property
    def index(self) -> KvIndex:
        """The index the routing step reads (shared with the native router)."""
        return self.native.index

    @property
    def mesh_address(self) -> str | None:
        """``host:port`` of this replica's mesh socket (None without ``config.mesh_bind``)."""
        return self.native.mesh_address

    def set_peers(self, peers: list[str]) -> None:
        """Replace the peer replicas' mesh addresses (``host:port`` each)."""
        self.native.set_peers(list(peers))

    def metrics_text(self) -> str:
        """The text ``GET /metrics`` answers."""
        return self.native.metrics_text()

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value in :meth:`metrics_text` (0 when absent)."""
        return metric_value(self.metrics_text(), name, **labels)

    def worker_statuses(self) -> dict[str, WorkerStatus]:
        """Every worker by name, as the router sees it now."""
        return {
            w["name"]: WorkerStatus(w["name"], w["ready"], w["healthy"], w["available"], w["in_flight"],
                                    w["in_flight_tokens"], w["consecutive_failures"])
            for w in self.native.workers()
        }

    def available_workers(self) -> list[str]:
        """Names of the workers that may take a new request."""
        return [name for name, w in self.worker_statuses().items() if w.available]

    def retention_stats(self) -> dict | None:
        """Retention's counters; None when it is off."""
        return self.native.retention_stats()

    async def drain(self, timeout_s: float | None = None) -> bool:
        """New requests 503 and ``/health`` failing, then wait for those in flight."""
        timeout = self.config.drain_timeout_s if timeout_s is None else timeout_s
        finished = await asyncio.to_thread(self.native.drain, timeout)
        if not finished:
            logger.warning("drain: %d requests still in flight after %gs", self.native.in_flight, timeout)
        return finished

    async def close(self) -> None:
        for task in (self._follow_task, self._peers_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._follow_task = self._peers_task = None
        await asyncio.to_thread(self.native.close)

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class _StartedRouter:
    """``start_router``'s result: ``async with`` it, or ``await`` it and ``close()`` later."""

    def __init__(self, config: RouterConfig) -> None:
        self._router = Router(config)

    def __await__(self):
        return self._start().__await__()

    async def _start(self) -> Router:
        await self._router.start()
        return self._router

    async def __aenter__(self) -> Router:
        return await self._start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self._router.close()


def start_router(config: RouterConfig) -> _StartedRouter:
    """Start a router in the running event loop.

    ``async with start_router(RouterConfig(workers=[...])) as router:`` serves on
    ``router.url`` until the block ends; ``router = await start_router(config)`` serves until
    ``await router.close()``.
    """
    return _StartedRouter(config)
