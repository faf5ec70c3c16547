"""Where a request's time goes through the gateway: Envoy + ``kvroute epp``, phase by phase.

``benchmarks/peers.py --mode overhead --routers envoy,gateway`` gives what the EPP adds to TTFT
as a whole; on a shared machine that difference moves by ± 0.5 ms between runs. This splits
one request's path into the phases Envoy itself timestamps (its debug log of the ext_proc,
router and HTTP components), so a change to the EPP or to the gateway's configuration shows
in the phase it touches, over many requests, instead of in the noise of the whole:

* ``request``: Envoy has the request's headers → it has sent the body's last chunk to the EPP;
* ``decision``: last body chunk sent → the EPP's answer naming the worker received (the
  ext_proc exchange plus the EPP's parse, tokenization and routing);
* ``apply``: that answer received → the request sent upstream (Envoy applies the header,
  takes the body the EPP sends back, picks the original-destination host);
* ``worker``: sent upstream → the worker's response headers (instant emulated workers);
* ``response headers``: the worker's response headers → the EPP's answer to them (the
  ext_proc exchange the response's status costs; Envoy holds the response until then);
* ``total``: the request's headers → the response's headers sent to the client.

Envoy logs at debug level for those components, which slows Envoy itself: read the phases
against each other and between variants, not as Envoy's production latency. The EPP's own
``kvroute_router_routing_seconds`` (parse → tokenize → hash → route) is reported beside them.

Emulated workers (``instant`` timing; ``--kv-events``: publishing KV events the EPP consumes),
``kvroute epp`` with a tiny local tokenizer and Envoy
with ``src/kvroute/gateway/envoy.yaml`` (the tests' and the experiment's configuration), all
on 127.0.0.1; the requests go one at a time: a text prompt of ``--prompt-words`` words with a
new ending each time, streamed, ``--output-tokens`` tokens.

    python benchmarks/gateway_phases.py [--requests 200] [--epp-args "--threads 1"] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import aiohttp

from kvroute import aio
from kvroute.errors import UserError
from kvroute.gateway import envoy_binary, envoy_config, free_port
from kvroute.tinymodel import build_tiny_model
from kvroute.workers import launch_emulated

#: Envoy's debug lines that mark each phase's end, in the order they come for one request.
MARKS = {
    "start": "request headers complete",
    "body_sent": "Sending a body chunk",  # the last one (end_stream true)
    "decided": "Received request headers response",
    "upstream_sent": "router decoding headers",
    "upstream_headers": "upstream headers complete",
    "answered": "Received response headers response",
    "client_headers": "encoding headers via codec",
}
#: Phases as (name, from mark, to mark).
PHASES = (
    ("request", "start", "body_sent"),
    ("decision", "body_sent", "decided"),
    ("apply", "decided", "upstream_sent"),
    ("worker", "upstream_sent", "upstream_headers"),
    ("response headers", "upstream_headers", "answered"),
    ("total", "start", "client_headers"),
)
#: A downstream stream's line in Envoy's log: time, then the stream's id, then the message.
LINE = re.compile(r'^(\d+):(\d+):(\d+\.\d+) \S+ \[Tags: "ConnectionId":"\d+","StreamId":"(\d+)"\] (.*)$')
#: Requests left out at the start (connections opening, caches warming).
WARMUP = 10


def marks_by_request(log: str) -> list[dict[str, float]]:
    """Each downstream request's marks (µs of the day) from Envoy's log, in log order."""
    marks: dict[str, dict[str, float]] = defaultdict(dict)
    for line in log.splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        hours, minutes, seconds, stream, message = m.groups()
        at = (int(hours) * 3600 + int(minutes) * 60 + float(seconds)) * 1e6
        seen = marks[stream]
        for mark, prefix in MARKS.items():
            if not message.startswith(prefix):
                continue
            if mark == "body_sent":
                if "end_stream true" in message:
                    seen.setdefault(mark, at)
            elif mark != "upstream_sent" or "decided" in seen:  # not the gRPC stream's own
                seen.setdefault(mark, at)
    return [m for m in marks.values() if len(m) == len(MARKS)]


def phase_table(requests: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median and p90 (µs) of each phase over ``requests``."""
    table = {}
    for name, begin, end in PHASES:
        spans = sorted(r[end] - r[begin] for r in requests)
        table[name] = {"p50_us": statistics.median(spans), "p90_us": spans[int(0.9 * (len(spans) - 1))]}
    return table


async def start_epp(fleet, tokenizer: str, grpc_port: int, extra: list[str], log: Path, events: bool):
    cmd = [sys.executable, "-m", "kvroute", "epp", "--host", "127.0.0.1", "--port", "0",
           "--grpc-port", str(grpc_port), "--tokenizer", tokenizer, *extra]
    for url, (live, replay) in zip(fleet.urls, fleet.kv_events if events else [(None, None)] * len(fleet.urls),
                                   strict=True):
        cmd += ["--worker", url]
        if events:
            cmd += ["--kv-events", f"{url}={live},{replay}"]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=log.open("w"))
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    if "metrics on " not in line:
        proc.kill()
        raise UserError(f"kvroute epp did not start: {log.read_text()[-300:]}")
    return proc, line.split("metrics on ")[1].split(",")[0]


