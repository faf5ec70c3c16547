"""The live router: an OpenAI-compatible HTTP proxy that picks a worker per request.

Per generation request (``/v1/completions``, ``/v1/chat/completions``):

1. read the body (413 beyond ``max_body_bytes``), parse it (400 when it is not a JSON object or
   has no usable prompt), tokenize and hash the prompt (:mod:`kvroute.proxy.prompts`);
2. ask the policy, with the index's per-worker overlap when the policy wants it, and record the
   choice in the index (predicted entries bridge until the worker's KV events arrive);
3. forward the client's bytes unchanged and relay the answer chunk by chunk, adding the
   ``x-kvroute-worker`` header.

Failure rules: a worker that refuses the connection (or drops it before answering) is taken
out and the request goes to another worker — only before the first response byte, so nothing
is ever sent twice to the client. So does a worker that misses ``first_byte_timeout_s`` (its
connection is closed, which makes vLLM abort the request). A worker that dies after that, or
stays silent longer than ``stream_idle_timeout_s`` mid-stream, ends the client's stream with an
SSE error event (no ``[DONE]``), or a 502 JSON error for a non-streamed request: never a
silently truncated answer. No available worker is a 503. While draining (SIGTERM) new requests
get 503 and ``/health`` fails, in-flight ones finish.

Outlier ejection: ``eject_after_failures`` consecutive failures of one worker (timeouts, dropped
connections, deaths mid-answer) take it out for ``eject_base_s`` times the number of times it
was ejected in a row (capped, see :mod:`kvroute.proxy.pool`); it returns once that time is
over AND a health check passes, so a worker whose ``/health`` answers while its generations
hang does not flap back at every check.

Security: the upstream URL is always a discovered worker's URL plus the matched route's own
path (never the client's path, a header or a body field), redirects are not followed, and only
a fixed list of request headers is forwarded, values with CR, LF or NUL dropped. With
``api_key`` every route but ``/health`` (and ``/metrics`` when ``metrics_public``) needs
``Authorization: Bearer <key>``, compared in constant time. The client's ``Authorization`` goes
to the workers only with ``forward_authorization``; ``worker_api_key`` sends a key of the
router's own instead (vLLM started with ``--api-key``).

Routing is one native step (:class:`kvroute.routing.RoutingStep`, the simulator's too): index
look-up, policy, prediction and load accounting. ``in_flight`` counts requests from routing
until their response ends; ``in_flight_tokens`` counts their prompt tokens still to prefill
after the overlap the index credits the worker with, until the first response byte.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import hmac
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvroute.aio import WaitTimeout
from kvroute.blocks import DEFAULT_HASH_SEED, GPU_BLOCK_SIZE, BlockHasher
from kvroute.errors import UNDECODABLE, UserError
from kvroute.proxy.discovery import Discovery, StaticDiscovery
from kvroute.proxy.edge import ConnectionLimits, GuardedRunner, default_max_connections
from kvroute.proxy.metrics import RouterMetrics
from kvroute.proxy.pool import EventsSettings, Worker, WorkerPool
from kvroute.proxy.prompts import (
    DEFAULT_PROMPT_CACHE_BYTES,
    BadRequest,
    PromptHasher,
    PromptInfo,
    max_text_bytes,
    parse_large_ids,
)
from kvroute.proxy.retention import LiveRetention
from kvroute.proxy.status import WorkerStatus, metric_value
from kvroute.routing import RoutingStep
from kvroute.routing.index import KvIndex
from kvroute.routing.policies import make_policy, policy_parameters
from kvroute.tokens import load_tokenizer

if TYPE_CHECKING:
    from kvroute.proxy.native import NativeRouterRunner

logger = logging.getLogger(__name__)

#: Response header naming the worker that served the request.
WORKER_HEADER = "x-kvroute-worker"

_JSON = "application/json"
#: Request headers passed on to workers (everything else is hop-by-hop or the router's own);
#: ``Authorization`` only with ``RouterConfig.forward_authorization``.
_FORWARDED_HEADERS = ("Content-Type", "X-Request-Id", "traceparent", "tracestate")
#: Routes open without the API key: load balancers and kubelets probe /health unauthenticated.
_OPEN_ROUTES = frozenset({"/health"})
#: Before the first response byte these mean "the worker never took the request": retry.
_NOT_ANSWERED = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    asyncio.TimeoutError,
)
#: After the first byte these mean the worker (or its connection) died mid-answer.
_DIED = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)
#: Predicted entries' lifetime when KV events confirm (or not) what was routed: long enough to
#: cover the first events of a burst, short enough that a wrong guess is soon forgotten.
EVENTS_PREDICTED_TTL_S = 2.0
#: Predicted entries per worker without events: the reference worker's cache (Qwen3-0.6B bf16,
#: 1 GiB, block 16: 585 blocks). Set ``predicted_capacity_blocks`` to your workers'
#: ``num_gpu_blocks``.
DEFAULT_PREDICTED_CAPACITY_BLOCKS = 585
#: The index's default memory bound: 256 MiB is 2M (worker, block) entries at 128 bytes each,
#: e.g. 32 workers with 65k blocks of KV each (an 80 GB GPU serving an 8B model holds ~40k).
DEFAULT_INDEX_MAX_BYTES = 256 * 2**20
#: Allocations between young-generation collections while serving (CPython's default: 700).
#: Every request allocates many container objects that die young (parsed body, request and
#: response objects, decoded KV events), so the default collects all the time: 8% of the
#: router's CPU in a profile of ``benchmarks/peers.py --mode overhead``. Little here makes
#: reference cycles, so collecting seventy times less often costs little memory.
GC_YOUNG_THRESHOLD = 50_000
#: Request bodies without a tokenizer maximum length to derive a limit from (``--max-body-bytes``).
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
#: Bytes of request body outside the prompt a derived body limit allows: sampling
#: parameters, message wrappers, tool definitions.
BODY_ENVELOPE_BYTES = 1024 * 1024
#: Deepest JSON nesting accepted. OpenAI bodies nest a handful of levels (messages, content
#: parts, tool schemas a few more); refusing deeper ones before any recursive code sees them
#: keeps every later step (chat template, content flattening) far from Python's recursion limit.
MAX_JSON_DEPTH = 64
#: Bodies larger than this are parsed, tokenized and hashed on a thread of their own, off the
#: event loop (the Hugging Face tokenizer releases the GIL while it encodes).
DEFAULT_OFFLOAD_BYTES = 256 * 1024
#: A streamed answer's first-byte wait is its response headers, which vLLM sends before the
#: prefill; a non-streamed answer's first byte is the whole answer, so this bounds its whole
#: generation: a 130k-token prefill (~30 s on an H100 for an 8B model, minutes on smaller
#: GPUs) plus 8k tokens decoded at 20 tokens/s is ~450 s.
DEFAULT_FIRST_BYTE_TIMEOUT_S = 600.0
#: The longest silence of a healthy stream is the wait for its first token: queueing plus
#: prefill. A 130k-token prompt's prefill is dominated by attention over its length: ~30 s on
#: an H100 for an 8B model, ~3 min on an L4-class GPU. 300 s never cuts such a prefill and still
#: ends the streams of a stopped or wedged worker.
DEFAULT_STREAM_IDLE_TIMEOUT_S = 300.0
#: Seconds for a request head to arrive (Go servers commonly use 10 s for ReadHeaderTimeout;
#: a head is at most a few KiB).
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: Seconds for a whole request body to arrive once its head has: 64 MiB at ~1 MiB/s, a 130k
#: token prompt (~0.5 MB) at ~8 KiB/s.
DEFAULT_BODY_TIMEOUT_S = 60.0
#: Seconds an idle kept-alive client connection stays open. Above the 60 s idle timeout of
#: common load balancers (AWS ALB, GCP), so a balancer never sends on a connection the router
#: is closing; clients that pool connections close theirs sooner (httpx: 5 s).
DEFAULT_KEEPALIVE_TIMEOUT_S = 75.0
#: Pending connections the listening socket queues (see ``Router.start``).
LISTEN_BACKLOG = 4096
_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode


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
            their length. None: derived from the tokenizer's maximum length when it has one
            (:func:`derived_max_body_bytes`), else :data:`DEFAULT_MAX_BODY_BYTES`.
        drain_timeout_s: how long a drain waits for in-flight requests.
        first_byte_timeout_s: how long a worker may take to send its response headers (a
            stream's start; a non-streamed request's whole answer, so set it above the longest
            non-streamed generation); a worker that misses it has the request taken back and
            sent to another one. None: no limit. Default :data:`DEFAULT_FIRST_BYTE_TIMEOUT_S`.
        stream_idle_timeout_s: most seconds between two chunks of a streamed answer (the
            first one included) before the stream is ended with an error event. None: no
            limit. Default :data:`DEFAULT_STREAM_IDLE_TIMEOUT_S`.
        header_timeout_s / keepalive_timeout_s / max_connections: what one client connection
            may hold (:class:`kvroute.proxy.edge.ConnectionLimits`); ``max_connections`` None:
            :func:`kvroute.proxy.edge.default_max_connections`.
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
        prompt_cache_bytes: memory bound of the tokenization caches together (see
            :class:`kvroute.proxy.prompts.PromptHasher`).
        retention: ``off``, ``on`` or ``auto``: refresh the prefixes each worker's LRU would
            evict (:mod:`kvroute.proxy.retention`).
        retention_capacity_blocks: each worker's usable KV blocks for the retention's model;
            None: ``predicted_capacity_blocks`` (or its default) less the null block.
        data_plane: ``aiohttp`` (this module's router) or ``native`` (:mod:`kvroute.proxy.native`)
            for :func:`start_router`; None: :data:`DEFAULT_DATA_PLANE`.
        threads: the native data plane's serving threads.
    """

    workers: Sequence[str] = ()
    discovery: Discovery | None = None
    policy: str = "kv-aware"
    policy_options: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    host: str = "127.0.0.1"
    port: int = 0
    tokenizer: str | None = None
    block_size: int = GPU_BLOCK_SIZE
    hash_seed: int = DEFAULT_HASH_SEED
    events: EventsSettings | None = None
    predicted_ttl_s: float | None = None
    predicted_capacity_blocks: int | None = None
    index_max_bytes: int | None = DEFAULT_INDEX_MAX_BYTES
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    connect_timeout_s: float = 2.0
    max_attempts: int = 3
    max_body_bytes: int | None = None
    drain_timeout_s: float = 30.0
    first_byte_timeout_s: float | None = DEFAULT_FIRST_BYTE_TIMEOUT_S
    stream_idle_timeout_s: float | None = DEFAULT_STREAM_IDLE_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S
    max_connections: int | None = None
    max_json_depth: int = MAX_JSON_DEPTH
    offload_bytes: int = DEFAULT_OFFLOAD_BYTES
    eject_after_failures: int = 3
    eject_base_s: float = 5.0
    api_key: str | None = None
    metrics_public: bool = False
    forward_authorization: bool = False
    worker_api_key: str | None = None
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES
    retention: str = "off"
    retention_capacity_blocks: int | None = None
    data_plane: str | None = None
    threads: int = 1


