"""Reliability runs of the live router: a worker killed and restarted mid-run, and a long soak.

``worker-death`` (issue 9): ``--workers`` emulated workers, each its own ``kvroute emulate``
process (so one can be SIGKILLed), KV events over ``ipc://`` sockets (a restarted worker binds
the same ones), the router in this process (``start_router``, kv-aware, events on) and
``--requests`` requests at ``--concurrency``: token-id prompts over ``--prefixes`` shared
prefixes, half streamed. After ``--kill-at`` of the requests one worker is SIGKILLed (its
``/metrics`` read just before), and ``--down`` seconds later started again on the same port.
Every request is classified by the client:

* ``ok``: 200 and a complete answer (a stream ends with ``[DONE]``, a body has all its tokens);
* ``clean error``: a stream ending in an SSE error event without ``[DONE]``, or a JSON 5xx;
* ``bad``: anything else (a truncated stream without error, a hang, garbage). Must be 0.

Nothing lost or duplicated is checked at the workers: each worker's
``vllm:request_success_total`` must equal the client's ``ok`` answers naming it (the killed
worker's first life is compared with the scrape taken just before the kill). The restart is
followed from the router's side: its first KV events after the restart, the first request the
kv-aware policy sends it that hits its rebuilt cache (``cached_tokens`` > 0), and its share of
requests afterwards. With ``--stop-for S`` another worker is SIGSTOPped at the kill for S
seconds (a hung process, not a dead one: its connections stay open) and then SIGCONTed; its
requests must end as ``ok`` or ``clean`` too, within the router's timeouts, and the slowest
request of the run is reported. ``--all-streamed`` streams every request (default: half).

``soak``: ``--requests`` short requests (random 64-token prompts: every prefix new, so the
predicted index churns) through ``kvroute serve`` as a child process against ``instant``
emulated workers; the router's RSS and open file descriptors (``/proc/<pid>``) and its index
size (``/metrics``) sampled after a warm-up and every tenth of the run. Predicted mode by
default (the mode that could grow without bound); ``--events`` feeds the index from the
workers' KV events instead.

    python benchmarks/soak.py worker-death [--requests 20000] [--concurrency 32]
    python benchmarks/soak.py worker-death --requests 2000 --concurrency 12 --stop-for 20 --all-streamed
    python benchmarks/soak.py soak [--requests 1000000] [--concurrency 32] [--events]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from kvroute import aio
from kvroute.router import (
    WORKER_HEADER,
    EventsSettings,
    EventsSource,
    RouterConfig,
    start_router,
)
from kvroute.workers import cpu_seconds, launch_emulated

BLOCK = 16
_WORKER_LINE = re.compile(r"worker 0: (http://\S+?)/v1\b")
_SUCCESS = re.compile(r'^vllm:request_success_total\{[^}]*\} (\S+)$', re.MULTILINE)


# --- emulated workers, one process each ------------------------------------------------------


@dataclass
class WorkerProcess:
    """One ``kvroute emulate --workers 1`` child; ``restart`` brings it back on the same port
    and the same event sockets (a new engine: event sequence from 0, empty cache)."""

    events: str
    replay: str
    emulate_args: list[str]
    url: str = ""
    proc: asyncio.subprocess.Process | None = None
    log: list[str] = field(default_factory=list)

    async def start(self, port: int = 0) -> None:
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": self.events, "replay_endpoint": self.replay}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvroute", "emulate", "--workers", "1", "--host", "127.0.0.1",
            "--port", str(port), "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(config), *self.emulate_args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
            if not line:
                raise RuntimeError("kvroute emulate exited: " + " | ".join(self.log[-3:]))
            text = line.decode(errors="replace").rstrip()
            self.log.append(text)
            if m := _WORKER_LINE.search(text):
                self.url = m.group(1)
                break
        asyncio.get_running_loop().create_task(self._drain(self.proc))

    async def _drain(self, proc: asyncio.subprocess.Process) -> None:
        while line := await proc.stdout.readline():
            self.log.append(line.decode(errors="replace").rstrip())
            del self.log[:-50]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    async def restart(self) -> None:
        await self.proc.wait()
        await self.start(self.port)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def successes(session: aiohttp.ClientSession, url: str) -> int:
    """A worker's ``vllm:request_success_total``, all finish reasons."""
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    return int(sum(float(v) for v in _SUCCESS.findall(text)))