async def wait_serving(s: aiohttp.ClientSession, url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with s.get(f"{url}/v1/models") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise UserError(f"the gateway at {url} did not answer within {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


async def routing_seconds(s: aiohttp.ClientSession, metrics_url: str) -> tuple[float, float]:
    async with s.get(metrics_url) as r:
        text = await r.text()
    total = float(re.search(r"^kvroute_router_routing_seconds_sum (\S+)", text, re.M).group(1))
    count = float(re.search(r"^kvroute_router_routing_seconds_count (\S+)", text, re.M).group(1))
    return total, count


async def measure(args: argparse.Namespace, out: Path) -> dict:
    with tempfile.TemporaryDirectory() as tokenizer:
        build_tiny_model(tokenizer)
        emulate = ["--timing", "instant", "--tokenizer", tokenizer]
        if args.kv_events:
            emulate += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})]
        fleet = await launch_emulated(args.workers, emulate)
        processes = []
        try:
            grpc, listen, admin = free_port(), free_port(), free_port()
            epp, metrics_url = await start_epp(fleet, tokenizer, grpc, shlex.split(args.epp_args),
                                               out / "epp.log", args.kv_events)
            processes.append(epp)
            config = out / "envoy.yaml"
            config.write_text(envoy_config(listen, admin, grpc))
            processes.append(subprocess.Popen(
                [str(envoy_binary()), "-c", str(config), "--concurrency", "2", "--disable-hot-restart",
                 "--log-level", "warning",
                 "--component-log-level", "ext_proc:debug,router:debug,http:debug",
                 "--log-format", "%H:%M:%S.%f %n %v"],
                stdout=(out / "envoy.log").open("w"), stderr=subprocess.STDOUT))
            url = f"http://127.0.0.1:{listen}"
            text = " ".join(f"word{i}" for i in range(args.prompt_words))
            async with aiohttp.ClientSession() as s:
                await wait_serving(s, url)
                sum0, count0 = await routing_seconds(s, metrics_url)
                for i in range(args.requests + WARMUP):
                    body = {"prompt": f"{text} request {i}", "max_tokens": args.output_tokens, "stream": True}
                    async with s.post(f"{url}/v1/completions", json=body) as r:
                        data = await r.read()
                        if r.status != 200:
                            raise UserError(f"the gateway answered {r.status}: {data[:200]!r}")
                sum1, count1 = await routing_seconds(s, metrics_url)
        finally:
            for p in processes:
                p.terminate()
            for p in processes:
                await p.wait() if isinstance(p, asyncio.subprocess.Process) else p.wait()
            await fleet.close()
    requests = marks_by_request((out / "envoy.log").read_text())[WARMUP:]
    if not requests:
        raise UserError(f"no request's phases found in {out / 'envoy.log'}")
    return {
        "requests": len(requests),
        "prompt_words": args.prompt_words,
        "epp_args": args.epp_args,
        "workers": args.workers,
        "kv_events": args.kv_events,
        "phases": phase_table(requests),
        "routing_mean_us": 1e6 * (sum1 - sum0) / max(count1 - count0, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--requests", type=int, default=200, help="requests measured (default %(default)s)")
    parser.add_argument("--prompt-words", type=int, default=450,
                        help="words of the text prompt (default %(default)s: ~2,400 tokens of the tiny "
                             "tokenizer, the reference prompts' length)")
    parser.add_argument("--output-tokens", type=int, default=4, help="(default %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="emulated workers (default %(default)s)")
    parser.add_argument("--kv-events", action="store_true",
                        help="the workers publish KV events and the EPP consumes them (as in the overhead "
                             "benchmark); off: the EPP predicts")
    parser.add_argument("--epp-args", default="", metavar="ARGS", help="more kvroute epp flags, e.g. '--threads 1'")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for results.json and the logs (default: a new temporary folder)")
    args = parser.parse_args()
    if args.requests < 10 or args.prompt_words < 1:
        parser.error("--requests must be at least 10 and --prompt-words at least 1")
    out = args.out or Path(tempfile.mkdtemp(prefix="kvroute-gateway-phases-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = aio.run(measure(args, out))
    except UserError as exc:
        print(f"gateway_phases: error: {exc}", file=sys.stderr)
        return 1
    (out / "results.json").write_text(json.dumps(result, indent=2))
    print(f"{result['requests']} requests through Envoy + kvroute epp, one at a time "
          f"(Envoy at debug level for its phases: read them against each other)")
    print(f"{'phase':18s} {'p50 µs':>8s} {'p90 µs':>8s}")
    for name, figures in result["phases"].items():
        print(f"{name:18s} {figures['p50_us']:8.0f} {figures['p90_us']:8.0f}")
    print(f"{'EPP routing (mean)':18s} {result['routing_mean_us']:8.0f}")
    print(f"wrote {out / 'results.json'} and the logs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
