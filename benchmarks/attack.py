"""The router against an attacker: hostile inputs, slow connections, memory, a stopped worker,
descriptor exhaustion (issue 16's attack run, reproduced on loopback).

Starts emulated workers (one ``kvroute emulate`` process each, so that one can be stopped)
and ``kvroute serve`` in front of them, then prints:

1. for each hostile input, the statuses it got; 5xx answers and tracebacks in the router's
   log (both must be 0);
2. ``/health`` latency (p50/p99, fresh connection per probe) while a 50 MB chat request and
   2,000 slow-header connections are in flight, and how long the router held those;
3. the router's RSS before and after 400 distinct 1 MB prompts;
4. how long a stream to a SIGSTOPped worker takes to end with an SSE error event;
5. what a valid client sees while 1,100 slow connections are open against a router started
   under RLIMIT_NOFILE 1024 (answered 200, answered 503, failed silently);
6. the router's RSS while 32 clients each hold a chunked 32 MB body all but sent, with
   ``--max-buffered-body-bytes 256MiB`` (the rest get 503) and with a budget too large to matter;
7. the router's RSS while 32 clients each ask for a 32 MB non-streamed answer (logprobs of a
   long generation run to megabytes; here a worker of this script's) and read none of it;
8. part 1's inputs sent through a real Envoy to ``kvroute epp`` (the Inference Gateway), each
   status beside serve's, whether the EPP survived, and ``/health`` through the gateway while
   a 50 MB chat request is read by the EPP (``--gateway-only``: parts 1 and 8 alone).

    python benchmarks/attack.py                      # the whole run (~4 min)
    python benchmarks/attack.py --slow 500 --prompts 100   # quicker

The router runs with its defaults, except ``--stream-idle-timeout`` (``--idle-timeout``,
default 5 s, so that part takes seconds, not the default's 300 s).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import re
import resource
import signal
import statistics
import sys
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import TextIO

from kvroute.gateway import free_port, run_envoy
from kvroute.workers import launch_emulated

ROUTER_LINE = re.compile(r"listening on (http://\S+),")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class KvrouteProcess:
    """A ``kvroute`` process under attack: its stderr goes to ``log``; stopped as an operator
    would (SIGTERM, then SIGKILL after 20 s)."""

    proc: asyncio.subprocess.Process
    log: Path
    log_file: TextIO

    async def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        self.log_file.close()

    def tracebacks(self) -> int:
        """Python tracebacks the process wrote to its log."""
        return self.log.read_text(errors="replace").count("Traceback")


class RouterProcess(KvrouteProcess):
    def __init__(self, workers: list[str], extra: list[str], log: Path, nofile: int | None = None) -> None:
        self.workers, self.extra, self.log, self.nofile = workers, extra, log, nofile

    async def __aenter__(self) -> RouterProcess:
        cmd = [sys.executable, "-m", "kvroute", "serve", "--port", "0", "--host", "127.0.0.1",
               "--policy", "round-robin", *self.extra]
        for url in self.workers:
            cmd += ["--worker", url]
        nofile = self.nofile

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.log_file = self.log.open("w")
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=self.log_file, preexec_fn=limit,  # noqa: PLW1509
        )
        line = (await asyncio.wait_for(self.proc.stdout.readline(), 60)).decode()
        match = ROUTER_LINE.search(line)
        if not match:
            raise SystemExit(f"router did not start: {line!r} {self.log.read_text()[-2000:]}")
        self.url = match.group(1)
        self.host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        await asyncio.sleep(0.3)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def send(host: str, port: int, data: bytes, timeout: float = 30.0) -> int:
    """Send raw bytes (as fast as the router reads them); the answer's status (0: none)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):
        return 0
    try:
        async def upload() -> None:
            view = memoryview(data)
            for start in range(0, len(view), 1 << 20):
                writer.write(view[start:start + (1 << 20)])
                await writer.drain()

        up = asyncio.ensure_future(upload())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout)
        up.cancel()
        return int(head.split(b" ", 2)[1])
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
        return 0
    finally:
        writer.close()