def predicted_settings(config: RouterConfig) -> tuple[float | None, int | None]:
    """The index's predicted-entry TTL and per-worker capacity for ``config``: with KV events,
    predictions only bridge until the events arrive (:data:`EVENTS_PREDICTED_TTL_S`, no
    capacity); without, they model each worker's cache (capacity, no TTL)."""
    if config.events is not None and config.events.enabled:
        ttl = EVENTS_PREDICTED_TTL_S if config.predicted_ttl_s is None else config.predicted_ttl_s
        return ttl, config.predicted_capacity_blocks
    return config.predicted_ttl_s, config.predicted_capacity_blocks or DEFAULT_PREDICTED_CAPACITY_BLOCKS


def body_limit(config: RouterConfig, max_length: int | None, longest: int | None) -> tuple[int, str]:
    """The request body limit and where it came from: ``--max-body-bytes``, else derived from
    the tokenizer's maximum length and longest token (:func:`derived_max_body_bytes`), else
    :data:`DEFAULT_MAX_BODY_BYTES`."""
    if config.max_body_bytes is not None:
        return config.max_body_bytes, "--max-body-bytes"
    if max_length and longest:
        return (derived_max_body_bytes(max_length, longest),
                f"derived: {max_length} tokens x max(3 x {longest}, 12) bytes + 1 MiB")
    return DEFAULT_MAX_BODY_BYTES, "default: the tokenizer states no maximum length"