# --- the client ------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # ok | clean | bad
    worker: str | None
    sent: float
    done: float
    cached_tokens: int = 0
    detail: str = ""


async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, stream: bool
) -> Outcome:
    """Send one completion and classify what came back (never raises)."""
    body: dict = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    sent = time.monotonic()
    worker = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            worker = r.headers.get(WORKER_HEADER)
            raw = await r.read()
        done = time.monotonic()
        if r.status != 200:
            try:
                error = json.loads(raw)["error"]
                kind = "clean" if r.status >= 500 and error.get("message") else "bad"
            except (ValueError, KeyError, TypeError):
                kind = "bad"
            return Outcome(kind, worker, sent, done, detail=f"status {r.status}: {raw[:200]!r}")
        if not stream:
            usage = json.loads(raw)["usage"]
            if usage["completion_tokens"] != max_tokens:
                return Outcome("bad", worker, sent, done, detail=f"short body: {usage}")
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            return Outcome("ok", worker, sent, done, cached)
        events = [e for e in raw.split(b"\n\n") if e.strip()]
        payloads = [e.removeprefix(b"data: ") for e in events]
        if payloads and payloads[-1] == b"[DONE]":
            usage = json.loads(payloads[-2]).get("usage") or {}
            if usage.get("completion_tokens") != max_tokens:
                return Outcome("bad", worker, sent, done, detail=f"short stream: {usage}")
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            return Outcome("ok", worker, sent, done, cached)
        if payloads and b'"error"' in payloads[-1] and json.loads(payloads[-1]).get("error"):
            return Outcome("clean", worker, sent, done, detail="stream ended with an error event")
        return Outcome("bad", worker, sent, done, detail=f"truncated stream: {raw[-200:]!r}")
    # Anything the client sees is an outcome to count, never a crash of the benchmark.
    except Exception as exc:  # noqa: BLE001
        return Outcome("bad", worker, sent, time.monotonic(), detail=f"{type(exc).__name__}: {exc}")


# --- worker death ----------------------------------------------------------------------------


@dataclass
class DeathResult:
    """What ``run_worker_death`` saw (figures in seconds on the monotonic clock)."""

    requests: int
    outcomes: Counter
    bad_details: list[str]
    seconds: float
    retries: int
    victim: str
    # worker name -> (client ok answers, worker-side successes)
    counts: dict[str, tuple[int, int]]
    # the killed worker's first life: client ok answers, successes scraped just before the kill
    victim_first_life: tuple[int, int]
    engine_restarts: int
    victim_index_blocks: int
    restart_to_first_event_s: float | None
    first_event_to_kv_hit_s: float | None
    victim_share_after: float
    victim_hit_rate_after: float
    others_hit_rate: float
    clean_errors_on_victim: int
    restart_to_first_ok_s: float | None = None
    slowest_request_s: float = 0.0
    # the SIGSTOPped worker (``--stop-for``): its name, seconds stopped, ok and clean outcomes
    paused: str | None = None
    paused_s: float = 0.0
    paused_outcomes: tuple[int, int] = (0, 0)

    @property
    def passed(self) -> bool:
        survivors_exact = all(ok == served for ok, served in self.counts.values())
        first_ok, first_scraped = self.victim_first_life
        return (
            self.outcomes["bad"] == 0
            and sum(self.outcomes.values()) == self.requests
            and survivors_exact
            and first_ok >= first_scraped
            and self.first_event_to_kv_hit_s is not None
            and self.first_event_to_kv_hit_s <= 1.0
        )