def post(path: bytes, body: bytes, *headers: bytes, length: int | None = None) -> bytes:
    head = [b"POST " + path + b" HTTP/1.1", b"Host: r", b"Connection: close", b"Content-Type: application/json",
            b"Content-Length: " + str(len(body) if length is None else length).encode(), *headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def hostile_inputs() -> dict[str, bytes]:
    plain = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode()
    deflated = zlib.compress(b'{"prompt": "' + b"a" * 60_000_000 + b'", "max_tokens": 1}', 9)
    big_chat = json.dumps({"messages": [{"role": "user", "content": "word " * 10_000_000}], "max_tokens": 1}).encode()
    cases = {
        "JSON nested 981 deep": post(b"/v1/completions", b'{"prompt": [1], "x": ' + b"[" * 981 + b"]" * 981 + b"}"),
        "JSON nested 100k deep": post(b"/v1/completions", b'{"prompt": [1], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "objects nested 5000 deep": post(b"/v1/chat/completions", b'{"messages": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"),
        "gzip header, plain body": post(b"/v1/completions", plain, b"Content-Encoding: gzip"),
        "gzip body": post(b"/v1/completions", gzip.compress(plain), b"Content-Encoding: gzip"),
        f"deflate bomb ({len(deflated) // 1000} KB -> 60 MB)": post(b"/v1/completions", deflated, b"Content-Encoding: deflate"),
        "declared 25M-token-id prompt (200 MB)": post(b"/v1/completions", b'{"prompt": [1', length=200_000_000),
        "chunked body over the limit": (
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nConnection: close\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(
                b"100000\r\n" + b"1" * 0x100000 + b"\r\n" for _ in range(70)) + b"0\r\n\r\n"),
        "50 MB chat message": post(b"/v1/chat/completions", big_chat),
        "invalid UTF-8": post(b"/v1/completions", b'{"prompt": "\xff\xfe"}'),
        "NaN and huge ints": post(b"/v1/completions", b'{"prompt": [NaN, 1e999, 123456789012345678901234567890]}'),
        "ids out of range": post(b"/v1/completions", b'{"prompt": [-1, 4294967296]}'),
        "messages not a list": post(b"/v1/chat/completions", b'{"messages": {"role": "user"}}'),
        "content of nested parts": post(b"/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": [{"type": "text", "text": [[[["x"]]]]}]}]}).encode()),
        "bad request line": b"GET /v1/\x00models HTTP/1.1\r\nHost: r\r\n\r\n",
        "header injection": b"GET /health HTTP/1.1\r\nHost: r\r\nX-A: a\rX-B: b\r\n\r\n",
        "Expect with junk": post(b"/v1/completions", plain, b"Expect: \xff"),
    }
    return cases


async def slow_connection(host: str, port: int, held: list[float], stop: asyncio.Event) -> None:
    """A slowloris client: one header byte a second, until the router closes it."""
    started = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n")
        while not stop.is_set():
            writer.write(b"X")
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1024), 1.0) == b"" or reader.at_eof():
                    break
            except TimeoutError:
                continue
    except OSError:
        pass
    finally:
        held.append(time.monotonic() - started)
        writer.close()


class Slowloris:
    """``n`` slow-header connections from a process of their own (so that the probes this
    process times do not wait behind its 2,000 sockets); ``held()``: how long each was held."""

    def __init__(self, host: str, port: int, n: int) -> None:
        self.args = [sys.executable, __file__, "--slowloris", f"{host}:{port}:{n}"]

    async def __aenter__(self) -> Slowloris:
        self.proc = await asyncio.create_subprocess_exec(*self.args, stdout=asyncio.subprocess.PIPE)
        await self.proc.stdout.readline()  # "open"
        return self

    async def held(self) -> list[float]:
        out, _ = await self.proc.communicate()
        return json.loads(out)

    async def __aexit__(self, *exc: object) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def slowloris_main(spec: str) -> None:
    host, port, n = spec.rsplit(":", 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    stop = asyncio.Event()
    held: list[float] = []
    tasks = [asyncio.ensure_future(slow_connection(host, int(port), held, stop)) for _ in range(int(n))]
    await asyncio.sleep(1.0)
    print("open", flush=True)
    await asyncio.wait(tasks, timeout=60)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps(held), flush=True)


