"""How much the bench client itself adds to what it measures, and how fast it can go.

Two servers, each in its own process (so client and server do not share a CPU or a loop):

* ``canned`` — a minimal HTTP/1.1 server that answers every completion at once with a fixed
  SSE stream. It stamps, with ``time.perf_counter`` (CLOCK_MONOTONIC, shared by processes on
  Linux), when it had read each request and when it wrote the first token. The client's own
  TTFT overhead is then ``client TTFT − (first write − request read)``: connection set-up,
  writing the request, reading and parsing the first chunk, and the event loop's latency.
* ``emulator`` — ``kvroute emulate --timing instant``: a full vLLM-like server whose model takes
  no time, as the issue asks; its TTFT bounds client overhead from above (it includes the
  emulator's HTTP and JSON handling and engine bookkeeping).

Measured: TTFT overhead p50/p99 at an open-loop 200 requests/s, and the most streamed requests
per second one bench process sustains (closed loop, rising concurrency), each with a new TCP
connection per request (the default) and the reference prompt (2,371 token ids as JSON). Each
measurement also records the 1-minute load average before and after it (``load_1min``): on a
shared machine the p99 follows the load, so a figure means little without it.

    python benchmarks/bench_client_overhead.py [--requests 2000] [--output-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np

from kvroute.bench.client import BenchClient, run_closed_loop, run_open_loop
from kvroute.bench.prompts import (
    BenchRequest,
    PromptEncoder,
    poisson_schedule,
    reference_workload,
)
from kvroute.fleet import free_ports
from kvroute.workload import WorkloadSpec

# -- the canned server (run as a subprocess: this file with --serve-canned PORT N_TOKENS) ------

_INDEX = re.compile(rb'"user":"(\d+)"')


async def _serve_canned(port: int, tokens: int) -> None:
    log: list[tuple[int, float, float]] = []
    chunk = b'data: {"choices":[{"index":0,"text":" tok"}]}\n\n'
    usage = (
        b'data: {"choices":[],"usage":{"prompt_tokens":2371,"completion_tokens":%d,'
        b'"prompt_tokens_details":{"cached_tokens":2032}}}\n\ndata: [DONE]\n\n' % tokens
    )

    def framed(data: bytes) -> bytes:  # chunked transfer encoding
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                body = await reader.readexactly(int(length.group(1))) if length else b""
                received = time.perf_counter()
                if head.startswith(b"GET /dump"):
                    payload = json.dumps(log).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
                    await writer.drain()
                    continue
                m = _INDEX.search(body)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                first = time.perf_counter()
                writer.write(framed(chunk))
                await writer.drain()
                for _ in range(tokens - 1):
                    await asyncio.sleep(0)  # separate writes, as a streaming server makes them
                    writer.write(framed(chunk))
                writer.write(framed(usage) + b"0\r\n\r\n")
                await writer.drain()
                if m:
                    log.append((int(m.group(1)), received, first))
                if b"close" in head.lower():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# -- helpers -----------------------------------------------------------------------------------


def _wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server on port {port} did not start")


def _requests(n: int, output_tokens: int, tag_index: bool) -> list[BenchRequest]:
    """The reference prompts (K=12); with ``tag_index`` each body names its index (the canned
    server logs it, to join its timestamps with the client's)."""
    wl = reference_workload(WorkloadSpec(prefixes=12, requests=n, output_tokens=output_tokens), PromptEncoder("ids", "m"))
    if tag_index:
        for r in wl.requests:
            r.body = r.body[:-1] + b',"user":"%d"}' % r.index
    return wl.requests


def _pct(values, q) -> float:
    return float(np.percentile(np.asarray(values), q))


async def _open_loop(url: str, requests, rate: float) -> tuple[list, float]:
    records = []
    async with BenchClient(url) as client:
        start = await run_open_loop(client, requests, poisson_schedule(len(requests), rate, 0).tolist(), records.append)
    return records, start


async def _max_rate(url: str, requests, concurrency: int) -> tuple[float, float, int]:
    """(requests/s, client CPU share, failures) of a closed loop at ``concurrency``."""
    records = []
    cpu0, t0 = time.process_time(), time.perf_counter()
    async with BenchClient(url) as client:
        await run_closed_loop(client, requests, concurrency, records.append)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    ok = sum(r.ok for r in records)
    return ok / wall, cpu / wall, len(records) - ok


async def _dump(url: str) -> dict[int, tuple[float, float]]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url + "/dump") as resp:
        return {i: (a, b) for i, a, b in json.loads(await resp.read())}


def _run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-canned", nargs=2, type=int, metavar=("PORT", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=2000, help="requests per measurement (default %(default)s)")
    parser.add_argument("--rate", type=float, default=200.0, help="open-loop rate for the overhead (default %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=16, help="streamed chunks per response (default %(default)s)")
    parser.add_argument("--concurrency", default="16,64,256", help="closed-loop levels for the max rate")
    args = parser.parse_args()
    if args.serve_canned:
        _run(_serve_canned(*args.serve_canned))
        return

    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict = {"requests": args.requests, "output_tokens": args.output_tokens, "rate": args.rate}
    servers = {}
    try:
        (port,) = free_ports(1)
        servers["canned"] = (subprocess.Popen(
            [sys.executable, __file__, "--serve-canned", str(port), str(args.output_tokens)]), port)
        (port,) = free_ports(1)
        servers["emulator"] = (subprocess.Popen(
            [sys.executable, "-m", "kvroute", "emulate", "--port", str(port), "--timing", "instant",
             "--enable-prompt-tokens-details", "--served-model-name", "m"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port)
        for _, port in servers.values():
            _wait_port(port)

        for name, (_, port) in servers.items():
            url = f"http://127.0.0.1:{port}"
            requests = _requests(args.requests, args.output_tokens, tag_index=name == "canned")
            _run(_open_loop(url, requests[:50], args.rate))  # warm both processes up
            load = os.getloadavg()[0]
            records, start = _run(_open_loop(url, requests, args.rate))
            ttft = [r.ttft_s for r in records if r.ok]
            entry = {"failed": sum(not r.ok for r in records), "ttft_p50_ms": _pct(ttft, 50) * 1e3,
                     "ttft_p99_ms": _pct(ttft, 99) * 1e3, "load_1min": [load, os.getloadavg()[0]]}
            if name == "canned":
                stamps = _run(_dump(url))
                # Client overhead = client TTFT minus the server's own time (read → first write).
                overhead = [r.ttft_s - (stamps[r.index][1] - stamps[r.index][0])
                            for r in records if r.ok and r.index in stamps]
                # Where it goes: before the server has the request (connect, write), and after
                # its first write (loopback, the client's read, parse and wake-up).
                sent = {r.index: start + r.send_time for r in records}
                before = [stamps[r.index][0] - sent[r.index] for r in records if r.ok and r.index in stamps]
                entry.update(overhead_p50_ms=_pct(overhead, 50) * 1e3, overhead_p99_ms=_pct(overhead, 99) * 1e3,
                             until_received_p50_ms=_pct(before, 50) * 1e3, until_received_p99_ms=_pct(before, 99) * 1e3,
                             joined=len(overhead))
            entry["max_rate"] = {}
            for c in levels:
                load = os.getloadavg()[0]
                rps, cpu, failed = _run(_max_rate(url, requests, c))
                entry["max_rate"][c] = {"requests_per_s": rps, "client_cpu": cpu, "failed": failed,
                                        "load_1min": [load, os.getloadavg()[0]]}
            results[name] = entry
            print(name, json.dumps(entry, indent=1), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(10)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