async def run_worker_death(
    requests: int = 20_000,
    concurrency: int = 32,
    workers: int = 6,
    prefixes: int = 24,
    prefix_blocks: int = 8,
    max_tokens: int = 8,
    kill_at: float = 0.3,
    down_s: float = 3.0,
    health_interval_s: float = 2.0,
    emulate_args: tuple[str, ...] = ("--timing", "reference-gpu", "--time-scale", "0.5"),
    seed: int = 0,
    progress: bool = False,
    stop_s: float = 0.0,
    all_streamed: bool = False,
) -> DeathResult:
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="kvr-death-")
    fleet = [
        WorkerProcess(f"ipc://{tmp}/ev{i}", f"ipc://{tmp}/rp{i}", list(emulate_args))
        for i in range(workers)
    ]
    await asyncio.gather(*(w.start() for w in fleet))
    victim = fleet[rng.randrange(workers)]
    paused = fleet[(fleet.index(victim) + 1) % workers] if stop_s > 0 and workers > 1 else None
    events = EventsSettings(per_worker={w.url: EventsSource(w.events, w.replay) for w in fleet})
    config = RouterConfig(workers=[w.url for w in fleet], policy="kv-aware", seed=seed,
                          events=events, health_interval_s=health_interval_s,
                          threads=os.cpu_count() or 1)
    shared = [[rng.randrange(1000, 30000) for _ in range(prefix_blocks * BLOCK)] for _ in range(prefixes)]
    try:
        async with start_router(config) as router, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
        ) as session:
            await asyncio.sleep(0.3)  # SUB sockets connect
            name = victim.url

            def applied_events() -> float:
                return router.metric("kvroute_router_kv_events_total", worker=name)
            outcomes: list[Outcome] = []
            marks: dict[str, float] = {}
            next_index = 0
            kill_index = int(requests * kill_at)
            killed = asyncio.Event()

            async def client() -> None:
                nonlocal next_index
                while next_index < requests:
                    i = next_index
                    next_index += 1
                    if i == kill_index:
                        killed.set()
                    prompt = rng.choice(shared) + [rng.randrange(1000, 30000) for _ in range(BLOCK)]
                    stream = all_streamed or i % 2 == 0
                    outcomes.append(await one_request(session, router.url, prompt, max_tokens, stream))
                    if progress and len(outcomes) % 2000 == 0:
                        print(f"  {len(outcomes)} requests, {time.monotonic() - started:.1f} s",
                              file=sys.stderr, flush=True)

            async def chaos() -> None:
                await killed.wait()
                async with aiohttp.ClientSession() as s:
                    scraped = await successes(s, name)
                victim.kill()
                marks["kill"] = time.monotonic()
                if progress:
                    print(f"  SIGKILL {name} after {len(outcomes)} requests, "
                          f"{marks['kill'] - started:.1f} s", file=sys.stderr, flush=True)
                marks["scraped"] = scraped
                if paused is not None:
                    paused.pause()
                    marks["pause"] = time.monotonic()

                    async def resume_later() -> None:
                        await asyncio.sleep(stop_s)
                        paused.resume()
                        marks["resume"] = time.monotonic()
                        if progress:
                            print(f"  SIGCONT {paused.url} after {stop_s:g} s", file=sys.stderr, flush=True)

                    resumer = asyncio.ensure_future(resume_later())
                    if progress:
                        print(f"  SIGSTOP {paused.url}", file=sys.stderr, flush=True)
                await asyncio.sleep(down_s)
                before = applied_events()
                marks["restarting"] = time.monotonic()  # dead until now: what follows is its second life
                await victim.restart()
                marks["restart"] = time.monotonic()
                if progress:
                    print(f"  restarted after {len(outcomes)} requests", file=sys.stderr, flush=True)
                while applied_events() == before and next_index < requests:
                    await asyncio.sleep(0.002)
                if applied_events() != before:
                    marks["first_event"] = time.monotonic()
                if paused is not None:
                    await resumer

            started = time.monotonic()
            chaos_task = asyncio.ensure_future(chaos())
            await asyncio.gather(*(client() for _ in range(concurrency)))
            seconds = time.monotonic() - started
            await asyncio.wait_for(chaos_task, 30)
            counts = {}
            for w in fleet:
                served = await successes(session, w.url)
                # The victim's second life from its restart's start, not from the kill: it is
                # dead in between, so an answer the client finished then was served before the
                # kill (the client's timestamp lags the worker's own count by milliseconds).
                ok = sum(1 for o in outcomes if o.kind == "ok" and o.worker == w.url
                         and (w is not victim or o.done > marks["restarting"]))
                counts[w.url] = (ok, served)
            first_ok = sum(1 for o in outcomes if o.kind == "ok" and o.worker == name and o.done <= marks["restarting"])
            first_event = marks.get("first_event", float("inf"))
            after = [o for o in outcomes if o.kind == "ok" and o.sent >= first_event]
            on_victim = [o for o in after if o.worker == name]
            back = [o.done for o in outcomes if o.kind == "ok" and o.worker == name and o.sent >= marks["restart"]]
            on_paused = [o for o in outcomes if paused is not None and o.worker == paused.url
                         and o.sent < marks.get("resume", 0.0) and o.done > marks.get("pause", 0.0)]
            hits = sorted(o.sent for o in on_victim if o.cached_tokens >= BLOCK)
            others = [o for o in after if o.worker != name]
            return DeathResult(
                requests=requests,
                outcomes=Counter(o.kind for o in outcomes),
                bad_details=[o.detail for o in outcomes if o.kind == "bad"][:5],
                seconds=seconds,
                retries=int(router.metric("kvroute_router_retries_total")),
                victim=name,
                counts=counts,
                victim_first_life=(first_ok, marks["scraped"]),
                engine_restarts=int(router.metric("kvroute_router_engine_restarts_total", worker=name)),
                victim_index_blocks=router.index.worker_blocks(name),
                restart_to_first_event_s=first_event - marks["restart"] if "first_event" in marks else None,
                first_event_to_kv_hit_s=max(hits[0] - first_event, 0.0) if hits else None,
                victim_share_after=len(on_victim) / max(len(after), 1),
                victim_hit_rate_after=sum(o.cached_tokens >= BLOCK for o in on_victim) / max(len(on_victim), 1),
                others_hit_rate=sum(o.cached_tokens >= BLOCK for o in others) / max(len(others), 1),
                clean_errors_on_victim=sum(1 for o in outcomes if o.kind == "clean" and o.worker == name),
                restart_to_first_ok_s=min(back) - marks["restart"] if back else None,
                slowest_request_s=max((o.done - o.sent for o in outcomes), default=0.0),
                paused=paused.url if paused is not None else None,
                paused_s=marks["resume"] - marks["pause"] if paused is not None else 0.0,
                paused_outcomes=(sum(o.kind == "ok" for o in on_paused), sum(o.kind == "clean" for o in on_paused)),
            )
    finally:
        await asyncio.gather(*(w.stop() for w in fleet))
        shutil.rmtree(tmp, ignore_errors=True)