async def probe_health(host: str, port: int, timeout: float = 5.0) -> float | None:
    started = time.perf_counter()
    status = await send(host, port, b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n", timeout)
    return time.perf_counter() - started if status == 200 else None


async def part_hostile(router: RouterProcess) -> None:
    print("\n1. hostile inputs (status counts; 5xx must be 0)")
    before = router.tracebacks()
    five = 0
    for name, data in hostile_inputs().items():
        statuses = Counter([await send(router.host, router.port, data, timeout=60) for _ in range(2)])
        five += sum(n for s, n in statuses.items() if s >= 500)
        print(f"   {name:44s} {dict(statuses)}")
    print(f"   5xx answers: {five}; tracebacks in the router's log: {router.tracebacks() - before}")


async def part_health_under_load(router: RouterProcess, slow: int, what: str, path: bytes, big: bytes) -> None:
    print(f"\n2. /health while {what} and {slow} slow-header connections are in flight")
    async with Slowloris(router.host, router.port, slow) as slowloris:
        await _health_under_load(router, path, big, slowloris)


async def _health_under_load(router: RouterProcess, path: bytes, big: bytes, slowloris: Slowloris) -> None:
    quiet = [await probe_health(router.host, router.port) for _ in range(100)]
    quiet = [q for q in quiet if q is not None]
    print(f"   /health with the slow connections alone: p50 {1e3 * statistics.median(quiet):.1f} ms, "
          f"p99 {1e3 * pct(quiet, 0.99):.1f} ms")
    started = time.monotonic()
    big_task = asyncio.ensure_future(send(router.host, router.port, post(path, big), timeout=120))
    latencies: list[float] = []
    failed = 0
    while not big_task.done() or time.monotonic() - started < 3.0:
        latency = await probe_health(router.host, router.port)
        if latency is None:
            failed += 1
        else:
            latencies.append(latency)
        await asyncio.sleep(0.01)
    big_status = await big_task
    big_s = time.monotonic() - started
    print(f"   {len(big) / 1e6:.0f} MB request: status {big_status} after {big_s:.2f} s; {len(latencies)} /health probes "
          f"meanwhile: p50 {1e3 * statistics.median(latencies):.1f} ms, p99 {1e3 * pct(latencies, 0.99):.1f} ms, "
          f"max {1e3 * max(latencies):.1f} ms, failed {failed}")
    held = await slowloris.held()
    print(f"   slow connections held by the router: median {statistics.median(held):.1f} s, "
          f"max {max(held):.1f} s ({len(held)} closed)")


class EppGateway(KvrouteProcess):
    """``kvroute epp`` (its own process) behind a real Envoy configured as an Inference Gateway
    (``kvroute.gateway``): ``host``/``port`` are Envoy's."""

    def __init__(self, workers: list[str], log: Path) -> None:
        self.workers, self.log = workers, log

    async def __aenter__(self) -> EppGateway:
        grpc = free_port()
        cmd = [sys.executable, "-m", "kvroute", "epp", "--host", "127.0.0.1", "--port", "0",
               "--grpc-port", str(grpc), "--policy", "round-robin"]
        for url in self.workers:
            cmd += ["--worker", url]
        self.log_file = self.log.open("w")
        self.proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=self.log_file)
        line = (await asyncio.wait_for(self.proc.stdout.readline(), 60)).decode()
        if "ext_proc on" not in line:
            raise SystemExit(f"kvroute epp did not start: {line!r} {self.log.read_text()[-2000:]}")
        self._envoy = run_envoy(grpc, log_dir=self.log.parent)
        envoy = await self._envoy.__aenter__()
        self.host, port = envoy.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._envoy.__aexit__(None, None, None)
        await self.stop()