def retention_capacity(config: RouterConfig) -> int:
    """Each worker's usable KV blocks for retention's model: ``retention_capacity_blocks``, else
    the predicted capacity (or the reference worker's) less the null block."""
    return config.retention_capacity_blocks or (
        (config.predicted_capacity_blocks or DEFAULT_PREDICTED_CAPACITY_BLOCKS) - 1
    )


def tokenizer_max_length(directory: str | None) -> int | None:
    """The ``model_max_length`` of a Hugging Face tokenizer directory, when it states a real
    one (``transformers`` writes a 1e30 sentinel when it does not know); None otherwise."""
    if directory is None:
        return None
    try:
        config = json.loads((Path(directory) / "tokenizer_config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("model_max_length") if isinstance(config, dict) else None
    if isinstance(value, (int, float)) and 0 < value < 10**8:
        return int(value)
    return None


def derived_max_body_bytes(max_length: int, longest_token_bytes: int) -> int:
    """The largest body a prompt of ``max_length`` tokens can need, plus an envelope.

    One token takes at most its longest vocabulary entry's bytes as text, three times that
    when a client escapes non-ASCII text as ``\\uXXXX`` (a 2-byte character becomes 6 bytes,
    a 4-byte one 12), or 12 bytes as a token id (ten digits, a comma, a space):

        limit = max_length * max(3 * longest_token_bytes, 12) + BODY_ENVELOPE_BYTES

    capped at :data:`DEFAULT_MAX_BODY_BYTES`. A batch of prompts counts as their sum (raise
    ``--max-body-bytes`` for large batches)."""
    per_token = max(3 * longest_token_bytes, 12)
    return min(max_length * per_token + BODY_ENVELOPE_BYTES, DEFAULT_MAX_BODY_BYTES)


def _longest_token_bytes(tokenizer: Any) -> int | None:
    inner = getattr(tokenizer, "_tokenizer", None)
    if inner is None or not hasattr(inner, "get_vocab"):
        return None
    vocab = inner.get_vocab(with_added_tokens=True)
    return max((len(token.encode("utf-8")) for token in vocab), default=None)


_TOO_DEEP = object()


def _too_deep(value: Any, limit: int) -> bool:
    """True when ``value`` nests lists and objects deeper than ``limit`` (iterative: no
    recursion, whatever the depth)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, (list, dict)) and child:
                stack.append((child, depth + 1))
            elif isinstance(child, (list, dict)) and depth + 1 > limit:
                return True
    return False


class _QuietClientErrors(logging.Filter):
    """Drops aiohttp's ERROR-with-traceback for each malformed request it answers with a 4xx
    (bad request line, header or chunk framing): those are the client's mistakes, and logging
    each one would let any client flood the router's log. Handler failures still log."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500)


_QUIET_CLIENT_ERRORS = _QuietClientErrors()


def tune_gc_for_serving() -> None:
    """Collect young objects less often (:data:`GC_YOUNG_THRESHOLD`) and move everything alive
    at start-up (modules, tokenizer, config) out of the collector's sight, so that the rarer
    full collections do not walk it again. Process-wide, so only ``kvroute serve`` calls it,
    once its router has started; a router embedded in tests or ``kvroute experiment`` leaves
    its host process's collector alone."""
    young, *older = gc.get_threshold()
    if young >= GC_YOUNG_THRESHOLD:
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *older)


def _error(status: int, message: str, err_type: str, param: str | None = None, **headers: str) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.Response(status=status, body=_encode_json(body), content_type=_JSON, headers=headers)


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "UpstreamError", "param": None, "code": 502}}
    return b"data: " + _encode_json(body) + b"\n\n"


