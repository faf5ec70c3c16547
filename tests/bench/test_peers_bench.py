"""benchmarks/peers.py without the peers: arguments, venv reuse, CPU accounting, tables."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import select
import shutil
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web
from support.paths import ROOT

from kvroute.workers import cpu_seconds, cpu_times, free_ports

_PATH = ROOT / "benchmarks" / "peers.py"
_spec = importlib.util.spec_from_file_location("peers_bench", _PATH)
peers = importlib.util.module_from_spec(_spec)
sys.modules["peers_bench"] = peers  # dataclasses resolve their module by name
_spec.loader.exec_module(peers)


def test_arguments_default_to_the_reference_comparison():
    args = peers.parse_args([])
    assert args.router_list == list(peers.DEFAULT_ROUTERS)
    assert "floor" not in args.router_list  # references, measured only on request
    assert "haproxy" not in args.router_list
    assert "gateway" not in args.router_list and "envoy" not in args.router_list  # need Envoy
    assert set(peers.RELAYS) == {"floor", "haproxy", "envoy"} and set(peers.RELAYS) <= set(peers.ROUTERS)
    assert peers.parse_args(["--routers", "floor,kvroute"]).router_list == ["floor", "kvroute"]
    assert (args.prefixes, args.workers, args.levels, args.mode) == (24, 6, [8, 16], "both")


def test_quick_shrinks_every_pass():
    args = peers.parse_args(["--quick", "--routers", "kvroute,sglang"])
    assert args.router_list == ["kvroute", "sglang"]
    assert args.levels == [8] and args.requests == 48 and args.overhead_requests == 24


@pytest.mark.parametrize("argv", [["--routers", "nginx"], ["--concurrency", "0"], ["-c", "x"], ["--rounds", "0"],
                                  ["--zipf", "-1"], ["--prefix-tokens", "9:3"], ["--prefix-tokens", "x"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(argv)
    assert "error" in capsys.readouterr().err


async def test_a_marked_venv_is_reused_without_pip(tmp_path):
    venv = tmp_path / "peers" / "sglang-router"
    venv.mkdir(parents=True)
    (venv / "kvroute-peer.json").write_text(json.dumps({"install_s": 71.5, "versions": {"sglang-router": "0.3.2"}}))
    (venv / "blob").write_bytes(b"x" * 2**20)
    got = await peers.ensure_peer("sglang", tmp_path / "peers")
    assert got.ok and got.reused and got.install_s == 71.5
    assert got.versions == {"sglang-router": "0.3.2"}
    assert got.size_mb == pytest.approx(1.0, abs=0.01)


def test_router_cpu_time_includes_its_children():
    # A parent that sleeps, a child that burns CPU and then says so: once it has, the tree
    # is idle and its time (the child's, mostly) holds still between the readings below.
    child = ("import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass\n"
             "print('burned', flush=True)\ntime.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c",
                             f"import subprocess,sys,time; subprocess.Popen([sys.executable,'-c',{child!r}]); time.sleep(30)"],
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready and proc.stdout.readline() == "burned\n"
        assert cpu_seconds(proc.pid) >= 0.3
        assert cpu_seconds(os.getpid()) > 0
        user, system = cpu_times(proc.pid)  # the same time, split (the child now sleeps)
        assert user > 0 and system >= 0
        assert user + system == pytest.approx(cpu_seconds(proc.pid), abs=0.02)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_compare_table_shows_hit_rate_and_load_balance():
    stats = {"request_hit_rate": 0.9375, "ttft_p50_ms": 120.0, "ttft_p99_ms": 480.26,
             "throughput_rps": 15.5, "failed": 0}
    ok = peers.CompareRow("kvroute", 8, stats, {"a": 30, "b": 10, "c": 20})
    missing = peers.CompareRow("dynamo", 8, error="not installed: pip failed", setting="tuned",
                               warmup=False, run=1)
    header, first, second = peers.compare_table([ok, missing])
    assert header[:5] == ["router", "warmup", "run", "c", "hit rate"]
    assert first[:8] == ["kvroute:defaults", "on", "1", "8", "0.938", "120.0", "480.3", "15.50"]
    assert first[8] == "1.50" and first[9] == "30/20.0"
    assert second[:4] == ["dynamo:tuned", "off", "2", "8"]
    assert second[4] == "—" and "not installed" in second[-1]
    assert header[-2] == "load avg"


def test_router_settings_parse_into_separate_entries():
    entries = peers.parse_router_entries("kvroute,sglang:defaults,sglang:tuned,vllm-router:kv_aware")
    assert [e.label for e in entries] == ["kvroute:defaults", "sglang:defaults", "sglang:tuned",
                                          "vllm-router:kv_aware"]
    assert entries[2].setting.args == ("--eviction-interval-secs", "1", "--max-tree-size", "80000")
    assert entries[3].setting.policy == "kv_aware" and entries[3].setting.kv_events
    every = [e.label for e in peers.parse_router_entries("dynamo:all,dynamo")]
    assert every == [f"dynamo:{name}" for name in peers.SETTINGS["dynamo"]]  # no duplicate
    args = peers.parse_args(["--routers", "sglang:tuned,kvroute"])
    assert args.router_list == ["sglang", "kvroute"]  # what gets installed
    assert [e.label for e in args.entries] == ["sglang:tuned", "kvroute:defaults"]


def test_kvroute_runs_as_shipped_only():
    """kvroute is not tuned: its defaults, and its shipped modes that are not the default
    (retention off, the admission guard, its limit at 0.7, the guard without retention, the
    adapter term off; to measure whether they should be)."""
    assert list(peers.SETTINGS["kvroute"]) == [
        "defaults", "retention-off", "admission", "admission-0.7", "retention-off-admission", "adapter-off"]
    assert peers.SETTINGS["kvroute"]["defaults"].args == ()
    assert peers.SETTINGS["kvroute"]["retention-off"].args == ("--retention", "off")
    assert peers.SETTINGS["kvroute"]["admission"].args == ("--policy-option", "admission_wait=0.2")
    with pytest.raises(ValueError, match="no setting 'tuned'"):
        peers.parse_router_entries("kvroute:tuned")


def test_the_compare_workload_can_be_skewed_or_mixed_in_length():
    args = peers.parse_args([])
    assert (args.zipf, args.prefix_length) == (0.0, peers.REFERENCE_PREFIX)
    assert peers.describe_workload(args) == "prefixes of 2032 tokens, uniform"
    args = peers.parse_args(["--zipf", "1.2", "--prefix-tokens", "1000:3600"])
    assert (args.prefix_length.low, args.prefix_length.high) == (1000, 3600)
    assert peers.describe_workload(args) == "prefixes of 1000:3600 tokens, Zipf α 1.2"


def test_the_tenant_workload_serves_adapters_and_tells_kvroute_the_slots(tmp_path):
    args = peers.parse_args(["--adapters", "8", "--adapter-zipf", "1", "--salted", "--max-loras", "2",
                             "--routers", "kvroute,sglang"])
    assert peers.describe_workload(args) == (
        "prefixes of 2032 tokens, uniform, 8 adapters (Zipf 1, --max-loras 2), salted")
    env = peers.Env(2, tmp_path, {}, tmp_path, tmp_path, {}, ("--enable-lora",), 2)
    cmd = peers.router_command("kvroute", peers.SETTINGS["kvroute"]["defaults"], env, 9000, _backends())
    assert cmd[cmd.index("--max-loras") + 1] == "2"
    with pytest.raises(SystemExit):
        peers.parse_args(["--adapters", "2", "--routers", "kvroute,dynamo"])  # its mockers serve none


@pytest.mark.parametrize("argv", [["--routers", "sglang:fast"], ["--routers", "kvroute:tuned"],
                                  ["--routers", ","], ["--warmup", "maybe"], ["--runs", "0"]])
def test_bad_settings_warmup_and_runs_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_warmup_option_selects_one_or_both_conditions():
    assert peers.parse_args([]).warmups == [True]
    assert peers.parse_args(["--no-warmup"]).warmups == [False]
    assert peers.parse_args(["--warmup", "on,off"]).warmups == [True, False]
    assert peers.parse_args(["--warmup", "off,on,off"]).warmups == [False, True]
    assert peers.parse_args(["--runs", "3"]).runs == 3


def test_the_schedule_interleaves_routers_and_reverses_each_run():
    a, b = peers.parse_router_entries("kvroute,sglang:tuned")
    order = peers.compare_schedule([a, b], [8, 16], [False, True], 2)
    assert len(order) == 2 * 2 * 2 * 2
    assert [(n, c, w, e.label) for n, c, w, e in order[:4]] == [
        (0, 8, False, "kvroute:defaults"), (0, 8, False, "sglang:tuned"),
        (0, 8, True, "kvroute:defaults"), (0, 8, True, "sglang:tuned")]
    assert [e.label for n, c, w, e in order[8:10]] == ["sglang:tuned", "kvroute:defaults"]


def _row(router, hit, p99, warmup=True, setting="defaults", c=8, run=0, loads=None):
    stats = {"request_hit_rate": hit, "ttft_p50_ms": 50.0, "ttft_p99_ms": p99,
             "throughput_rps": 15.0, "failed": 0}
    return peers.CompareRow(router, c, stats, loads or {"a": 10, "b": 10}, setting=setting,
                            warmup=warmup, run=run)


def test_runs_summarize_to_median_and_range_per_setting_and_warmup():
    rows = [_row("sglang", 0.80, 300.0, setting="tuned", run=0),
            _row("sglang", 0.84, 200.0, setting="tuned", run=1),
            _row("sglang", 0.82, 250.0, setting="tuned", run=2, loads={"a": 15, "b": 5}),
            _row("sglang", 0.15, 3000.0, run=0),
            _row("sglang", 0.83, 250.0, warmup=False, run=0),
            peers.CompareRow("dynamo", 8, error="cannot start", setting="tuned")]
    got = {(m.label, m.warmup): m for m in peers.summarize_compare(rows)}
    tuned = got[("sglang:tuned", True)]
    assert (tuned.runs, tuned.failed_runs, tuned.runs_on) == (3, 0, "emulated")
    assert (tuned.hit_rate.median, tuned.hit_rate.low, tuned.hit_rate.high) == (0.82, 0.80, 0.84)
    assert tuned.load_max_over_mean.high == 1.5
    assert got[("sglang:defaults", True)].hit_rate.median == 0.15
    assert got[("sglang:defaults", False)].hit_rate.median == 0.83  # warmup is its own row
    failed = got[("dynamo:tuned", True)]
    assert (failed.runs, failed.failed_runs, failed.hit_rate, failed.runs_on) == (0, 1, None, "Dynamo mocker")
    table = peers.summary_table(peers.summarize_compare(rows))
    assert table[0][:6] == ["router:setting", "workers", "warmup", "c", "runs", "hit rate"]
    assert table[1][5] == "0.820 (0.800–0.840)" and table[1][7] == "250 (200–300)"
    assert table[2][5] == "0.150"  # one run: no range
    assert table[-1][4] == "0 (+1 failed)" and "cannot start" in table[-1][-1]


def _backends(n=2):
    urls = [f"http://127.0.0.1:{8000 + i}" for i in range(n)]
    events = [f"tcp://127.0.0.1:{5557 + i},tcp://127.0.0.1:{5657 + i}" for i in range(n)]
    return peers.Backends(urls, events, dict, None)


def _env(tmp_path):
    venv = str(tmp_path / "venv")
    installs = {p: peers.Install(p, venv, ok=True) for p in ("sglang", "vllm-router", "dynamo")}
    return peers.Env(2, tmp_path / "tok", installs, tmp_path / "logs", tmp_path,
                     {"sglang": ["--log-level", "debug"]})


def test_commands_carry_each_settings_flags(tmp_path):
    env, backends = _env(tmp_path), _backends()
    tuned = peers.router_command("sglang", peers.SETTINGS["sglang"]["tuned"], env, 9000, backends, 9100)
    assert tuned[tuned.index("--policy") + 1] == "cache_aware"
    assert tuned[-6:] == ["--eviction-interval-secs", "1", "--max-tree-size", "80000",
                          "--log-level", "debug"]  # the setting, then --router-args
    default = peers.router_command("vllm-router", peers.SETTINGS["vllm-router"]["defaults"], env, 9000,
                                   backends, 9100)
    assert "--kv-event-source" not in default and default[default.index("--policy") + 1] == "cache_aware"


def test_vllm_router_kv_aware_gets_every_workers_event_endpoints(tmp_path):
    env, backends = _env(tmp_path), _backends()
    cmd = peers.router_command("vllm-router", peers.SETTINGS["vllm-router"]["kv_aware"], env, 9000,
                               backends, 9100)
    assert cmd[cmd.index("--policy") + 1] == "kv_aware"
    sources = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kv-event-source"]
    replays = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kv-event-replay-source"]
    assert sources == ["http://127.0.0.1:8000=tcp://127.0.0.1:5557", "http://127.0.0.1:8001=tcp://127.0.0.1:5558"]
    assert replays == ["http://127.0.0.1:8000=tcp://127.0.0.1:5657", "http://127.0.0.1:8001=tcp://127.0.0.1:5658"]
    assert cmd[cmd.index("--kv-event-block-size") + 1] == str(peers.BLOCK_SIZE)


def test_kvroute_command_ignores_peer_settings_and_takes_events(tmp_path):
    env, backends = _env(tmp_path), _backends()
    cmd = peers.router_command("kvroute", peers.SETTINGS["kvroute"]["defaults"], env, 9000, backends)
    assert cmd[cmd.index("--policy") + 1] == "kv-aware"
    assert cmd.count("--kv-events") == 2 and "--eviction-interval-secs" not in cmd


def test_list_settings_names_every_setting_with_its_flags():
    text = peers.settings_text()
    for router, settings in peers.SETTINGS.items():
        for name in settings:
            assert f"{router}:{name}" in text
    assert "--router-prefill-load-scale 6" in text and "Dynamo mocker" in text


def test_added_latency_is_router_minus_direct():
    row = peers.OverheadRow("sglang", direct_e2e_ms=(10.0, 20.0), router_e2e_ms=(10.5, 23.0))
    assert row.added("e2e") == (0.5, 3.0)
    assert row.added("ttft") is None
    assert peers.overhead_table([row])[1][2] == "0.50 / 3.00"


def test_rounds_merge_into_medians_keeping_each_cpu_figure():
    rounds = [
        peers.OverheadRow("kvroute", requests=200, router_e2e_ms=(9.0, 30.0), cpu_us_per_request=1300.0),
        peers.OverheadRow("kvroute", requests=200, router_e2e_ms=(7.0, 10.0), cpu_us_per_request=1100.0,
                          failed=1, error="1 requests failed"),
        peers.OverheadRow("kvroute", requests=200, router_e2e_ms=(8.0, 20.0), cpu_us_per_request=1150.0),
    ]
    merged = peers.median_row(rounds)
    assert merged.cpu_us_per_request == 1150.0
    assert merged.cpu_rounds == [1300.0, 1100.0, 1150.0]
    assert merged.router_e2e_ms == (8.0, 20.0)
    assert merged.direct_e2e_ms is None  # no round measured it
    assert (merged.requests, merged.failed, merged.error) == (600, 1, "1 requests failed")
    assert peers.overhead_table([merged])[1][5] == "1150 (1300, 1100, 1150)"


def test_a_gateways_processes_keep_their_own_cpu_through_the_rounds():
    rounds = [
        peers.OverheadRow("gateway", cpu_us_per_request=1000.0,
                          cpu_us_by_process={"kvroute-epp": 300.0, "envoy": 700.0}),
        peers.OverheadRow("gateway", cpu_us_per_request=1100.0,
                          cpu_us_by_process={"kvroute-epp": 320.0, "envoy": 780.0}),
        peers.OverheadRow("gateway", cpu_us_per_request=1040.0,
                          cpu_us_by_process={"kvroute-epp": 290.0, "envoy": 750.0}),
    ]
    merged = peers.median_row(rounds)
    assert merged.cpu_us_by_process == {"envoy": 750.0, "kvroute-epp": 300.0}
    assert peers.overhead_table([merged])[1][5] == "1040 (1000, 1100, 1040); envoy 750; kvroute-epp 300"


def test_dynamo_borrows_the_emulated_direct_baseline():
    rows = [peers.OverheadRow("sglang", direct_e2e_ms=(10.0, 20.0), direct_ttft_ms=(5.0, 6.0)),
            peers.OverheadRow("kvroute", direct_e2e_ms=(12.0, 30.0), direct_ttft_ms=(7.0, 8.0)),
            peers.OverheadRow("dynamo", router_e2e_ms=(15.0, 40.0), router_ttft_ms=(9.0, 9.0))]
    peers._direct_baseline_for_dynamo(rows)
    assert rows[2].added("e2e") == (4.0, 15.0)
    assert "direct = emulated worker" in rows[2].note


#: What the relay tests' worker streams, one event at a time.
_EVENTS = [b"data: %d\n\n" % i for i in range(3)] + [b"data: [DONE]\n\n"]


def _streaming_worker(seen: list) -> web.Application:
    """A worker that records each completions body and streams ``_EVENTS`` 10 ms apart."""

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in _EVENTS:
            await response.write(event)
            await asyncio.sleep(0.01)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def _relayed_stream(port: int, cmd: list[str]) -> bytes:
    """Start the relay ``cmd`` (listening on ``port``), stream one completion through it once
    it listens, stop it; the answer's body."""
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):  # until it listens
                try:
                    async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                            json={"prompt": "hi", "stream": True}) as resp:
                        assert resp.status == 200
                        assert resp.content_type == "text/event-stream"
                        return await resp.read()
                except aiohttp.ClientConnectorError:
                    await asyncio.sleep(0.1)
            pytest.fail(f"{cmd[0]} did not start")
    finally:
        proc.terminate()
        await proc.wait()