def print_death(r: DeathResult) -> None:
    print(f"worker death: {r.requests} requests in {r.seconds:.1f} s ({r.requests / r.seconds:.0f}/s)")
    print(f"  outcomes: ok {r.outcomes['ok']}, clean errors {r.outcomes['clean']} "
          f"({r.clean_errors_on_victim} on the killed worker), bad {r.outcomes['bad']}")
    for d in r.bad_details:
        print(f"    bad: {d}")
    print(f"  retried before the first byte: {r.retries}")
    print(f"  killed worker {r.victim}: first life ok answers {r.victim_first_life[0]}, "
          f"its success counter just before SIGKILL {r.victim_first_life[1]}")
    for name, (ok, served) in r.counts.items():
        flag = "" if ok == served else "   MISMATCH"
        label = " (restarted)" if name == r.victim else ""
        print(f"  {name}{label}: client ok {ok}, worker successes {served}{flag}")
    print(f"  engine restarts seen by the router: {r.engine_restarts}; "
          f"index blocks for it at the end: {r.victim_index_blocks}")
    gap = "never" if r.restart_to_first_event_s is None else f"{r.restart_to_first_event_s:.3f} s"
    print(f"  restart -> first KV events applied: {gap}")
    hit = "never" if r.first_event_to_kv_hit_s is None else f"{r.first_event_to_kv_hit_s:.3f} s"
    print(f"  first KV events -> first kv-aware hit routed to it: {hit}")
    print(f"  after its first events: {r.victim_share_after:.1%} of requests went to it, "
          f"request hit rate there {r.victim_hit_rate_after:.1%} (others {r.others_hit_rate:.1%})")
    back = "never" if r.restart_to_first_ok_s is None else f"{r.restart_to_first_ok_s:.3f} s"
    print(f"  restart -> its first complete answer: {back}")
    if r.paused is not None:
        ok, clean = r.paused_outcomes
        print(f"  SIGSTOPped worker {r.paused} for {r.paused_s:.1f} s: requests in flight across the stop "
              f"ended ok {ok}, clean error {clean}")
    print(f"  slowest request of the run: {r.slowest_request_s:.1f} s")
    print("  PASS" if r.passed else "  FAIL")