async def part_gateway(router: RouterProcess, workers: list[str], log: Path) -> None:
    """Part 1's inputs sent through Envoy to kvroute epp, beside serve's answers, then /health
    through the gateway while a 50 MB chat request is read and parsed by the EPP."""
    print("\n8. the hostile inputs through Envoy to kvroute epp (status through the gateway, serve's; "
          "the EPP must not crash)")
    async with EppGateway(workers, log) as gateway:
        differ = 0
        for name, data in hostile_inputs().items():
            through = await send(gateway.host, gateway.port, data, timeout=60)
            direct = await send(router.host, router.port, data, timeout=60)
            differ += through != direct
            print(f"   {name:44s} {through} / {direct}")
        alive = gateway.proc.returncode is None
        print(f"   differing statuses: {differ}; EPP alive: {alive}; tracebacks in its log: {gateway.tracebacks()}")
        chat = json.dumps({"messages": [{"role": "user", "content": "word " * 10_000_000}],
                           "max_tokens": 1}).encode()
        started = time.monotonic()
        big_task = asyncio.ensure_future(send(gateway.host, gateway.port, post(b"/v1/chat/completions", chat),
                                              timeout=120))
        latencies: list[float] = []
        while not big_task.done() or time.monotonic() - started < 3.0:
            latency = await probe_health(gateway.host, gateway.port)
            if latency is not None:
                latencies.append(latency)
            await asyncio.sleep(0.01)
        print(f"   50 MB chat through the gateway: status {await big_task} after "
              f"{time.monotonic() - started:.2f} s; {len(latencies)} /health probes through it meanwhile: "
              f"p50 {1e3 * statistics.median(latencies):.1f} ms, p99 {1e3 * pct(latencies, 0.99):.1f} ms")


async def part_memory(router: RouterProcess, prompts: int) -> None:
    print(f"\n3. RSS after {prompts} distinct 1 MB prompts")
    base = rss_mb(router.proc.pid)
    sem = asyncio.Semaphore(4)
    statuses: Counter[int] = Counter()

    async def one(i: int) -> None:
        text = f"{i} " + " ".join(f"t{i}x{j}" for j in range(110_000))  # ~1 MB, distinct
        body = json.dumps({"prompt": text, "max_tokens": 1}).encode()
        async with sem:
            statuses[await send(router.host, router.port, post(b"/v1/completions", body), timeout=120)] += 1

    await asyncio.gather(*(one(i) for i in range(prompts)))
    await asyncio.sleep(1.0)
    print(f"   RSS {base:.0f} MB before, {rss_mb(router.proc.pid):.0f} MB after; statuses {dict(statuses)}")


async def part_stopped_worker(router: RouterProcess, fleets: list, idle: float) -> None:
    print(f"\n4. a stream to a SIGSTOPped worker (--stream-idle-timeout {idle:g})")
    body = json.dumps({"prompt": [7] * 32, "max_tokens": 4000, "stream": True, "ignore_eos": True}).encode()
    reader, writer = await asyncio.open_connection(router.host, router.port)
    writer.write(post(b"/v1/completions", body))
    head = await reader.readuntil(b"\r\n\r\n")
    worker = re.search(rb"x-kvroute-worker: (\S+)", head, re.I).group(1).decode()
    fleet = next(f for f in fleets if f.urls[0] == worker)
    await reader.readuntil(b"\n\n")  # streaming
    os.kill(fleet.process.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    tail = b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), idle + 30)
            if not chunk:
                break
            tail = (tail + chunk)[-4096:]
    except TimeoutError:
        pass
    ended = time.monotonic() - stopped
    os.kill(fleet.process.pid, signal.SIGCONT)
    writer.close()
    error = b'"error"' in tail and b"[DONE]" not in tail
    print(f"   stream ended {ended:.2f} s after SIGSTOP, with an SSE error event: {error}")


async def part_fd_exhaustion(workers: list[str], log: Path, slow: int, probes: int) -> None:
    print(f"\n5. valid clients while {slow} slow connections are open, router under RLIMIT_NOFILE 1024")
    async with RouterProcess(workers, [], log, nofile=1024) as router:
        stop = asyncio.Event()
        held: list[float] = []
        tasks = [asyncio.ensure_future(slow_connection(router.host, router.port, held, stop)) for _ in range(slow)]
        await asyncio.sleep(2.0)
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode()
        outcomes: Counter[int] = Counter()
        for _ in range(probes):
            outcomes[await send(router.host, router.port, post(b"/v1/completions", body), timeout=5)] += 1
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        print(f"   {probes} valid requests: {outcomes[200]} answered 200, {outcomes[503]} answered 503, "
              f"{outcomes[0]} failed silently, others {dict((k, v) for k, v in outcomes.items() if k not in (0, 200, 503))}; "
              f"tracebacks in the log: {router.tracebacks()}")