async def test_the_floor_proxy_relays_a_stream_chunk_by_chunk(serve_app):
    seen: list = []
    async with serve_app(_streaming_worker(seen)) as worker:
        port = free_ports(1)[0]
        body = await _relayed_stream(
            port, [sys.executable, str(peers.FLOOR_PROXY), "--port", str(port), "--worker", worker])
    assert body == b"".join(_EVENTS)
    assert seen == [{"prompt": "hi", "stream": True}]


def test_haproxy_relays_to_every_worker_on_loopback_without_merging_chunks():
    config = peers.haproxy_config(8100, ["http://127.0.0.1:9001", "http://127.0.0.1:9002"])
    assert "bind 127.0.0.1:8100" in config
    assert "server w0 127.0.0.1:9001" in config and "server w1 127.0.0.1:9002" in config
    assert "option http-no-delay" in config  # a streamed token is not held back to merge writes
    assert "balance random" in config and "http-reuse always" in config


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")
async def test_the_haproxy_relay_streams_a_worker_s_answer(serve_app, tmp_path):
    seen: list = []
    async with serve_app(_streaming_worker(seen)) as worker:
        port = free_ports(1)[0]
        config = tmp_path / "haproxy.cfg"
        config.write_text(peers.haproxy_config(port, [worker]))
        body = await _relayed_stream(port, [shutil.which("haproxy"), "-db", "-f", str(config)])
    assert body == b"".join(_EVENTS)
    assert seen == [{"prompt": "hi", "stream": True}]