# --- soak ------------------------------------------------------------------------------------


def proc_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def router_index(session: aiohttp.ClientSession, url: str) -> tuple[int, int]:
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    values = {}
    for name in ("kvroute_router_index_predicted_entries", "kvroute_router_index_blocks"):
        m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        values[name] = int(float(m.group(1)))
    return values["kvroute_router_index_predicted_entries"], values["kvroute_router_index_blocks"]


_EVENTS_LINE = re.compile(r"worker \d+: (http://\S+?)/v1\s+kv-events (\S+) \(replay (\S+)\)")


async def run_soak(
    requests: int, concurrency: int, workers: int, samples: int, seed: int, events: bool = False
) -> bool:
    """The soak; ``events``: workers publish KV events (index fed by them, predictions TTL'd)
    instead of predicted mode alone (predictions LRU-bounded per worker)."""
    rng = random.Random(seed)
    emulate = ["--timing", "instant", "--max-model-len", "1024"]
    if events:
        emulate += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})]
    fleet = await launch_emulated(workers, emulate)
    router_args = [a for u in fleet.urls for a in ("--worker", u)]
    if events:
        for m in filter(None, map(_EVENTS_LINE.search, fleet.log)):
            router_args += ["--kv-events", f"{m.group(1)}={m.group(2)},{m.group(3)}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    router = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute", "serve", "--port", "0", "--policy", "kv-aware", *router_args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )
    try:
        line = (await asyncio.wait_for(router.stdout.readline(), 30)).decode()
        url = line.split("listening on ")[1].split(",")[0]
        asyncio.get_running_loop().create_task(_discard(router.stdout))
        errors = Counter()
        done = 0

        async def batch(session: aiohttp.ClientSession, n: int) -> None:
            nonlocal done
            remaining = n

            async def client() -> None:
                nonlocal remaining, done
                while remaining > 0:
                    remaining -= 1
                    prompt = [rng.randrange(1000, 30000) for _ in range(4 * BLOCK)]
                    stream = rng.random() < 0.25
                    o = await one_request(session, url, prompt, 1, stream)
                    done += 1
                    if o.kind != "ok":
                        errors[o.detail[:80]] += 1

            await asyncio.gather(*(client() for _ in range(concurrency)))

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            warmup = min(max(requests // 20, 2000), requests)
            await batch(session, warmup)
            rss0, fds0 = proc_rss_bytes(router.pid), proc_fds(router.pid)
            cpu0 = cpu_seconds(router.pid)
            pred0, blocks0 = await router_index(session, url)
            mode = "KV events" if events else "predicted mode"
            print(f"soak: {requests} requests, concurrency {concurrency}, {workers} instant workers, {mode}")
            print(f"  after warm-up ({warmup}): router RSS {rss0 / 2**20:.1f} MiB, fds {fds0}, "
                  f"index: predicted {pred0}, event-backed {blocks0}")
            print(f"  {'requests':>9} {'req/s':>7} {'RSS MiB':>8} {'fds':>5} {'predicted':>10} "
                  f"{'events':>7} {'errors':>7}")
            rest = requests - warmup
            step = max(rest // samples, 1)
            started = time.monotonic()
            peak_pred, peak_blocks = pred0, blocks0
            fds_first = None
            while done < requests:
                n = min(step, requests - done)
                t0 = time.monotonic()
                await batch(session, n)
                rate = n / (time.monotonic() - t0)
                rss, fds = proc_rss_bytes(router.pid), proc_fds(router.pid)
                fds_first = fds if fds_first is None else fds_first
                pred, blocks = await router_index(session, url)
                peak_pred, peak_blocks = max(peak_pred, pred), max(peak_blocks, blocks)
                print(f"  {done:>9} {rate:>7.0f} {rss / 2**20:>8.1f} {fds:>5} {pred:>10} {blocks:>7} "
                      f"{sum(errors.values()):>7}", flush=True)
            seconds = time.monotonic() - started
            cpu = cpu_seconds(router.pid) - cpu0
            rss1, fds1 = proc_rss_bytes(router.pid), proc_fds(router.pid)
        growth = rss1 / rss0 - 1
        # Each worker's cache holds 585 blocks: the event-backed entries can never exceed
        # that; predicted entries are LRU-capped at it without events, TTL-bounded with them.
        bound = workers * 585
        # Connection pools may still grow a little after the warm-up; a leak keeps growing
        # with the requests, so the last count is held to the first sample's.
        ok = growth <= 0.10 and fds1 <= max(fds0, fds_first) and not errors and (peak_blocks if events else peak_pred) <= bound
        print(f"  measured part: {rest} requests in {seconds:.0f} s = {rest / seconds:.0f} req/s "
              f"(1,000,000 would take {1e6 / (rest / seconds) / 60:.1f} min); router CPU "
              f"{cpu / rest * 1e6:.0f} us/request")
        print(f"  RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB ({growth:+.1%}), "
              f"fds {fds0} -> {fds_first} (first sample) -> {fds1}, peak index entries: predicted {peak_pred}, event-backed "
              f"{peak_blocks} (bound {bound} = {workers} workers x 585 blocks), errors {dict(errors) or 0}")
        print("  PASS" if ok else "  FAIL")
        return ok
    finally:
        if router.returncode is None:
            router.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(router.wait(), 40)
            except TimeoutError:
                router.kill()
        await fleet.close()


async def _discard(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    death = sub.add_parser("worker-death", help="SIGKILL one worker mid-run, then restart it")
    death.add_argument("--requests", type=int, default=20_000)
    death.add_argument("--concurrency", type=int, default=32)
    death.add_argument("--workers", type=int, default=6)
    death.add_argument("--kill-at", type=float, default=0.3, help="fraction of the requests sent before the kill")
    death.add_argument("--down", type=float, default=3.0, help="seconds the worker stays dead")
    death.add_argument("--health-interval", type=float, default=2.0)
    death.add_argument("--seed", type=int, default=0)
    death.add_argument("--stop-for", type=float, default=0.0, metavar="S",
                       help="also SIGSTOP another worker at the kill, for S seconds (default: none)")
    death.add_argument("--all-streamed", action="store_true", help="stream every request (default: half)")
    soak = sub.add_parser("soak", help="many short requests: RSS, fds and index size must stay flat")
    soak.add_argument("--requests", type=int, default=1_000_000)
    soak.add_argument("--concurrency", type=int, default=32)
    soak.add_argument("--workers", type=int, default=2)
    soak.add_argument("--samples", type=int, default=10)
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--events", action="store_true",
                      help="workers publish KV events (default: predicted mode, the unbounded-growth risk)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "worker-death":
        result = aio.run(run_worker_death(
            args.requests, args.concurrency, args.workers, kill_at=args.kill_at, down_s=args.down,
            health_interval_s=args.health_interval, seed=args.seed, progress=True,
            stop_s=args.stop_for, all_streamed=args.all_streamed,
        ))
        print_death(result)
        return 0 if result.passed else 1
    ok = aio.run(run_soak(args.requests, args.concurrency, args.workers, args.samples, args.seed, args.events))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