class Router:
    """The proxy: HTTP routes, the worker pool, the index and the policy.

    Build it with :func:`start_router`; attributes worth reading:

    Attributes:
        url: ``http://host:port`` once started.
        index: the ``KvIndex``.
        pool: the ``WorkerPool`` (``pool.workers`` by name, each with its ``state``).
        metrics: the ``RouterMetrics``.
        policy: the policy object.
        routing: the ``RoutingStep`` (index look-up, policy, prediction, load accounting).
        hasher: the ``PromptHasher``.
    """

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        if config.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        for name in ("first_byte_timeout_s", "stream_idle_timeout_s"):
            value = getattr(config, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive (or None for no limit), got {value}")
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not getattr(config, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(config, name)}")
        if config.max_connections is not None and config.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {config.max_connections}")
        if config.max_body_bytes is not None and config.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {config.max_body_bytes}")
        if config.max_json_depth < 2:
            raise ValueError(f"max_json_depth must be at least 2, got {config.max_json_depth}")
        if config.eject_after_failures < 0 or config.eject_base_s < 0:
            raise ValueError("eject_after_failures and eject_base_s must be >= 0")
        if config.api_key is not None and not config.api_key:
            raise ValueError("api_key must not be empty")
        # Bytes, so compare_digest accepts any client string (a str needs ASCII on both sides).
        self._api_key = config.api_key.encode() if config.api_key else None
        self._upstream_headers: dict[str, str] = {}
        if config.worker_api_key:
            self._upstream_headers["Authorization"] = f"Bearer {config.worker_api_key}"
        forwarded = _FORWARDED_HEADERS
        if config.forward_authorization and not config.worker_api_key:
            forwarded = ("Authorization", *forwarded)
        self._forwarded = forwarded
        events = config.events or EventsSettings()
        block_hasher = BlockHasher(config.block_size, config.hash_seed)
        ttl, capacity = predicted_settings(config)
        self.index = KvIndex(block_hasher, predicted_ttl=ttl, predicted_capacity_blocks=capacity,
                             max_bytes=config.index_max_bytes)
        options = dict(config.policy_options)
        if "block_size" in policy_parameters(config.policy):
            options.setdefault("block_size", config.block_size)
        self.policy = make_policy(config.policy, rng=random.Random(config.seed), **options)
        self.routing = RoutingStep(self.policy, self.index, config.block_size)
        #: The clock routing decisions are stamped with (a replay substitutes its own).
        self.clock = time.monotonic
        tokenizer = load_tokenizer(config.tokenizer)
        max_length = tokenizer_max_length(config.tokenizer)
        longest = _longest_token_bytes(tokenizer) if max_length else None
        #: Longer prompt texts are routed untokenized (the engine refuses them anyway).
        self.max_text_bytes = max_text_bytes(max_length, longest)
        self.max_prompt_tokens = max_length
        self.hasher = PromptHasher(
            tokenizer, block_hasher, cache_bytes=config.prompt_cache_bytes, max_text_bytes=self.max_text_bytes,
            max_prompt_tokens=max_length,
        )
        #: The offload thread's own hasher (its caches are not shared across threads); small
        #: caches, since what it sees is large and rarely repeats.
        self._offload_hasher: PromptHasher | None = None
        self._offload_parts = (tokenizer, block_hasher)
        self._offload: concurrent.futures.ThreadPoolExecutor | None = None
        #: Bodies over ``offload_bytes`` in memory at once (the others wait before reading).
        self._large_bodies = asyncio.Semaphore(2)
        #: The body limit, and where it came from (``kvroute serve`` prints it).
        self.max_body_bytes, self.max_body_source = body_limit(config, max_length, longest)
        self.metrics = RouterMetrics()
        #: Retention (None when off): refreshes sent beside the routed requests.
        self.retention: LiveRetention | None = None
        if config.retention != "off":
            self.retention = LiveRetention(
                config.retention, config.block_size, retention_capacity(config), self.routing,
                self.metrics.registry,
            )
        logging.getLogger("aiohttp.server").addFilter(_QUIET_CLIENT_ERRORS)  # idempotent
        self._events = events
        self._rng = random.Random(config.seed)
        self.url = ""
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.pool: WorkerPool | None = None
        self.app = web.Application(
            client_max_size=self.max_body_bytes, middlewares=[self._errors, self._auth]
        )
        expect = {"expect_handler": self._expect}
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions, **expect),
                web.post("/v1/chat/completions", self.chat_completions, **expect),
                web.get("/v1/models", self.models, **expect),
                web.get("/health", self.health, **expect),
                web.get("/metrics", self.metrics_route, **expect),
            ]
        )

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the workers' discovery, then listen.

        Raises:
            UserError: bad worker URLs, or the address cannot be bound.
        """
        config = self.config
        discovery = config.discovery or StaticDiscovery(config.workers)
        connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s),
            trace_configs=[self.retention.trace_config] if self.retention is not None else None,
        )
        self.pool = WorkerPool(
            self.index,
            self.metrics,
            self._session,
            self._events,
            self.policy.name,
            config.health_interval_s,
            config.health_timeout_s,
            eject_after_failures=config.eject_after_failures,
            eject_base_s=config.eject_base_s,
            routing=self.routing,
        )
        self.pool.start(discovery)
        if self.retention is not None:
            self.retention.session = self._session
            self.retention.headers = self._upstream_headers
        # Serve only once the first worker list is in: a request before it would get a 503
        # although workers exist.
        await self.pool.first_update.wait()
        limits = ConnectionLimits(
            header_timeout_s=config.header_timeout_s,
            keepalive_timeout_s=config.keepalive_timeout_s,
            max_connections=config.max_connections or default_max_connections(),
        )
        self.connection_limits = limits
        # auto_decompress=False: a compressed body is refused (415), never expanded.
        # lingering_time=0: a body left unread (413, 415, 408) closes the connection after the
        # answer instead of being read and dropped for up to 10 s.
        self._runner = GuardedRunner(
            self.app, limits=limits, metrics=self.metrics, handler_cancellation=True,
            access_log=None, shutdown_timeout=1.0, auto_decompress=False, lingering_time=0,
        )
        await self._runner.setup()
        try:
            # A backlog for bursts of connects (aiohttp's 128 overflows when hundreds arrive at
            # once, and a dropped SYN costs its client a 1 s retransmit); the kernel caps it at
            # net.core.somaxconn.
            site = web.TCPSite(self._runner, config.host, config.port, backlog=LISTEN_BACKLOG)
            await site.start()
        except OSError as exc:
            await self.close()
            raise UserError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
        host, port = self._runner.addresses[0][:2]
        host = f"[{host}]" if ":" in host else host
        self.url = f"http://{host}:{port}"

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Stop taking new requests (503, and ``/health`` fails so balancers stop sending),
        then wait for in-flight ones to finish. True if they all finished in time."""
        self.draining = True
        timeout = self.config.drain_timeout_s if timeout_s is None else timeout_s
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            logger.warning("drain: %d requests still in flight after %gs", self._in_flight, timeout)
            return False
        return True

    async def close(self) -> None:
        """Stop listening (aborting in-flight requests), stop the pool and its event consumer."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.retention is not None:
            await self.retention.close()
        if self.pool is not None:
            await self.pool.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._offload is not None:
            self._offload.shutdown(wait=False, cancel_futures=True)
            self._offload = None

    @property
    def in_flight(self) -> int:
        """Requests being served now."""
        return self._in_flight

    # --- routes -------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable]) -> web.StreamResponse:
        """Client mistakes the framework detects, answered as OpenAI error objects."""
        try:
            response = await handler(request)
        except web.HTTPRequestEntityTooLarge:
            response = self._too_large()
        except web.HTTPException as exc:
            if exc.status >= 500:
                raise
            response = _error(exc.status, exc.reason, "NotFoundError" if exc.status == 404 else "BadRequestError")
        # Label by route, never by the raw path: clients must not be able to mint label values.
        resource = request.match_info.route.resource
        if resource is not None and resource.canonical.startswith("/v1/"):
            self.metrics.count_request(resource.canonical, response.status)
        return response

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect`` header, answered before the body is sent (it runs before middlewares).

        Replaces aiohttp's default, which echoes the header into its 417 text and fails with
        a 500 when the value is not UTF-8-encodable. A client that is not authorized learns so
        before uploading its body."""
        if request.headers.get("Expect", "").lower() != "100-continue":
            return _error(417, "only 'Expect: 100-continue' is supported", "BadRequestError")
        if self._api_key is not None and not self._authorized(request):
            return _error(401, "missing or wrong API key (Authorization: Bearer <key>)",
                          "AuthenticationError", **{"WWW-Authenticate": "Bearer"})
        if request.version >= (1, 1):
            # A coroutine: without the await the 100 never leaves, and a client such as curl
            # (which sends this header for bodies over 1 KiB) stalls a second before sending.
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def _authorized(self, request: web.Request) -> bool:
        """True when the route is open or the bearer token is the API key."""
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else ""
        if route in _OPEN_ROUTES or (route == "/metrics" and self.config.metrics_public):
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        # compare_digest runs in time independent of where the values differ; the scheme
        # check leaks only whether "Bearer" was sent.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("utf-8", "surrogateescape"), self._api_key
        )

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable]) -> web.StreamResponse:
        """With ``api_key``: 401 unless ``Authorization: Bearer <key>`` (constant-time compare,
        so response times reveal nothing about the key)."""
        if self._api_key is None or self._authorized(request):
            return await handler(request)
        return _error(401, "missing or wrong API key (Authorization: Bearer <key>)", "AuthenticationError",
                      **{"WWW-Authenticate": "Bearer"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, self.hasher.completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, self.hasher.chat)

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return _error(503, "draining", "ServiceUnavailable")
        if not self.pool.available():
            return _error(503, "no worker available", "ServiceUnavailable")
        return web.Response(status=200)

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics_text(), headers={"Content-Type": self.metrics.content_type})

    # --- inspection (the same on the native data plane: kvroute.proxy.native) -----------------

    def metrics_text(self) -> str:
        """The text ``GET /metrics`` answers (the event consumer's and the caches' figures
        brought up to date first)."""
        self.pool.sync_event_metrics()
        stats = self.index.stats()
        self.metrics.index_blocks.set(stats.blocks)
        self.metrics.index_predicted.set(stats.predicted)
        self.metrics.index_workers.set(stats.workers)
        self.metrics.index_evicted.set(stats.evicted_blocks)
        nbytes, evictions = self.hasher.cache_stats()
        untokenized = self.hasher.untokenized
        if self._offload_hasher is not None:
            more_bytes, more_evictions = self._offload_hasher.cache_stats()
            nbytes, evictions = nbytes + more_bytes, evictions + more_evictions
            untokenized += self._offload_hasher.untokenized
        self.metrics.untokenized_prompts.set(untokenized)
        self.metrics.prompt_cache_bytes.set(nbytes)
        self.metrics.prompt_cache_evictions.set(evictions)
        return self.metrics.render().decode()

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value in :meth:`metrics_text` (0 when absent)."""
        return metric_value(self.metrics_text(), name, **labels)

    def worker_statuses(self) -> dict[str, WorkerStatus]:
        """Every worker of the pool by name, as the router sees it now."""
        return {
            w.name: WorkerStatus(
                w.name, w.endpoint.ready, w.healthy, w.available,
                w.state.in_flight, w.state.in_flight_tokens, w.consecutive_failures,
            )
            for w in self.pool.workers.values()
        }

    def available_workers(self) -> list[str]:
        """Names of the workers that may take a new request, in the pool's order."""
        return [w.name for w in self.pool.available()]

    def retention_stats(self) -> dict | None:
        """Retention's counters (``kvroute._native.Retention.stats``); None when it is off."""
        return None if self.retention is None else self.retention.stats()

    async def models(self, request: web.Request) -> web.StreamResponse:
        """``/v1/models`` of any available worker (they serve the same model)."""
        candidates = self.pool.available()
        if not candidates:
            return _error(503, "no worker available", "ServiceUnavailable")
        order = self._rng.sample(candidates, len(candidates))[: self.config.max_attempts]
        problem = ""
        for worker in order:
            try:
                async with self._session.get(
                    worker.url + "/v1/models", headers=self._headers(request), allow_redirects=False
                ) as upstream:
                    body = await upstream.read()
                    return web.Response(
                        status=upstream.status,
                        body=body,
                        headers={"Content-Type": upstream.headers.get("Content-Type", _JSON), WORKER_HEADER: worker.name},
                    )
            except (TimeoutError, aiohttp.ClientError) as exc:
                problem = str(exc) or type(exc).__name__
                self.metrics.upstream_errors.labels(worker.name, "connect").inc()
                self.pool.mark_failed(worker, problem)
        return _error(502, f"no worker answered: {problem}", "UpstreamError")

    # --- generation ---------------------------------------------------------------------------

    def _headers(self, request: web.Request) -> dict[str, str]:
        """The request headers a worker gets: the forwarded ones the client sent, minus any
        value that could split a header line (aiohttp's parser already refuses bare CR/LF,
        but an obs-fold or NUL must not reach the client session, which raises on them)."""
        headers = request.headers
        out = {
            h: v for h in self._forwarded
            if (v := headers.get(h)) is not None and "\r" not in v and "\n" not in v and "\x00" not in v
        }
        out.update(self._upstream_headers)
        return out

    def _choose(
        self, prompt: PromptInfo, candidates: Sequence[Worker], raw: bytes | None = None
    ) -> tuple[Worker, int]:
        """Run the routing step among ``candidates``; count the choice in the metrics; with
        the body ``raw`` of a completion, tell the retention (if on) what went where.

        Returns the worker and the prompt tokens it still has to prefill (after the overlap
        the index credits it with), already in its load until :class:`_Load` counts them out.
        """
        hashes = prompt.block_hashes
        pool = self.pool
        slots = pool.available_slots() if candidates is pool.available() else [w.slot for w in candidates]
        retained = self.retention.read(raw) if raw is not None and self.retention is not None else None
        now = self.clock()
        room = None if retained is None else self.retention.room_for(slots, hashes, now)
        if room is None:
            slot, overlap, prefill = self.routing.route(hashes, prompt.num_tokens, now, slots)
        else:
            slot, overlap, prefill = self.routing.route_to(room, hashes, prompt.num_tokens, now)
        chosen = candidates[slots.index(slot)]
        chosen.decisions.inc()
        self.metrics.overlap_blocks.observe(overlap)
        self.metrics.prompt_blocks.observe(len(hashes))
        if retained is not None:
            self.retention.routed(chosen, retained, hashes, overlap, self.clock())
        return chosen, prefill

    async def _generate(self, request: web.Request, parse: Callable[[dict], PromptInfo]) -> web.StreamResponse:
        started = time.perf_counter()
        if self.draining:
            return _error(503, "the router is shutting down", "ServiceUnavailable")
        # Counted in flight from here: a drain that begins while the body is still arriving
        # waits for this request instead of closing under it.
        self._in_flight += 1
        self._idle.clear()
        try:
            return await self._route(request, parse, started)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def _too_large(self) -> web.Response:
        """413, and the connection closed: the rest of the body is not read."""
        self.metrics.rejected_requests.labels("body_too_large").inc()
        response = _error(413, f"request body larger than {self.max_body_bytes} bytes", "BadRequestError")
        response.force_close()
        return response

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        """The body, or the answer refusing it: 415 when compressed (never expanded), 413
        over the limit (before reading when its length is declared), 408 when it does not
        arrive within ``body_timeout_s``."""
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            self.metrics.rejected_requests.labels("content_encoding").inc()
            response = _error(
                415, "request bodies must not be compressed (Content-Encoding: identity)",
                "BadRequestError", **{"Accept-Encoding": "identity"},
            )
            response.force_close()
            return response
        length = request.content_length
        if length is not None and length > self.max_body_bytes:
            return self._too_large()
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                return await request.read()
        except TimeoutError:
            self.metrics.client_timeouts.labels("body").inc()
            response = _error(
                408, f"request body not received within {self.config.body_timeout_s:g}s", "RequestTimeout"
            )
            response.force_close()
            return response

    def _parse(
        self, raw: bytes, parse: Callable[[dict], PromptInfo], ids_fast_path: bool = False
    ) -> PromptInfo | web.Response:
        """Body bytes to the prompt's blocks, or the 400 refusing them (any input: never
        an exception). ``ids_fast_path``: a completion body on the offload thread, whose ids
        may be parsed without a Python int each (:func:`kvroute.proxy.prompts.parse_large_ids`)."""
        try:
            body = parse_large_ids(raw) if ids_fast_path else None
            if body is None:
                body = _decode_json(raw)
        except UNDECODABLE as exc:
            return _error(400, f"JSON decode error: {exc}", "BadRequestError")
        except RecursionError:
            body = _TOO_DEEP  # deeper than the decoder's own stack allows: too deep by far
        limit = self.config.max_json_depth
        # Counting brackets is cheap for a small body, which needs the walk only with that
        # many; a large one (on the offload thread) is walked, which visits only containers'
        # elements and lets the event loop run meanwhile.
        small = len(raw) <= self.config.offload_bytes
        if body is _TOO_DEEP or (
            isinstance(body, (dict, list))
            and (not small or raw.count(b"[") + raw.count(b"{") > limit)
            and _too_deep(body, limit)
        ):
            self.metrics.rejected_requests.labels("json_too_deep").inc()
            return _error(400, f"JSON nested deeper than {limit} levels", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "BadRequestError")
        try:
            return parse(body)
        except BadRequest as exc:
            return _error(400, str(exc), "BadRequestError", exc.param)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as exc:
            # Input the prompt code could not take: the client's, answered as such.
            logger.debug("unparseable prompt: %r", exc)
            return _error(400, f"cannot read the prompt: {type(exc).__name__}", "BadRequestError")

    def _parse_offloaded(self, raw: bytes, route: str) -> PromptInfo | web.Response:
        """:meth:`_parse` on the offload thread, with that thread's own hasher."""
        if self._offload_hasher is None:
            tokenizer, block_hasher = self._offload_parts
            self._offload_hasher = PromptHasher(
                tokenizer, block_hasher, cache_bytes=min(self.config.prompt_cache_bytes, 8 << 20),
                max_text_bytes=self.max_text_bytes, max_prompt_tokens=self.max_prompt_tokens,
            )
        hasher = self._offload_hasher
        if route == "chat":
            return self._parse(raw, hasher.chat)
        return self._parse(raw, hasher.completion, ids_fast_path=True)

    async def _route(
        self, request: web.Request, parse: Callable[[dict], PromptInfo], started: float
    ) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > self.max_body_bytes:
            return self._too_large()  # whatever it claims to be: nothing of it is read
        if request.content_type != _JSON:
            return _error(400, "Content-Type must be application/json", "BadRequestError")
        if length is not None and self.config.offload_bytes < length <= self.max_body_bytes:
            # A large body: at most two in memory at once, parsed off the event loop.
            async with self._large_bodies:
                raw = await self._read_body(request)
                if isinstance(raw, web.Response):
                    return raw
                prompt = await self._parse_large(raw, parse)
        else:
            raw = await self._read_body(request)
            if isinstance(raw, web.Response):
                return raw
            if len(raw) > self.config.offload_bytes:
                prompt = await self._parse_large(raw, parse)
            else:
                prompt = self._parse(raw, parse)
        if isinstance(prompt, web.Response):
            return prompt
        candidates = self.pool.available()
        if not candidates:
            return _error(503, "no worker available", "ServiceUnavailable")
        completion = parse == self.hasher.completion
        worker, prefill = self._choose(prompt, candidates, raw if completion else None)
        self.metrics.routing_seconds.observe(time.perf_counter() - started)
        if self.retention is not None:
            await self.retention.ahead(worker)
        return await self._forward(request, raw, prompt, worker, prefill)

    async def _parse_large(self, raw: bytes, parse: Callable[[dict], PromptInfo]) -> PromptInfo | web.Response:
        if self._offload is None:
            # One thread: large requests queue behind each other instead of competing for
            # the GIL with the event loop two at a time.
            self._offload = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvroute-parse")
        self.metrics.offloaded_requests.inc()
        route = "chat" if parse == self.hasher.chat else "completion"
        return await asyncio.get_running_loop().run_in_executor(self._offload, self._parse_offloaded, raw, route)

    async def _forward(
        self, request: web.Request, raw: bytes, prompt: PromptInfo, worker: Worker, prefill: int
    ) -> web.StreamResponse:
        """Send to ``worker`` (``prefill``: its prompt tokens to compute), moving to another one while none has answered yet."""
        tried: set[str] = set()
        headers = self._headers(request)
        # The matched route's own path, never the client's spelling of it: what reaches a
        # worker is fixed by the router (a worker URL from discovery plus one of its routes).
        path = request.match_info.route.resource.canonical
        first_byte = self.config.first_byte_timeout_s
        pool = self.pool
        while True:
            load = _Load(self.routing, worker, prefill)
            try:
                try:
                    async with asyncio.timeout(first_byte):
                        upstream = await self._session.post(
                            worker.url + path, data=raw, headers=headers, allow_redirects=False
                        )
                except _NOT_ANSWERED as exc:
                    if isinstance(exc, asyncio.TimeoutError) and not isinstance(exc, aiohttp.ClientError):
                        # Ours, not a connect timeout: the worker took the request and sat on it.
                        problem = f"no response within {first_byte:g}s"
                        self.metrics.upstream_errors.labels(worker.name, "first_byte_timeout").inc()
                        pool.record_failure(worker, problem)
                    else:
                        problem = str(exc) or type(exc).__name__
                        self.metrics.upstream_errors.labels(worker.name, "connect").inc()
                        # Refused, or no connection in time: the worker is gone. A dropped
                        # connection may be a benign keep-alive race (or a worker that just
                        # died: its next connection is refused): only a retry.
                        if isinstance(exc, (aiohttp.ClientConnectorError, asyncio.TimeoutError)):
                            pool.mark_failed(worker, problem)
                    tried.add(worker.name)
                    remaining = [w for w in pool.available() if w.name not in tried]
                    if not remaining or len(tried) >= self.config.max_attempts:
                        return _error(
                            502, f"no worker accepted the request (last: {worker.name}: {problem})",
                            "UpstreamError",
                        )
                    self.metrics.retries.inc()
                    worker, prefill = self._choose(prompt, remaining)
                    continue
                try:
                    # Headers are in: from here on nothing is retried.
                    if upstream.status >= 500:
                        pool.record_failure(worker, f"status {upstream.status}")
                    if upstream.content_type == "text/event-stream":
                        return await self._relay_stream(request, upstream, load)
                    load.prefill_done()
                    return await self._relay_whole(upstream, worker)
                finally:
                    # Closing (not releasing) an unfinished response drops its connection,
                    # which tells the worker to abort the request.
                    upstream.close()
            finally:
                load.finish()

    def _died(self, worker: Worker, exc: BaseException) -> str:
        """What went wrong after the first byte. Silence past ``stream_idle_timeout_s`` is a
        strike towards ejection; a dropped connection is not (a dead worker's next connection
        is refused, which takes it out at once; a live one is not punished for a network blip)."""
        if isinstance(exc, asyncio.TimeoutError) and not isinstance(exc, aiohttp.ClientError):
            problem = f"silent for {self.config.stream_idle_timeout_s:g}s"
            self.pool.record_failure(worker, problem)
            return problem
        return str(exc) or type(exc).__name__

    async def _relay_whole(self, upstream: aiohttp.ClientResponse, worker: Worker) -> web.Response:
        try:
            async with asyncio.timeout(self.config.stream_idle_timeout_s):
                body = await upstream.read()
        except _DIED as exc:
            self.metrics.upstream_errors.labels(worker.name, "body").inc()
            problem = self._died(worker, exc)
            return _error(
                502, f"worker {worker.name} failed while answering: {problem}",
                "UpstreamError", **{WORKER_HEADER: worker.name},
            )
        if upstream.status < 500:
            self.pool.record_success(worker)
        return web.Response(
            status=upstream.status,
            body=body,
            headers={"Content-Type": upstream.headers.get("Content-Type", _JSON), WORKER_HEADER: worker.name},
        )

    async def _relay_stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, load: _Load
    ) -> web.StreamResponse:
        """Pass an SSE stream through as it arrives; end it with an error event if the
        worker dies (or stays silent beyond ``stream_idle_timeout_s``) before finishing it.

        A client may leave before the end (a bench that has read ``[DONE]`` closes before the
        stream's terminating chunk; a user closes a tab). That is counted, never logged as an
        error: aiohttp cancels this handler when it notices, or the next write finds the
        connection gone (``_pass_on``). Either way the handler ends, which drops the worker's
        connection, and the worker aborts the request if it was still generating."""
        try:
            return await self._relay_events(request, upstream, load)
        except asyncio.CancelledError:
            transport = request.transport
            if transport is None or transport.is_closing():
                self.metrics.client_disconnects.labels(load.worker.name).inc()
            raise

    async def _relay_events(
        self, request: web.Request, upstream: aiohttp.ClientResponse, load: _Load
    ) -> web.StreamResponse:
        worker = load.worker
        content = upstream.content
        response = _RelayedStream(
            status=upstream.status,
            headers={
                "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                WORKER_HEADER: worker.name,
            },
        )
        await response.prepare(request)
        idle = self.config.stream_idle_timeout_s
        # Silence from the worker is timed per wait; a client slow to read never counts.
        watch = None if idle is None else WaitTimeout(idle)
        # Events are passed on whole (each chunk up to its last event boundary), so a worker
        # dying mid-event never leaves the client a half event to choke on.
        pending = b""
        try:
            while True:
                if watch is not None:
                    watch.waiting()
                try:
                    chunk = await content.readany()
                except asyncio.CancelledError:
                    if watch is None or not watch.expired():
                        raise
                    failure: BaseException | None = TimeoutError()  # silent too long
                except _DIED as exc:
                    failure = exc
                else:
                    failure = None
                if failure is not None:
                    self.metrics.upstream_errors.labels(worker.name, "stream").inc()
                    problem = self._died(worker, failure)
                    logger.warning("worker %s failed mid-stream: %s", worker.name, problem)
                    tail = _sse_error(f"worker {worker.name} failed mid-stream: {problem}")
                    break
                if watch is not None:
                    watch.done_waiting()
                if chunk:
                    load.prefill_done()
                    data = pending + chunk if pending else chunk
                else:
                    data = pending  # a worker that ended without a final blank line
                if not chunk or content.at_eof():
                    # The worker's answer is complete: its last bytes leave with the end of the
                    # response in one write (the usual case: "[DONE]" arrives with the end).
                    tail = data
                    if upstream.status < 500:
                        self.pool.record_success(worker)
                    break
                if data.endswith(b"\n\n"):
                    cut = len(data)  # the usual chunk: whole events, no scan needed
                else:
                    cut = max(data.rfind(b"\n\n") + 2, data.rfind(b"\r\n\r\n") + 4, 0)
                pending = data[cut:]
                if cut:
                    if not await self._pass_on(response, data[:cut] if pending else data, worker):
                        return response
        finally:
            if watch is not None:
                watch.stop()
        await self._pass_on(response, tail, worker, last=True)
        return response

    async def _pass_on(
        self, response: web.StreamResponse, data: bytes, worker: Worker, last: bool = False
    ) -> bool:
        """Write relayed bytes to the client (and end the response if ``last``); False, and
        counted, when the client has gone."""
        try:
            if last:
                await response.write_eof(data)
            else:
                await response.write(data)
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one
            self.metrics.client_disconnects.labels(worker.name).inc()
            return False
        return True