def test_saved_results_report_as_markdown_with_every_concurrency_side_by_side(tmp_path):
    rows = [_row("kvroute", 0.85, 200.0, c=8, run=0), _row("kvroute", 0.87, 220.0, c=8, run=1),
            _row("kvroute", 0.86, 400.0, c=16, run=0),
            _row("dynamo", 0.80, 150.0, setting="tuned", warmup=False, c=8)]
    peers._save(tmp_path, {"compare": rows})
    back = peers.rows_from_results(tmp_path / "results.json")
    assert [(r.label, r.warmup, r.concurrency, r.run) for r in back] == [
        (r.label, r.warmup, r.concurrency, r.run) for r in rows]
    md = peers.markdown_table(peers.summarize_compare(back)).splitlines()
    assert md[0].startswith("| router:setting | workers | warmup | runs | hit rate c=8 |")
    assert "hit rate c=16" in md[0]
    assert md[2] == "| kvroute:defaults | emulated | on | 2/1 | 0.860 (0.850–0.870) | 50 / 210 (200–220) | 1.00 | 0.860 | 50 / 400 | 1.00 |"
    assert md[3].startswith("| dynamo:tuned | Dynamo mocker | off | 1/0 | 0.800 |") and md[3].endswith("| — | — | — |")


def test_compact_table_puts_no_warmup_and_warmup_in_one_cell():
    rows = [_row("sglang", 0.84, 600.0, warmup=False, c=16), _row("sglang", 0.17, 3500.0, warmup=True, c=16),
            _row("sglang", 0.83, 200.0, warmup=False, c=8, run=0), _row("sglang", 0.85, 210.0, warmup=False, c=8, run=1)]
    lines = peers.compact_table(peers.summarize_compare(rows)).splitlines()
    assert lines[0] == ("| router:setting | workers | hit rate c=8 | hit rate c=16 | TTFT p99 ms c=16 | "
                        "load max/mean c=16 | runs |")
    assert lines[2] == ("| sglang:defaults | emulated | 0.840 (0.830–0.850) / — | 0.840 / 0.170 | "
                        "600 / 3,500 | 1.00 / 1.00 | 2, 0, 1, 1 |")


