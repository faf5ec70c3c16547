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

Side by side (``--client lean,aiohttp``, the default): ``lean`` is the product's
``BenchClient`` (httptools on a bare asyncio Protocol), ``aiohttp`` the client it replaced,
kept here as the reference. The clients take turns against the same servers within one run (``--rounds`` alternations, the
order flipped each round), since on a shared machine only figures from one run compare. The
first client listed fills the top-level entries; each client's own figures are under
``clients``, and ``gc`` counts the collector's pauses inside each measured window.

``--floor`` adds the loopback floor: a blocking raw-socket client that connects, writes the
same 15 KB request and reads a one-byte answer from a raw-socket server process, paced at the
same rate. Its round trip is what the kernel and the scheduler take without any HTTP or event
loop, so an overhead p99 near the floor's p99 is scheduler wake-up latency, not client code.

    python benchmarks/bench_client_overhead.py [--requests 2000] [--output-tokens 16]
        [--client lean,aiohttp] [--rounds 2] [--servers canned] [--floor] [--json PATH]

It prints one line per server and client and writes every figure to --json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvroute.bench.client import (  # the private helpers: the reference client records alike
    WORKER_HEADER,
    BenchClient,
    StreamResult,
    _error_message,
    _record,
    read_sse,
    run_closed_loop,
    run_open_loop,
)
from kvroute.bench.prompts import (
    BenchRequest,
    PromptEncoder,
    poisson_schedule,
    reference_workload,
)
from kvroute.records import RequestRecord
from kvroute.workers import free_ports
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
                    log.clear()  # each dump covers the requests since the previous one
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


# -- the loopback floor (run as a subprocess: this file with --serve-floor PORT SIZE) ----------


def _serve_floor(port: int, size: int) -> None:
    """Accept, read ``size`` bytes, answer one byte, close: no HTTP, no event loop."""
    listener = socket.create_server(("127.0.0.1", port), backlog=4096)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        got = 0
        while got < size:
            data = conn.recv(size - got)
            if not data:
                break
            got += len(data)
        conn.sendall(b"x")
        conn.close()


def _floor(port: int, payload: bytes, n: int, rate: float) -> list[float]:
    """Round trips (connect, write ``payload``, read the answer) of a blocking client, paced
    at ``rate`` like the open loop."""
    schedule = poisson_schedule(n, rate, 0).tolist()
    out = []
    start = time.perf_counter()
    for offset in schedule:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(payload)
            sock.recv(1)
            out.append(time.perf_counter() - t0)
    return out


# -- the reference client: the aiohttp client that BenchClient replaced --------------------------


