"""``RouterConfig``: everything ``kvroute serve`` can be told, with its defaults;
:func:`kvroute.router.server.start_router` starts a router from one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute import _native
from kvroute.blocks import DEFAULT_HASH_SEED, GPU_BLOCK_SIZE
from kvroute.kvevents import EventsSettings
from kvroute.router.discovery import Discovery

#: The data plane's own defaults (``kvroute_serve::ServeConfig::default()``): the values below
#: are read from it, so that each is written once; the comments say why it is what it is.
_SERVE: dict[str, Any] = _native.serve_defaults()

#: Predicted entries' lifetime when KV events confirm (or not) what was routed: long enough to
#: cover the first events of a burst, short enough that a wrong guess is soon forgotten.
EVENTS_PREDICTED_TTL_S = 2.0
#: Predicted entries per worker without events: the reference worker's cache (Qwen3-0.6B bf16,
#: 1 GiB, block 16: 585 blocks). Set ``predicted_capacity_blocks`` to your workers'
#: ``num_gpu_blocks``.
DEFAULT_PREDICTED_CAPACITY_BLOCKS: int = _SERVE["predicted_capacity_blocks"]
#: The index's default memory bound: 256 MiB is 2M (worker, block) entries at 128 bytes each,
#: e.g. 32 workers with 65k blocks of KV each (an 80 GB GPU serving an 8B model holds ~40k).
DEFAULT_INDEX_MAX_BYTES: int = _SERVE["index_max_bytes"]
#: Retention's modes (``kvroute_core::retention::RetentionMode::ALL``); the default is
#: :func:`default_retention`'s.
RETENTION_MODES: tuple[str, ...] = tuple(_native.RETENTION_MODES)
#: Bodies larger than this are parsed, tokenized and hashed on a blocking thread, so that a
#: huge prompt never holds a thread that serves other connections.
DEFAULT_OFFLOAD_BYTES: int = _SERVE["offload_bytes"]
#: Request body bytes the router holds at once, across all requests: 16 bodies at the largest
#: default body limit (64 MiB), some 100,000 of the reference workload's 10 KB chat bodies.
DEFAULT_MAX_BUFFERED_BODY_BYTES: int = _SERVE["max_buffered_body_bytes"]
#: Bytes the tokenizer's caches of text pieces may hold together, whatever their entry count.
DEFAULT_PROMPT_CACHE_BYTES: int = _SERVE["prompt_cache_bytes"]
#: Deepest JSON nesting accepted. OpenAI bodies nest a handful of levels (messages, content
#: parts, tool schemas a few more); refusing deeper ones before any recursive code sees them
#: keeps every later step (chat template, content flattening) far from any recursion limit.
MAX_JSON_DEPTH: int = _SERVE["max_json_depth"]
#: A streamed answer's first-byte wait is its response headers, which vLLM sends before the
#: prefill; a non-streamed answer's first byte is the whole answer, so this bounds its whole
#: generation: a 130k-token prefill (~30 s on an H100 for an 8B model, minutes on smaller
#: GPUs) plus 8k tokens decoded at 20 tokens/s is ~450 s.
DEFAULT_FIRST_BYTE_TIMEOUT_S: float = _SERVE["first_byte_timeout_s"]
#: The longest silence of a healthy stream is the wait for its first token: queueing plus
#: prefill. A 130k-token prompt's prefill is dominated by attention over its length: ~30 s on
#: an H100 for an 8B model, ~3 min on an L4-class GPU. 300 s never cuts such a prefill and still
#: ends the streams of a stopped or wedged worker.
DEFAULT_STREAM_IDLE_TIMEOUT_S: float = _SERVE["stream_idle_timeout_s"]
#: Seconds for a request head to arrive (Go servers commonly use 10 s for ReadHeaderTimeout;
#: a head is at most a few KiB).
DEFAULT_HEADER_TIMEOUT_S: float = _SERVE["header_timeout_s"]
#: Seconds for a whole request body to arrive once its head has: 64 MiB at ~1 MiB/s, a 130k
#: token prompt (~0.5 MB) at ~8 KiB/s.
DEFAULT_BODY_TIMEOUT_S: float = _SERVE["body_timeout_s"]
#: Seconds an idle kept-alive client connection stays open. Above the 60 s idle timeout of
#: common load balancers (AWS ALB, GCP), so a balancer never sends on a connection the router
#: is closing; clients that pool connections close theirs sooner (httpx: 5 s).
DEFAULT_KEEPALIVE_TIMEOUT_S: float = _SERVE["keepalive_timeout_s"]
#: Seconds a client may take no byte of its answer while the router has more to write (its
#: socket's buffers full) before its connection is closed: nginx's ``send_timeout``. A client
#: that stops reading would otherwise hold its connection, its worker's and what they buffer.
DEFAULT_SEND_TIMEOUT_S: float = _SERVE["send_timeout_s"]


@dataclass
class RouterConfig:
    """Everything ``kvroute serve`` can be told; the same object drives ``start_router``.

    Attributes:
        workers: worker URLs (``http://host:port``, optionally ending in ``/v1``); used when
            ``discovery`` is None.
        discovery: a discovery source (file, DNS, Kubernetes) instead of ``workers``.
        policy: ``random``, ``round-robin``, ``least-loaded``, ``prefix-hash`` or ``kv-aware``.
        policy_options: keyword options for ``make_policy`` (e.g. ``load_factor``).
        seed: seeds the policy's random choices (None: unseeded).
        host, port: where to listen (port 0: an ephemeral port, see ``Router.url``).
        tokenizer: the engines' tokenizer directory (exact matching); None uses the built-in
            synthetic tokenizer (exact only against emulated workers without a tokenizer).
        block_size: the engines' KV block size (vLLM: 16 on GPU, 128 on CPU).
        hash_seed: root of the router's own block hash chain.
        events: where workers publish KV events (None / empty: predicted mode only).
        predicted_ttl_s: how long a routing decision counts as cached without events to
            confirm it; default :data:`EVENTS_PREDICTED_TTL_S` with events, none without.
        index_max_bytes: the index's memory bound over event-backed entries (least recently
            touched dropped beyond it, counted in ``kvroute_router_index_evicted_blocks``);
            None: unbounded. Default :data:`DEFAULT_INDEX_MAX_BYTES`.
        predicted_capacity_blocks: per-worker bound of predicted entries (LRU); without
            events it models the worker's cache, so set it to the workers' ``num_gpu_blocks``
            (default :data:`DEFAULT_PREDICTED_CAPACITY_BLOCKS`); with events default unbounded
            (the TTL bounds them).
        health_interval_s / health_timeout_s: ``GET /health`` period and limit (0: no checks).
        connect_timeout_s: a worker that does not accept a connection this fast is skipped.
        max_attempts: workers tried per request before giving up (retries before first byte).
        max_body_bytes: larger request bodies get 413, before they are read when they declare
            their length. None: derived from the tokenizer's maximum length when it states one,
            else ``kvroute._native.DEFAULT_MAX_BODY_BYTES`` (see ``kvroute serve --help``).
        max_buffered_body_bytes: request body bytes held in memory at once across all
            requests (from before a body is read until a worker answers it); a body that would
            exceed it gets 503. At least the body limit.
        drain_timeout_s: how long a drain waits for in-flight requests.
        first_byte_timeout_s: how long a worker may take to send its response headers (a
            stream's start; a non-streamed request's whole answer, so set it above the longest
            non-streamed generation); a worker that misses it has the request taken back and
            sent to another one. None: no limit. Default :data:`DEFAULT_FIRST_BYTE_TIMEOUT_S`.
        stream_idle_timeout_s: most seconds between two chunks of a streamed answer (the
            first one included) before the stream is ended with an error event. None: no
            limit. Default :data:`DEFAULT_STREAM_IDLE_TIMEOUT_S`.
        header_timeout_s / keepalive_timeout_s / max_connections: what one client connection
            may hold; ``max_connections`` None:
            :func:`kvroute.router.resources.default_max_connections`.
        send_timeout_s: how long a client may leave its answer unread while the router has
            more to write before its connection is closed (None: no limit). Default
            :data:`DEFAULT_SEND_TIMEOUT_S`.
        body_timeout_s: seconds for a request body to arrive in full (408 beyond).
        max_json_depth: deeper bodies get 400 (:data:`MAX_JSON_DEPTH`).
        offload_bytes: larger bodies are parsed, tokenized and hashed on a worker thread.
        eject_after_failures: consecutive failures that eject a worker (0: never by count).
        eject_base_s: first ejection's length; each further one in a row adds as much.
        api_key: if set, clients must send ``Authorization: Bearer <api_key>``.
        metrics_public: with ``api_key``, leave ``/metrics`` open too (for a scraper
            without the key); ``/health`` is always open.
        forward_authorization: pass the client's ``Authorization`` header to the workers.
        worker_api_key: send ``Authorization: Bearer <worker_api_key>`` to the workers
            (overrides a forwarded one).
        prompt_cache_bytes: memory bound of the tokenizer's caches of text pieces (shared
            prefixes are tokenized once).
        retention: ``off``, ``on`` or ``auto``: refresh the prefixes each worker's LRU would
            evict (the core's retention model, as in ``kvroute sim --retention``). None:
            :func:`default_retention` for ``policy`` (read it with :meth:`retention_mode`).
        kv_capacity_blocks: each worker's usable KV blocks (vLLM's ``num_gpu_blocks`` less the
            null block), for retention's model and kv-aware's admission guard. None: the guard
            reads each worker's own from its ``/metrics`` (``vllm:cache_config_info``), and
            retention assumes ``predicted_capacity_blocks`` (or its default) less the null block.
        max_loras: the workers' LoRA slots (vLLM's ``--max-loras``, default 1 as vLLM's):
            the router models the adapters in each worker's slots as the last this many it
            sent there, for kv-aware's ``adapter_weight`` (idle without adapters).
        threads: the threads serving requests (``kvroute serve`` defaults to one per core).
        grpc_port: serve Envoy's ext_proc on this port as a Gateway API Inference Extension
            Endpoint Picker (``kvroute epp``; 0 picks a free one) instead of proxying; ``port``
            then serves ``/metrics`` and ``/health`` only. None: ``kvroute serve``'s proxy.
        mesh_bind: ``host:port`` where this replica publishes its decisions to its peer
            replicas (port 0: an ephemeral one, see ``Router.mesh_address``); None: no mesh.
        peers: the peer replicas' mesh addresses (``host:port``; a host name resolving to
            several addresses, such as a headless Service's, is that many peers).
        peer_discovery: a source of the peer replicas followed as workers are (the routers'
            EndpointSlices: ``--peer-k8s-service``); each ready endpoint's ``host:port`` is a
            peer, beside ``peers``.
    """

    workers: Sequence[str] = ()
    discovery: Discovery | None = None
    policy: str = "kv-aware"
    policy_options: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    host: str = _SERVE["host"]
    port: int = 0
    tokenizer: str | None = None
    block_size: int = GPU_BLOCK_SIZE
    hash_seed: int = DEFAULT_HASH_SEED
    events: EventsSettings | None = None
    predicted_ttl_s: float | None = None
    predicted_capacity_blocks: int | None = None
    index_max_bytes: int | None = DEFAULT_INDEX_MAX_BYTES
    health_interval_s: float = _SERVE["health_interval_s"]
    health_timeout_s: float = _SERVE["health_timeout_s"]
    connect_timeout_s: float = _SERVE["connect_timeout_s"]
    max_attempts: int = _SERVE["max_attempts"]
    max_body_bytes: int | None = None
    max_buffered_body_bytes: int = DEFAULT_MAX_BUFFERED_BODY_BYTES
    drain_timeout_s: float = 30.0
    first_byte_timeout_s: float | None = DEFAULT_FIRST_BYTE_TIMEOUT_S
    stream_idle_timeout_s: float | None = DEFAULT_STREAM_IDLE_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S
    send_timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S
    max_connections: int | None = None
    max_json_depth: int = MAX_JSON_DEPTH
    offload_bytes: int = DEFAULT_OFFLOAD_BYTES
    eject_after_failures: int = _SERVE["eject_after_failures"]
    eject_base_s: float = _SERVE["eject_base_s"]
    api_key: str | None = None
    metrics_public: bool = False
    forward_authorization: bool = False
    worker_api_key: str | None = None
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES
    retention: str | None = None
    kv_capacity_blocks: int | None = None
    max_loras: int = 1
    threads: int = _SERVE["threads"]
    grpc_port: int | None = None
    mesh_bind: str | None = None
    peers: tuple[str, ...] = ()
    peer_discovery: Discovery | None = None

    def retention_mode(self) -> str:
        """The retention mode the router runs: ``retention``, or the policy's default."""
        return self.retention or default_retention(self.policy)