class _RelayedStream(web.StreamResponse):
    """A relayed SSE stream whose headers leave with its first event: one write to the client
    instead of two per stream, and for a short answer one write in all (with the end of the
    stream). The client sees the headers when the worker's first event arrives rather than
    when the worker's headers do; what it reads as time to first token is unchanged.
    (aiohttp >= 3.12 reads this flag; older versions send the headers at ``prepare``.)"""

    _send_headers_immediately = False


class _Load:
    """One attempt's share of a worker's load accounting, which the routing step counted in
    when it chose the worker: the prompt tokens counted out when the prefill is done (first
    response byte), the request counted out at the end. Both are idempotent."""

    __slots__ = ("_done", "_tokens", "routing", "worker")

    def __init__(self, routing: RoutingStep, worker: Worker, tokens: int) -> None:
        self.routing = routing
        self.worker = worker
        self._tokens = tokens
        self._done = False

    def prefill_done(self) -> None:
        if self._tokens:
            self.routing.first_token(self.worker.slot, self._tokens)
            self._tokens = 0

    def finish(self) -> None:
        if not self._done:
            self.prefill_done()
            self.routing.finished(self.worker.slot)
            self._done = True


#: The data plane :func:`start_router` uses when ``RouterConfig.data_plane`` is None (the test
#: suite's ``data_plane`` fixture sets it, to run every router test on both).
DEFAULT_DATA_PLANE = "aiohttp"


