"""``kvroute serve``: the KV-aware router in front of vLLM (or emulated) workers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from kvroute import aio
from kvroute._native import BODY_ENVELOPE_BYTES, DEFAULT_GRPC_PORT, DEFAULT_MAX_BODY_BYTES
from kvroute.blocks import GPU_BLOCK_SIZE
from kvroute.commands._common import add_policy_option_argument, parse_policy_options
from kvroute.errors import UserError
from kvroute.kvevents import EventsSettings, EventsSource
from kvroute.router.config import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_FIRST_BYTE_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_INDEX_MAX_BYTES,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    DEFAULT_MAX_BUFFERED_BODY_BYTES,
    DEFAULT_OFFLOAD_BYTES,
    DEFAULT_PREDICTED_CAPACITY_BLOCKS,
    DEFAULT_PROMPT_CACHE_BYTES,
    DEFAULT_SEND_TIMEOUT_S,
    DEFAULT_STREAM_IDLE_TIMEOUT_S,
    EVENTS_PREDICTED_TTL_S,
    MAX_JSON_DEPTH,
    RETENTION_MODES,
    RouterConfig,
)
from kvroute.router.discovery import DnsDiscovery, FileDiscovery, normalize_worker_url
from kvroute.router.resources import FD_RESERVE, raise_fd_limit, return_freed_memory_promptly
from kvroute.router.server import ConfigError, Router, check_config
from kvroute.routing.policies import POLICIES
from kvroute.service import parse_hostport
from kvroute.units import parse_bytes

NAME = "serve"
HELP = "KV-aware router: an OpenAI-compatible proxy sending each request to the worker caching its prefix"
DESCRIPTION = """\
Serve an OpenAI-compatible API (/v1/completions and /v1/chat/completions, streamed or not,
/v1/models, /health, /metrics) and send every request to one worker, chosen by --policy.
The response header x-kvroute-worker names the worker.

kv-aware (the default) tokenizes each prompt as the engine does, hashes its KV blocks and
asks an index which worker already holds how many leading blocks; the choice weighs the
prefill left after that overlap against each worker's load (requests and prompt tokens in
flight, counted by the router) and refuses to pile onto an overloaded owner. Other policies:
random, round-robin, least-loaded, prefix-hash.

The index learns from the workers' KV cache events (vLLM's --kv-events-config, ZeroMQ):
give --kv-events-port (and --kv-replay-port) when every worker publishes on the same port of
its own host (Kubernetes pods), or --kv-events per worker. Without events the router predicts
the caches from its own decisions (set --predicted-capacity-blocks to the workers'
num_gpu_blocks).

Matching is exact with --tokenizer (the engine's tokenizer directory; the same chat
template) or with prompts sent as token ids. Without --tokenizer, text is tokenized with
kvroute's built-in tokenizer: exact for emulated workers started without --tokenizer,
APPROXIMATE for a real engine (matches then come from the load term only).