class AiohttpClient:
    """``BenchClient``'s API and record rules on aiohttp (a ``ClientSession`` with
    ``TCPConnector(force_close=True)``), as the product's client was before the lean one."""

    def __init__(self, url: str, keep_alive: bool = False, timeout_s: float = 600.0) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        connector = aiohttp.TCPConnector(force_close=not keep_alive, limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=self.timeout,
            headers={"Content-Type": "application/json"}, skip_auto_headers=("User-Agent",),
        )

    async def __aenter__(self) -> AiohttpClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def send(self, request: BenchRequest, window_start: float) -> RequestRecord:
        clock = time.perf_counter
        sent = clock()
        result = StreamResult()
        status = 0
        worker = None
        try:
            async with self.session.post(self.url + request.path, data=request.body) as resp:
                status = resp.status
                worker = resp.headers.get(WORKER_HEADER)
                if status != 200:
                    result.error = f"HTTP {status}: {_error_message(await resp.read())}"
                else:
                    await read_sse(resp.content, result)
                    if not result.done and result.error is None:
                        result.error = "stream ended without [DONE]"
        except TimeoutError:
            result.error = f"timed out after {self.timeout.total:g} s"
        except (self._aiohttp.ClientError, OSError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
        return _record(request, sent - window_start, sent, clock(), status, worker, result)


CLIENTS = {"lean": BenchClient, "aiohttp": AiohttpClient}


class _GcWatch:
    """The collector's pauses while active (gc.callbacks): how many per generation, the
    longest, and their total, from a given time on (the measured window's start: the full
    collection that the load generator makes before it is not inside the window)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float, float]] = []  # generation, start, duration
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], self._t0, time.perf_counter() - self._t0))

    def __enter__(self) -> _GcWatch:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self, since: float) -> dict:
        pauses = [(g, d) for g, t, d in self.pauses if t >= since]
        return {
            "collections_by_generation": [sum(g == k for g, _ in pauses) for k in range(3)],
            "max_pause_ms": max((d for _, d in pauses), default=0.0) * 1e3,
            "total_pause_ms": sum(d for _, d in pauses) * 1e3,
        }


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


async def _open_loop(client_cls, url: str, requests, rate: float) -> tuple[list, float, dict]:
    records = []
    async with client_cls(url) as client:
        with _GcWatch() as watch:
            start = await run_open_loop(client, requests, poisson_schedule(len(requests), rate, 0).tolist(), records.append)
    return records, start, watch.summary(since=start)


async def _max_rate(client_cls, url: str, requests, concurrency: int) -> tuple[float, float, int]:
    """(requests/s, client CPU share, failures) of a closed loop at ``concurrency``."""
    records = []
    cpu0, t0 = time.process_time(), time.perf_counter()
    async with client_cls(url) as client:
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


def _overhead_entry(runs: list[tuple]) -> dict:
    """Pooled figures of one client's open-loop windows (``runs``: records, start, gc
    summary, load, and the canned server's stamps of that window or None)."""
    ttft, overhead, before, window_p99 = [], [], [], []
    failed = 0
    for records, start, _, _, stamps in runs:
        ttft += [r.ttft_s for r in records if r.ok]
        failed += sum(not r.ok for r in records)
        if stamps is None:
            continue
        # Client overhead = client TTFT minus the server's own time (read → first write).
        joined = [r for r in records if r.ok and r.index in stamps]
        window = [r.ttft_s - (stamps[r.index][1] - stamps[r.index][0]) for r in joined]
        overhead += window
        window_p99.append(_pct(window, 99) * 1e3)
        # Where it goes: before the server has the request (connect, write), and after its
        # first write (loopback, the client's read, parse and wake-up).
        before += [stamps[r.index][0] - (start + r.send_time) for r in joined]
    entry = {"failed": failed, "ttft_p50_ms": _pct(ttft, 50) * 1e3, "ttft_p99_ms": _pct(ttft, 99) * 1e3,
             "load_1min": [run[3] for run in runs]}
    if runs[0][4] is not None:
        entry.update(overhead_p50_ms=_pct(overhead, 50) * 1e3, overhead_p99_ms=_pct(overhead, 99) * 1e3,
                     until_received_p50_ms=_pct(before, 50) * 1e3, until_received_p99_ms=_pct(before, 99) * 1e3,
                     joined=len(overhead), overhead_p99_ms_by_window=window_p99)
    entry["gc"] = [run[2] for run in runs]
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-canned", nargs=2, type=int, metavar=("PORT", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-floor", nargs=2, type=int, metavar=("PORT", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=2000, help="requests per measurement (default %(default)s)")
    parser.add_argument("--rate", type=float, default=200.0, help="open-loop rate for the overhead (default %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=16, help="streamed chunks per response (default %(default)s)")
    parser.add_argument("--concurrency", default="16,64,256", help="closed-loop levels for the max rate")
    parser.add_argument("--client", default="lean,aiohttp",
                        help="clients to compare, the first fills the top-level entries (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=1, help="alternations of the clients (default %(default)s)")
    parser.add_argument("--servers", default="canned,emulator", help="servers to measure against")
    parser.add_argument("--floor", action="store_true", help="also measure the raw-socket loopback floor")
    parser.add_argument("--json", type=Path, default=Path("bench_client_overhead.json"), metavar="PATH",
                        help="where every figure is written as JSON (default %(default)s)")
    args = parser.parse_args()
    if args.serve_canned:
        _run(_serve_canned(*args.serve_canned))
        return
    if args.serve_floor:
        _serve_floor(*args.serve_floor)
        return

    clients = args.client.split(",")
    unknown = set(clients) - set(CLIENTS)
    if unknown:
        parser.error(f"unknown client(s) {sorted(unknown)}; choose from {sorted(CLIENTS)}")
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict = {"requests": args.requests, "output_tokens": args.output_tokens, "rate": args.rate,
                     "clients": clients}
    servers = {}
    floor_proc = None
    try:
        names = args.servers.split(",")
        if "canned" in names:
            (port,) = free_ports(1)
            servers["canned"] = (subprocess.Popen(
                [sys.executable, __file__, "--serve-canned", str(port), str(args.output_tokens)]), port)
        if "emulator" in names:
            (port,) = free_ports(1)
            servers["emulator"] = (subprocess.Popen(
                [sys.executable, "-m", "kvroute", "emulate", "--port", str(port), "--timing", "instant",
                 "--enable-prompt-tokens-details", "--served-model-name", "m"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port)
        if args.floor:
            payload = _requests(1, args.output_tokens, tag_index=False)[0].body
            (port,) = free_ports(1)
            servers["floor"] = (subprocess.Popen(
                [sys.executable, __file__, "--serve-floor", str(port), str(len(payload))]), port)
            floor_proc = servers["floor"][0]
        for _, port in servers.values():
            _wait_port(port)

        floor_port = servers.pop("floor")[1] if args.floor else None
        floor_trips: list[float] = []
        floor_load: list[list[float]] = []
        floor_p99: list[float] = []
        if floor_port is not None:
            _floor(floor_port, payload, 50, args.rate)  # warm up
        print(_header(), flush=True)
        for name, (_, port) in servers.items():
            url = f"http://127.0.0.1:{port}"
            requests = _requests(args.requests, args.output_tokens, tag_index=name == "canned")
            runs: dict[str, list] = {c: [] for c in clients}
            for c in clients:
                _run(_open_loop(CLIENTS[c], url, requests[:50], args.rate))  # warm both processes up
            # The floor takes its turn in the first server's rounds, beside the clients.
            turns = clients + ["floor"] if floor_port is not None and not floor_trips else clients
            for round_ in range(args.rounds):
                for c in turns if round_ % 2 == 0 else turns[::-1]:
                    if c == "floor":
                        load = os.getloadavg()[0]
                        trips = _floor(floor_port, payload, args.requests, args.rate)
                        floor_trips += trips
                        floor_load.append([load, os.getloadavg()[0]])
                        floor_p99.append(_pct(trips, 99) * 1e3)
                        continue
                    if name == "canned":
                        _run(_dump(url))  # forget earlier windows' stamps
                    load = os.getloadavg()[0]
                    records, start, gc_summary = _run(_open_loop(CLIENTS[c], url, requests, args.rate))
                    load_after = os.getloadavg()[0]
                    stamps = _run(_dump(url)) if name == "canned" else None
                    runs[c].append((records, start, gc_summary, [load, load_after], stamps))
            per_client = {}
            for c in clients:
                per_client[c] = _overhead_entry(runs[c])
                per_client[c]["max_rate"] = {}
            for level in levels:
                for c in clients:
                    load = os.getloadavg()[0]
                    rps, cpu, failed = _run(_max_rate(CLIENTS[c], url, requests, level))
                    per_client[c]["max_rate"][level] = {"requests_per_s": rps, "client_cpu": cpu, "failed": failed,
                                                        "load_1min": [load, os.getloadavg()[0]]}
            entry = dict(per_client[clients[0]])
            if len(clients) > 1:
                entry["clients"] = per_client
            results[name] = entry
            for c in clients:
                print(_row(name, c, per_client[c], levels), flush=True)
        if floor_trips:
            results["floor"] = {"round_trip_p50_ms": _pct(floor_trips, 50) * 1e3,
                                "round_trip_p99_ms": _pct(floor_trips, 99) * 1e3, "load_1min": floor_load,
                                "round_trip_p99_ms_by_window": floor_p99}
            print(f"{'floor':9s} {'raw socket':10s} {'':>14s} {'':>14s} "
                  f"{results['floor']['round_trip_p50_ms']:.2f} / {results['floor']['round_trip_p99_ms']:.2f}"
                  " ms round trip", flush=True)
    finally:
        procs = [proc for proc, _ in servers.values()] + ([floor_proc] if floor_proc is not None else [])
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"every figure (per window, load averages, collector pauses): {args.json}")


def _row(server: str, client: str, entry: dict, levels: list[int]) -> str:
    """One line of the summary table: a client against a server."""
    overhead = (f"{entry['overhead_p50_ms']:.2f} / {entry['overhead_p99_ms']:.2f}"
                if "overhead_p50_ms" in entry else "-")
    rates = ", ".join(f"c={level}: {entry['max_rate'][level]['requests_per_s']:.0f}/s" for level in levels)
    failed = f", {entry['failed']} failed" if entry["failed"] else ""
    return (f"{server:9s} {client:10s} {entry['ttft_p50_ms']:6.2f} / {entry['ttft_p99_ms']:6.2f} "
            f"{overhead:>14s} {rates}{failed}")


def _header() -> str:
    return f"{'server':9s} {'client':10s} {'TTFT p50/p99 ms':>15s} {'overhead ms':>14s} most requests/s"


if __name__ == "__main__":
    main()