async def hold_bodies(router: RouterProcess, request: bytes, connections: int) -> tuple[float, float, Counter[int]]:
    """``connections`` clients each send all of ``request`` but its last byte, wait until all
    have (or were answered), then send it. Returns the router's RSS (MB) before and at its
    peak meanwhile, and the statuses the clients got (0: none)."""
    base = rss_mb(router.proc.pid)
    held = asyncio.Event()
    sent = 0
    statuses: Counter[int] = Counter()

    async def one() -> None:
        nonlocal sent
        try:
            reader, writer = await asyncio.open_connection(router.host, router.port)
        except OSError:
            statuses[0] += 1
            return
        try:
            view = memoryview(request)
            for start in range(0, len(view) - 1, 1 << 20):
                writer.write(view[start:min(start + (1 << 20), len(view) - 1)])
                await writer.drain()
            sent += 1
            await held.wait()
            writer.write(view[-1:])
            await writer.drain()
        except (OSError, ConnectionError):
            pass  # answered (503) and closed while sending
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n"), 120)
            statuses[int(head.split(b" ", 2)[1])] += 1
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
            statuses[0] += 1
        finally:
            writer.close()

    tasks = [asyncio.ensure_future(one()) for _ in range(connections)]
    peak = base
    deadline = time.monotonic() + 120
    while sent + sum(statuses.values()) < connections and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        peak = max(peak, rss_mb(router.proc.pid))
    peak = max(peak, rss_mb(router.proc.pid))
    held.set()
    await asyncio.gather(*tasks)
    return base, peak, statuses


async def part_body_budget(workers: list[str], log: Path, connections: int, body_mb: int, budget: str) -> None:
    print(f"\n6. {connections} clients each holding a chunked {body_mb} MB body all but sent, against "
          f"--max-buffered-body-bytes {budget} and against a budget too large to matter")
    # Chunked, as a client streaming its upload sends it (a declared length is read the same way).
    body = b'{"prompt": "' + b"x" * (body_mb << 20) + b'", "max_tokens": 1}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunks = b"".join(f"{len(body[i:i + (1 << 20)]):x}\r\n".encode() + body[i:i + (1 << 20)] + b"\r\n"
                      for i in range(0, len(body), 1 << 20))
    request = head + chunks + b"0\r\n\r\n"
    for label, value in ((budget, budget), ("unbounded", "1TiB")):
        async with RouterProcess(workers, ["--max-buffered-body-bytes", value], log) as router:
            base, peak, statuses = await hold_bodies(router, request, connections)
        print(f"   {label:>9}: router RSS {base:.0f} MB before, {peak:.0f} MB at most with the bodies held "
              f"({connections} x {body_mb} MB sent); statuses {dict(sorted(statuses.items()))}")
    print("   (0: no answer; a 503 reaches a client still sending, since the router reads and discards "
          "the rest of its body before closing)")