def default_retention(policy: str) -> str:
    """Retention's mode when none is given: ``auto`` with kv-aware (it refreshes only while the
    refreshes measurably save prefills; docs/results.md, Retention, has the figures), ``off``
    with every other policy, whose placement retention would override for prompts cached
    nowhere."""
    return "auto" if policy == "kv-aware" else "off"


def predicted_settings(config: RouterConfig) -> tuple[float | None, int | None]:
    """The index's predicted-entry TTL and per-worker capacity for ``config``: with KV events,
    predictions only bridge until the events arrive (:data:`EVENTS_PREDICTED_TTL_S`, no
    capacity); without, they model each worker's cache (capacity, no TTL)."""
    if config.events is not None and config.events.enabled:
        ttl = EVENTS_PREDICTED_TTL_S if config.predicted_ttl_s is None else config.predicted_ttl_s
        return ttl, config.predicted_capacity_blocks
    return config.predicted_ttl_s, config.predicted_capacity_blocks or DEFAULT_PREDICTED_CAPACITY_BLOCKS


def retention_capacity(config: RouterConfig) -> int:
    """Each worker's usable KV blocks for retention's model: ``kv_capacity_blocks``, else the
    predicted capacity (or the reference worker's) less the null block."""
    return config.kv_capacity_blocks or (
        (config.predicted_capacity_blocks or DEFAULT_PREDICTED_CAPACITY_BLOCKS) - 1
    )