def test_several_results_files_pool_as_further_runs(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    peers._save(tmp_path / "a", {"compare": [_row("kvroute", 0.80, 100.0, run=0), _row("kvroute", 0.82, 100.0, run=1)]})
    peers._save(tmp_path / "b", {"compare": [_row("kvroute", 0.90, 100.0, run=0)]})
    rows = peers.pooled_rows([tmp_path / "a" / "results.json", tmp_path / "b" / "results.json"])
    assert [r.run for r in rows] == [0, 1, 2]
    (summary,) = peers.summarize_compare(rows)
    assert (summary.runs, summary.hit_rate.median, summary.hit_rate.high) == (3, 0.82, 0.90)


async def test_vllm_router_workers_serve_the_render_it_takes_tokens_from():
    # vllm-router 0.1.17 takes a text prompt's tokens from /v1/completions/render only; a
    # vLLM 0.32 worker serves it with --enable-scale-out (403 without), so its emulated
    # workers get that flag and the other routers' workers do not.
    import argparse

    from kvroute.commands import emulate
    from kvroute.emulator import start_workers

    assert "--enable-scale-out" in peers.WORKER_ARGS["vllm-router"]
    assert not any("--enable-scale-out" in a for r, a in peers.WORKER_ARGS.items() if r != "vllm-router")
    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    for args, status in ((peers.WORKER_ARGS["vllm-router"], 200), ((), 403)):
        config = emulate.config_from_args(parser.parse_args(["--timing", "instant", *args]))
        (worker,) = await start_workers(config, 1)
        try:
            body = {"model": config.model_name, "prompt": "Hello there"}
            async with aiohttp.ClientSession() as s, s.post(f"{worker.url}/v1/completions/render", json=body) as r:
                assert r.status == status
                if status == 200:
                    (rendered,) = await r.json()
                    assert rendered["token_ids"]
        finally:
            await worker.close()


def test_envoy_alone_relays_round_robin_to_every_worker():
    import yaml

    config = yaml.safe_load(peers.envoy_round_robin_config(
        8000, 9901, ["http://127.0.0.1:8001", "http://[::1]:8002"]))
    (cluster,) = config["static_resources"]["clusters"]
    assert cluster["lb_policy"] == "ROUND_ROBIN"
    addresses = [e["endpoint"]["address"]["socket_address"]
                 for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert addresses == [{"address": "127.0.0.1", "port_value": 8001}, {"address": "::1", "port_value": 8002}]
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9901}