async def part_unread_answers(log: Path, connections: int, answer_mb: int) -> None:
    print(f"\n7. {connections} clients each asking for a {answer_mb} MB non-streamed answer and reading none of it")
    from aiohttp import web

    answer = json.dumps({"id": "cmpl-long", "object": "text_completion",
                         "choices": [{"index": 0, "text": "y" * (answer_mb << 20)}]}).encode()

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        if request.path == "/health":
            return web.Response()
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    worker = f"http://127.0.0.1:{runner.addresses[0][1]}"
    writers: list[asyncio.StreamWriter] = []
    try:
        async with RouterProcess([worker], [], log) as router:
            base = rss_mb(router.proc.pid)
            request = post(b"/v1/completions", b'{"prompt": "hello", "max_tokens": 1}')
            for _ in range(connections):
                _, writer = await asyncio.open_connection(router.host, router.port)
                writer.transport.pause_reading()  # reads nothing
                writer.write(request)
                writers.append(writer)
            peak = base
            for _ in range(15):
                await asyncio.sleep(0.2)
                peak = max(peak, rss_mb(router.proc.pid))
            health = await probe_health(router.host, router.port)
            for writer in writers:
                writer.close()
            writers.clear()
            await asyncio.sleep(0.5)
            after = rss_mb(router.proc.pid)
        shown = "no answer" if health is None else f"{1000 * health:.1f} ms"
        print(f"   router RSS {base:.0f} MB before, {peak:.0f} MB at most over 3 s with the answers unread "
              f"({connections} x {answer_mb} MB asked for), {after:.0f} MB once the clients left; "
              f"/health meanwhile: {shown}")
    finally:
        for writer in writers:
            writer.close()
        await runner.cleanup()


async def main(args: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    fleets = [await launch_emulated(1, []) for _ in range(args.workers)]
    workers = [f.urls[0] for f in fleets]
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-attack-"))
    try:
        async with RouterProcess(workers, ["--stream-idle-timeout", str(args.idle_timeout)],
                                 tmp / "router.log") as router:
            print(f"router {router.url} (defaults; pid {router.proc.pid}), {args.workers} emulated workers; "
                  f"log {tmp / 'router.log'}")
            with (tmp / "router.log").open() as f:
                print("   " + "   ".join(f.readlines()[-2:]).rstrip())
            await part_hostile(router)
            if args.gateway_only:
                await part_gateway(router, workers, tmp / "epp.log")
                return
            chat = json.dumps({"messages": [{"role": "user", "content": "word " * 10_000_000}],
                               "max_tokens": 1}).encode()
            await part_health_under_load(router, args.slow, "a 50 MB chat request", b"/v1/chat/completions", chat)
            ids = json.dumps({"prompt": list(range(7_500_000)), "max_tokens": 1}).encode()
            await part_health_under_load(router, args.slow, "a 7.5M-token-id prompt (the most under the "
                                         "64 MiB limit; 25M ids are 200 MB: 413)", b"/v1/completions", ids)
            await part_memory(router, args.prompts)
            await part_stopped_worker(router, fleets, args.idle_timeout)
            print(f"\n   tracebacks in the router's log over parts 1-4: {router.tracebacks()}")
            await part_gateway(router, workers, tmp / "epp.log")
        await part_fd_exhaustion(workers, tmp / "router-1024.log", args.fd_slow, args.probes)
        await part_body_budget(workers, tmp / "router-budget.log", args.big_bodies, args.big_body_mb,
                               args.body_budget)
        await part_unread_answers(tmp / "router-answers.log", args.big_answers, args.big_answer_mb)
    finally:
        for fleet in fleets:
            await fleet.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--slow", type=int, default=2000, help="slow-header connections in part 2")
    parser.add_argument("--prompts", type=int, default=400, help="distinct 1 MB prompts in part 3")
    parser.add_argument("--idle-timeout", type=float, default=5.0, help="the router's --stream-idle-timeout")
    parser.add_argument("--fd-slow", type=int, default=1100, help="slow connections in part 5")
    parser.add_argument("--probes", type=int, default=121, help="valid requests in part 5")
    parser.add_argument("--big-bodies", type=int, default=32, help="clients holding large bodies in part 6")
    parser.add_argument("--big-body-mb", type=int, default=32, help="each one's body in part 6, MB")
    parser.add_argument("--body-budget", default="256MiB", help="the router's --max-buffered-body-bytes in part 6")
    parser.add_argument("--big-answers", type=int, default=32, help="clients not reading their answers in part 7")
    parser.add_argument("--big-answer-mb", type=int, default=32, help="each one's answer in part 7, MB")
    parser.add_argument("--gateway-only", action="store_true",
                        help="parts 1 and 8 only: the hostile inputs to serve and through Envoy to kvroute epp")
    parser.add_argument("--slowloris", metavar="HOST:PORT:N", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.slowloris:
        asyncio.run(slowloris_main(arguments.slowloris))
    else:
        asyncio.run(main(arguments))