class _StartedRouter:
    """``start_router``'s result: ``async with`` it, or ``await`` it and ``close()`` later."""

    def __init__(self, config: RouterConfig) -> None:
        plane = config.data_plane or DEFAULT_DATA_PLANE
        if plane == "native":
            from kvroute.proxy.native import NativeRouterRunner  # imports this module

            self._router = NativeRouterRunner(config)
        elif plane == "aiohttp":
            self._router = Router(config)
        else:
            raise ValueError(f"unknown data plane {plane!r} (aiohttp or native)")

    def __await__(self):
        return self._start().__await__()

    async def _start(self) -> Router | NativeRouterRunner:
        await self._router.start()
        return self._router

    async def __aenter__(self) -> Router | NativeRouterRunner:
        return await self._start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self._router.close()


def start_router(config: RouterConfig) -> _StartedRouter:
    """Start a router in the running event loop.

    ``async with start_router(RouterConfig(workers=[...])) as router:`` serves on
    ``router.url`` until the block ends; ``router = await start_router(config)`` serves until
    ``await router.close()``. ``config.data_plane`` picks the router: a :class:`Router` or a
    :class:`kvroute.proxy.native.NativeRouterRunner`, which share ``url``, ``drain``,
    ``close``, ``index``, ``metric``, ``metrics_text``, ``worker_statuses``,
    ``available_workers`` and ``retention_stats``.
    """
    return _StartedRouter(config)