Many tenants: the router reads each worker's GET /v1/models after its health checks and sends
a request only to workers that list its "model" (an unknown model gets vLLM's 404). A model
that names a LoRA adapter (a card with a parent) and a "cache_salt" key the prompt's block
hashes as vLLM keys them, so one tenant's or adapter's cache never counts for another
(--health-interval 0 turns this discovery off with the checks).

Workers: --worker (repeatable), --worker-file (one URL per line, re-read when it changes) or
--dns NAME:PORT (re-resolved; a Kubernetes headless Service) or --k8s-service (the
Service's EndpointSlices, watched: pods that start terminating get no new requests). Unhealthy workers (GET /health)
are taken out until they recover. On SIGTERM the router drains: /health turns 503, new
requests get 503, in-flight streams finish (up to --drain-timeout), then it exits.

Failures: a worker that refuses a connection, drops it before answering, or misses
--first-byte-timeout has the request sent to another worker (never after the first response
byte). A stream whose worker dies, or is silent longer than --stream-idle-timeout, ends with an
SSE error event and no [DONE]. --eject-after consecutive timeouts or 5xx answers take a worker out for
--eject-base seconds (longer each time in a row); it returns when that is over and /health passes.

Hostile clients: every limit is on by default and counted when it fires (metrics in
parentheses). A request head must arrive within --header-timeout and its body within
--body-timeout (kvroute_router_client_timeouts); idle connections close after
--keepalive-timeout, and those whose client reads none of its answer for --send-timeout; at
--max-connections a new connection sheds a lingering one (its answer sent) or the slowest waiting one,
or gets a 503 and is closed (kvroute_router_connections_refused), instead of the descriptors
running out and the port going silent. Bodies over --max-body-bytes get 413 before they are read, compressed ones
415 (never expanded), JSON nested deeper than %(depth)d levels 400
(kvroute_router_rejected_requests); the bodies held at once are bounded by
--max-buffered-body-bytes (503 beyond it). Bodies over --offload-bytes are parsed and tokenized on
a blocking thread, never on one serving other connections. Tokenization caches are bounded in bytes (--prompt-cache-bytes). Health
checks never follow redirects (a 3xx is unhealthy).

Security: only the workers given or discovered are ever contacted, at the router's own paths;
no request field or header can choose an upstream. --api-key KEY (or the KVROUTE_API_KEY
environment variable, which keeps it out of `ps`) makes every route except /health require
"Authorization: Bearer KEY" (compared in constant time); /metrics too unless --public-metrics.
The client's Authorization header is NOT passed to workers unless --forward-authorization;
--worker-api-key (or KVROUTE_WORKER_API_KEY) sends a key of the router's own instead, for vLLM
started with --api-key.

Example: six emulated workers (kvroute emulate --workers 6 --port 8001 with
--kv-events-config endpoint tcp://*:5557) behind the router:

  kvroute serve --port 8000 --policy kv-aware \\
      --worker http://127.0.0.1:8001 --kv-events http://127.0.0.1:8001=tcp://127.0.0.1:5557 \\
      --worker http://127.0.0.1:8002 --kv-events http://127.0.0.1:8002=tcp://127.0.0.1:5558 ...

Example: vLLM pods behind a headless Service, events on port 5557, replay on 5558:

  kvroute serve --host 0.0.0.0 --port 8000 --dns vllm-headless:8000 \\
      --kv-events-port 5557 --kv-replay-port 5558 --tokenizer /models/Qwen3-0.6B
"""
DESCRIPTION %= {"depth": MAX_JSON_DEPTH}


#: Flags of the proxy's own front (client connections, relaying, client auth), and the values
#: ``kvroute epp``, which has no such front, runs with.
_PROXY_ONLY_DEFAULTS = dict(
    header_timeout=DEFAULT_HEADER_TIMEOUT_S, keepalive_timeout=DEFAULT_KEEPALIVE_TIMEOUT_S,
    send_timeout=DEFAULT_SEND_TIMEOUT_S, max_connections=None, max_attempts=RouterConfig.max_attempts,
    first_byte_timeout=DEFAULT_FIRST_BYTE_TIMEOUT_S, stream_idle_timeout=DEFAULT_STREAM_IDLE_TIMEOUT_S,
    api_key=None, public_metrics=False, forward_authorization=False,
)


def add_arguments(parser: argparse.ArgumentParser, *, epp: bool = False) -> None:
    """serve's flags; with ``epp``, those that mean the same for ``kvroute epp`` (which only
    decides: no client connections, no relay) and its listening ports."""
    listen = parser.add_argument_group("listening")
    listen.add_argument("--host", default=RouterConfig.host, help="address to listen on (default: %(default)s)")
    if epp:
        listen.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT,
                            help="port of Envoy's ext_proc service and gRPC health (services liveness, "
                            "readiness, envoy.service.ext_proc.v3.ExternalProcessor); 0 picks a free "
                            "one (default: %(default)s, the InferencePool's endpointPickerRef port)")
        listen.add_argument("--port", type=int, default=9090,
                            help="HTTP port of /metrics and /health; 0 picks a free one (default: %(default)s)")
        parser.set_defaults(**_PROXY_ONLY_DEFAULTS)
    else:
        listen.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default: %(default)s)")
    listen.add_argument("--threads", type=int, default=None, metavar="N",
                        help="threads serving requests (default: one per core)")

    workers = parser.add_argument_group("workers (one source)")
    workers.add_argument("--worker", action="append", default=[], metavar="URL",
                         help="a worker's http://HOST:PORT; repeat once per worker")
    workers.add_argument("--worker-file", metavar="PATH",
                         help="file with one worker URL per line, re-read when it changes")
    workers.add_argument("--dns", metavar="NAME:PORT",
                         help="a name resolving to one address per worker (Kubernetes headless Service)")
    workers.add_argument("--k8s-service", metavar="[NAMESPACE/]SERVICE[:PORT]",
                         help="watch a Kubernetes Service's EndpointSlices (ready and terminating pods); "
                         "PORT is the port's number or name (default http); needs RBAC to "
                         "get/list/watch endpointslices (deploy/helm/kvroute sets it up)")
    workers.add_argument("--pool", metavar="[NAMESPACE/]NAME",
                         help="follow the ready pods of a Gateway API Inference Extension InferencePool "
                         "(inference.networking.k8s.io/v1: its selector.matchLabels and targetPorts, "
                         "one worker per pod and port); needs RBAC to get inferencepools and "
                         "get/list/watch pods")
    workers.add_argument("--discovery-interval", type=float, default=5.0, metavar="S",
                         help="seconds between --dns lookups / --worker-file checks (default: %(default)s)")
    workers.add_argument("--health-interval", type=float, default=RouterConfig.health_interval_s, metavar="S",
                         help="seconds between GET /health checks of a healthy worker; one taken out is checked "
                              "4 times as often, to return soon after a restart; 0 disables them "
                              "(default: %(default)s)")

    replicas = parser.add_argument_group(
        "replicas (several routers behind one Service share their decisions: docs/replicas.md)")
    replicas.add_argument("--mesh-bind", metavar="HOST:PORT",
                          help="publish this replica's routing decisions and refreshes to its peers on "
                               "HOST:PORT (ZeroMQ PUB; e.g. 0.0.0.0:5600)")
    replicas.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                          help="a peer replica's --mesh-bind address; repeat per peer, or give a name "
                               "resolving to every replica (a headless Service: router-mesh:5600), "
                               "re-resolved every 5 s; this replica's own address is skipped")
    replicas.add_argument("--peer-k8s-service", metavar="[NAMESPACE/]SERVICE[:PORT]",
                          help="the peer replicas from a Kubernetes Service's EndpointSlices (list, "
                               "then watch), as --k8s-service finds workers: each ready pod's address "
                               "on PORT (the mesh port's number or name, default mesh) is a peer; "
                               "needs get/list/watch on endpointslices")

    routing = parser.add_argument_group("routing")
    routing.add_argument("--policy", default="kv-aware", choices=sorted(POLICIES),
                         help="how to choose a worker (default: %(default)s)")
    add_policy_option_argument(
        routing, "a policy parameter, e.g. load_factor=0.25 or request_weight=64; "
        "admission_wait=0.2 turns on kv-aware's admission guard (a request that would wait for KV "
        "blocks goes where it fits; metrics kvroute_router_admission_*); repeatable"
    )
    routing.add_argument("--seed", type=int, default=None, help="seed the policy's random choices")
    routing.add_argument("--tokenizer", metavar="DIR",
                         help="the engines' Hugging Face tokenizer directory, for exact matching "
                         "(default: kvroute's built-in tokenizer, approximate for real engines)")
    routing.add_argument("--block-size", type=int, default=GPU_BLOCK_SIZE,
                         help="the engines' KV block size (default: %(default)s, vLLM on GPU and the emulator)")

    events = parser.add_argument_group("KV events")
    events.add_argument("--kv-events-port", type=int, metavar="P",
                        help="every worker publishes KV events on tcp://<its host>:P")
    events.add_argument("--kv-replay-port", type=int, metavar="Q",
                        help="every worker's replay socket is tcp://<its host>:Q")
    events.add_argument("--kv-events", action="append", default=[], metavar="WORKER=ENDPOINT[,REPLAY]",
                        help="one worker's event (and replay) sockets, e.g. "
                        "http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 (ipc://PATH too); repeatable")
    events.add_argument("--kv-events-topic", default="", help="subscription topic prefix (default: all)")
    events.add_argument("--predicted-ttl", type=float, metavar="S",
                        help=f"seconds a routing decision counts as cached before events confirm it "
                        f"(default: {EVENTS_PREDICTED_TTL_S:g} with events, none without)")
    events.add_argument("--predicted-capacity-blocks", type=int, metavar="N",
                        help="predicted blocks kept per worker, LRU (default without events: "
                        f"{DEFAULT_PREDICTED_CAPACITY_BLOCKS}, the reference worker's cache)")

    routing.add_argument("--retention", choices=RETENTION_MODES, default=None,
                         help="refresh the prefixes each worker's LRU would evict with a prefix-only "
                         "request (the prefix's token ids, max_tokens 1): off, on, or auto (only on "
                         "a worker with slack, only while the refreshes measurably save prefills); "
                         "metrics kvroute_retention_* (default: auto with kv-aware, off with the "
                         "other policies)")
    routing.add_argument("--kv-capacity-blocks", type=int, metavar="N",
                         help="each worker's usable KV blocks (vLLM's num_gpu_blocks less the null "
                         "block), for retention's model and kv-aware's admission guard (default: "
                         "the guard reads each worker's own from its /metrics, "
                         "vllm:cache_config_info; retention assumes --predicted-capacity-blocks, or "
                         "the reference worker's, less the null block)")

    routing.add_argument("--max-loras", type=int, default=1, metavar="N",
                         help="the workers' LoRA slots, as vLLM's flag (set it to theirs): the router "
                         "models the adapters in each worker's slots as the last N it sent there, "
                         "and kv-aware charges adapter_weight where a request's adapter would "
                         "displace another from full slots (default %(default)s, vLLM's)")

    events.add_argument("--index-max-bytes", default=f"{DEFAULT_INDEX_MAX_BYTES >> 20}MiB", metavar="SIZE",
                        help="memory bound of the index of cached blocks (128 bytes per worker and "
                        "block; the least recently touched are dropped beyond it, metric "
                        "kvroute_router_index_evicted_blocks; default: %(default)s)")

    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-body-bytes", metavar="SIZE",
                        help="larger request bodies get 413, before they are read when they declare "
                        "their length. Default: derived from the tokenizer's model_max_length N "
                        "and its longest token's L bytes, as N x max(3L, 12) + "
                        f"{BODY_ENVELOPE_BYTES >> 20} MiB (a prompt of N tokens as text, even with "
                        "\\uXXXX escapes, or as ids, plus the rest of the body), at most "
                        f"{DEFAULT_MAX_BODY_BYTES >> 20} MiB; {DEFAULT_MAX_BODY_BYTES >> 20} MiB without "
                        "a --tokenizer that states N. Raise it for large batch prompts")
    limits.add_argument("--max-buffered-body-bytes", default=f"{DEFAULT_MAX_BUFFERED_BODY_BYTES >> 20}MiB",
                        metavar="SIZE",
                        help="request body bytes held in memory at once, across all requests "
                        "(from before a body is read until a worker answers it): a body that "
                        f"would exceed it gets {'429' if epp else '503'} with Retry-After, so that many large bodies at "
                        "once cannot take the router's memory. At least the body limit "
                        "(metric kvroute_router_buffered_body_bytes; default: %(default)s)")
    if not epp:
        limits.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                            help="seconds for a request's line and headers to arrive, from the "
                            "connection's start or the head's first byte; slower connections are "
                            "closed (slowloris; a head is a few KiB) (default: %(default)g)")
    limits.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                        help="seconds for a request body to arrive in full, else 408 (default: "
                        "%(default)g: 64 MiB at 1 MiB/s)")
    if not epp:
        limits.add_argument("--keepalive-timeout", type=float, default=DEFAULT_KEEPALIVE_TIMEOUT_S, metavar="S",
                            help="seconds an idle client connection is kept open; keep it above your "
                            "load balancer's idle timeout (60 s on AWS and GCP) so that it never sends "
                            "on a connection being closed (default: %(default)g)")
    if not epp:
        limits.add_argument("--send-timeout", type=float, default=DEFAULT_SEND_TIMEOUT_S, metavar="S",
                            help="seconds a client may take no byte of its answer while the router has "
                            "more to write before its connection is closed (a client that stops "
                            "reading holds its connection and its worker's); 0: no limit (default: "
                            "%(default)g, as nginx's send_timeout)")
    if not epp:
        limits.add_argument("--max-connections", type=int, metavar="N",
                            help="open client connections at most. At the limit a new connection closes "
                            "one that lingers after its answer, else the one waiting longest for its "
                            "request head (a slow client); when none does, it is answered 503 and closed. "
                            f"Default: (RLIMIT_NOFILE - {FD_RESERVE}) / 2, after raising the soft limit to "
                            "the hard one: each connection with a request in flight also holds one to a "
                            "worker, so the descriptors never run out (448 under ulimit -n 1024)")
    limits.add_argument("--offload-bytes", default=f"{DEFAULT_OFFLOAD_BYTES >> 10}KiB", metavar="SIZE",
                        help="larger bodies are parsed, tokenized and hashed on a blocking thread, "
                        "never on one serving other connections, 2 at once (a parse takes a "
                        "multiple of the body's size; the others wait once read) (default: %(default)s)")
    limits.add_argument("--prompt-cache-bytes", default=f"{DEFAULT_PROMPT_CACHE_BYTES >> 20}MiB", metavar="SIZE",
                        help="memory bound of the tokenizer's caches (text pieces and words, so "
                        "that a shared prefix is tokenized once) (default: %(default)s)")
    limits.add_argument("--drain-timeout", type=float, default=RouterConfig.drain_timeout_s, metavar="S",
                        help="on SIGTERM, wait this long for in-flight requests (default: %(default)s)")
    if not epp:
        limits.add_argument("--max-attempts", type=int, default=RouterConfig.max_attempts,
                            help="workers tried per request before a 502, retrying only before the "
                            "first response byte (default: %(default)s)")
        limits.add_argument("--first-byte-timeout", type=float, default=DEFAULT_FIRST_BYTE_TIMEOUT_S, metavar="S",
                            help="seconds a worker may take to send its response headers before the "
                            "request goes to another worker (0: no limit). A stream's headers come "
                            "before its prefill; a non-streamed request's are its whole answer, so "
                            "this bounds that: the default %(default)g s covers a 130k-token prefill "
                            "(~30 s on an H100 for an 8B model, minutes on smaller GPUs) and 8k tokens "
                            "at 20 tokens/s. Raise it for longer non-streamed generations")
        limits.add_argument("--stream-idle-timeout", type=float, default=DEFAULT_STREAM_IDLE_TIMEOUT_S, metavar="S",
                            help="most seconds between two chunks of an answer, the first one "
                            "included, before it is ended with an SSE error event (0: no limit). The "
                            "longest healthy silence is the wait for the first token, queueing plus "
                            "prefill: a 130k-token prompt prefills in ~30 s on an H100 (8B model) and "
                            "~3 min on an L4-class GPU; the default %(default)g s cuts neither and "
                            "still ends the streams of a stopped or wedged worker")
    limits.add_argument("--eject-after", type=int, default=RouterConfig.eject_after_failures, metavar="N",
                        help="consecutive failed requests that take a worker out; 0 never "
                        "(default: %(default)s)")
    limits.add_argument("--eject-base", type=float, default=RouterConfig.eject_base_s, metavar="S",
                        help="first ejection's length; the n-th in a row lasts n times as long "
                        "(default: %(default)s)")

    security = parser.add_argument_group("security")
    if not epp:
        security.add_argument("--api-key", default=os.environ.get("KVROUTE_API_KEY"), metavar="KEY",
                              help="require Authorization: Bearer KEY on every route but /health "
                              "(default: $KVROUTE_API_KEY, else no auth)")
    if not epp:
        security.add_argument("--public-metrics", action="store_true",
                              help="with --api-key, leave /metrics open too (for a scraper without the key)")
    if not epp:
        security.add_argument("--forward-authorization", action="store_true",
                              help="pass the client's Authorization header on to the workers "
                              "(default: dropped)")
    security.add_argument("--worker-api-key", default=os.environ.get("KVROUTE_WORKER_API_KEY"),
                          metavar="KEY", help="send Authorization: Bearer KEY to the workers "
                          "(default: $KVROUTE_WORKER_API_KEY, else none)")


#: ZeroMQ transports a worker's KV event sockets may use (ipc: workers on the router's host).
_ZMQ_SCHEMES = ("tcp://", "ipc://")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The router configuration the flags describe (raises UserError on bad flags)."""
    sources = [bool(args.worker), bool(args.worker_file), bool(args.dns), bool(args.k8s_service), bool(args.pool)]
    if sum(sources) != 1:
        raise UserError(
            "give the workers one way: --worker URL (repeated), --worker-file PATH, --dns NAME:PORT, "
            "--k8s-service [NAMESPACE/]SERVICE[:PORT] or --pool [NAMESPACE/]NAME"
        )
    discovery = None
    if args.worker_file:
        discovery = FileDiscovery(args.worker_file, args.discovery_interval)
        discovery.check()  # a file missing at start is a mistake, not a list to wait for
    elif args.dns:
        discovery = DnsDiscovery.from_spec(args.dns, args.discovery_interval)
    elif args.k8s_service:
        # Imported here: only this mode needs the Kubernetes client.
        from kvroute.router.k8s import EndpointSliceDiscovery

        discovery = EndpointSliceDiscovery.from_spec(args.k8s_service)
    elif args.pool:
        from kvroute.router.k8s import InferencePoolDiscovery

        discovery = InferencePoolDiscovery.from_spec(args.pool)
    for flag, port in (("--port", args.port), ("--grpc-port", getattr(args, "grpc_port", None))):
        if port is not None and not 0 <= port <= 65535:
            raise UserError(f"{flag} must be a port 0-65535 (0: a free one), got {port}")
    for flag, port in (("--kv-events-port", args.kv_events_port), ("--kv-replay-port", args.kv_replay_port)):
        if port is not None and not 0 < port <= 65535:
            raise UserError(f"{flag} must be a port 1-65535, got {port}")
    if args.kv_replay_port is not None and args.kv_events_port is None:
        raise UserError("--kv-replay-port needs --kv-events-port")
    per_worker = {}
    for spec in args.kv_events:
        worker, sep, sockets = spec.partition("=")
        endpoint, _, replay = sockets.partition(",")
        if not sep or not endpoint.startswith(_ZMQ_SCHEMES) or (replay and not replay.startswith(_ZMQ_SCHEMES)):
            raise UserError(
                f"bad --kv-events {spec!r}: expected WORKER_URL=ENDPOINT[,REPLAY_ENDPOINT] with "
                "tcp://HOST:PORT or ipc://PATH endpoints"
            )
        per_worker[normalize_worker_url(worker)] = EventsSource(endpoint, replay or None)
    options = parse_policy_options(args.policy_option)
    if (args.peer or args.peer_k8s_service) and not args.mesh_bind:
        raise UserError("--peer and --peer-k8s-service need --mesh-bind: peers subscribe to this "
                        "replica's decisions there")
    peer_discovery = None
    if args.peer_k8s_service:
        from kvroute.router.k8s import EndpointSliceDiscovery

        spec = args.peer_k8s_service
        spec = spec if ":" in spec else f"{spec}:mesh"
        peer_discovery = EndpointSliceDiscovery.from_spec(spec, flag="--peer-k8s-service")
    for address in ([args.mesh_bind] if args.mesh_bind else []) + args.peer:
        parse_hostport(address)  # one clear line for a malformed address
    for flag, value in (("--first-byte-timeout", args.first_byte_timeout),
                        ("--stream-idle-timeout", args.stream_idle_timeout),
                        ("--send-timeout", args.send_timeout)):
        if value is not None and value < 0:  # 0 is the flag's "no limit", None the setting's
            raise UserError(f"{flag} must be positive (0: no limit), got {value:g}")
    threads = args.threads if args.threads is not None else (os.cpu_count() or 1)
    config = RouterConfig(
        workers=args.worker,
        discovery=discovery,
        policy=args.policy,
        policy_options=options,
        seed=args.seed,
        host=args.host,
        port=args.port,
        tokenizer=args.tokenizer,
        block_size=args.block_size,
        events=EventsSettings(args.kv_events_port, args.kv_replay_port, per_worker, args.kv_events_topic),
        predicted_ttl_s=args.predicted_ttl,
        predicted_capacity_blocks=args.predicted_capacity_blocks,
        index_max_bytes=parse_bytes(args.index_max_bytes),
        health_interval_s=args.health_interval,
        max_attempts=args.max_attempts,
        max_body_bytes=parse_bytes(args.max_body_bytes) if args.max_body_bytes else None,
        max_buffered_body_bytes=parse_bytes(args.max_buffered_body_bytes),
        drain_timeout_s=args.drain_timeout,
        first_byte_timeout_s=args.first_byte_timeout or None,
        stream_idle_timeout_s=args.stream_idle_timeout or None,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keepalive_timeout_s=args.keepalive_timeout,
        send_timeout_s=args.send_timeout or None,
        max_connections=args.max_connections,
        offload_bytes=parse_bytes(args.offload_bytes),
        prompt_cache_bytes=parse_bytes(args.prompt_cache_bytes),
        eject_after_failures=args.eject_after,
        eject_base_s=args.eject_base,
        api_key=args.api_key,
        metrics_public=args.public_metrics,
        forward_authorization=args.forward_authorization,
        worker_api_key=args.worker_api_key,
        retention=args.retention,
        kv_capacity_blocks=args.kv_capacity_blocks,
        max_loras=args.max_loras,
        threads=threads,
        grpc_port=getattr(args, "grpc_port", None),
        mesh_bind=args.mesh_bind,
        peers=tuple(args.peer),
        peer_discovery=peer_discovery,
    )
    try:
        check_config(config)
    except ConfigError as exc:
        raise UserError(flag_message(exc)) from None
    return config


#: The flag that sets each ``RouterConfig`` field, for the messages of settings the router
#: refuses (``ConfigError.field``; a field without a flag is named as it is); a test checks
#: every flag is one of the parser's.
CONFIG_FLAGS: dict[str, str] = {
    "workers": "--worker", "policy": "--policy-option", "seed": "--seed", "host": "--host",
    "port": "--port", "tokenizer": "--tokenizer", "block_size": "--block-size",
    "events": "--kv-events-topic", "predicted_ttl_s": "--predicted-ttl",
    "predicted_capacity_blocks": "--predicted-capacity-blocks", "index_max_bytes": "--index-max-bytes",
    "health_interval_s": "--health-interval", "max_attempts": "--max-attempts",
    "max_body_bytes": "--max-body-bytes", "max_buffered_body_bytes": "--max-buffered-body-bytes",
    "first_byte_timeout_s": "--first-byte-timeout", "stream_idle_timeout_s": "--stream-idle-timeout",
    "header_timeout_s": "--header-timeout", "body_timeout_s": "--body-timeout",
    "keepalive_timeout_s": "--keepalive-timeout", "send_timeout_s": "--send-timeout",
    "max_connections": "--max-connections",
    "offload_bytes": "--offload-bytes", "eject_after_failures": "--eject-after", "eject_base_s": "--eject-base",
    "api_key": "--api-key", "worker_api_key": "--worker-api-key", "prompt_cache_bytes": "--prompt-cache-bytes",
    "retention": "--retention", "kv_capacity_blocks": "--kv-capacity-blocks", "max_loras": "--max-loras",
    "threads": "--threads", "mesh_bind": "--mesh-bind",
}


def flag_message(exc: ConfigError) -> str:
    """``exc`` said of the flag that sets its field (the field's name where no flag does)."""
    if exc.field is None:
        return exc.message
    return f"{CONFIG_FLAGS.get(exc.field, exc.field)} {exc.message}"


async def _serve(config: RouterConfig, name: str = "serve") -> None:
    """Serve until SIGINT/SIGTERM; then drain (new requests 503, in-flight ones finish).
    ``name``: the command, ``serve`` or ``epp`` (``config.grpc_port`` set), in its lines."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    router: Router | None = None
    try:
        raise_fd_limit()  # before start: the connection limit is derived from it
        return_freed_memory_promptly()  # a 50 MB body's buffers go back to the system when freed
        try:
            router = Router(config)
        except ConfigError as exc:
            raise UserError(flag_message(exc)) from None
        await router.start()
        workers = ", ".join(router.worker_statuses()) or "none yet"
        # The first line names the bound port(s), so a script that asked for port 0 can read it.
        if router.grpc_address is None:
            print(f"kvroute serve: listening on {router.url}, policy {config.policy}, "
                  f"{config.threads} threads, workers: {workers}", flush=True)
        else:
            print(f"kvroute epp: ext_proc on {router.grpc_address}, metrics on {router.url}/metrics, "
                  f"policy {config.policy}, {config.threads} threads, workers: {workers}", flush=True)
        print(f"kvroute {name}: max body {router.max_body_bytes} bytes ({router.max_body_source}), "
              f"{config.max_buffered_body_bytes} bytes of bodies held at most"
              + ("" if router.grpc_address else f", max {router.max_connections} connections"),
              file=sys.stderr, flush=True)
        await stop.wait()
        print(f"kvroute {name}: draining {router.in_flight} in-flight requests", file=sys.stderr, flush=True)
        await router.drain()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        if router is not None:
            await router.close()


def run(args: argparse.Namespace, name: str = "serve") -> int:
    logging.basicConfig(level=logging.WARNING, format=f"kvroute {name}: %(levelname)s %(message)s")
    config = config_from_args(args)
    aio.run(_serve(config, name))
    print(f"kvroute {name}: stopped", file=sys.stderr, flush=True)
    return 0
