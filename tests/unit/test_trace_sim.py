"""``kvroute sim --trace``: a trace replayed open loop through the native simulator agrees
with the trace analysis where the two must agree, refuses what max-model-len refuses, and
speaks in one line to mistakes."""

import json

import numpy as np
import pytest

from kvroute.cli import main
from kvroute.engine import INSTANT
from kvroute.routing.policies import make_policy
from kvroute.sim import WorkerConfig
from kvroute.trace import load_trace
from kvroute.trace.reuse import BlockAccesses, infinite_cache
from kvroute.trace.simulate import simulate_trace


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_one_worker_with_room_for_everything_hits_what_an_infinite_cache_hits(tmp_path):
    """One worker whose cache holds the whole trace, requests far apart in time: every full
    512-token block seen before is a hit (the engine counts whole 16-token blocks, so the
    analysis's full-block ratio is exact here, all lengths being multiples of 512)."""
    rng = np.random.default_rng(3)
    rows = []
    for i in range(40):
        k = int(rng.integers(6))
        ids = [k, 10 + k, 100 + i]  # equal ids mean equal prefixes, as in Mooncake's traces
        rows.append({"timestamp": i * 10_000, "input_length": 512 * len(ids), "output_length": 4, "hash_ids": ids})
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    config = WorkerConfig(num_blocks=40 * 3 * 32 + 64, block_size=16, cost=INSTANT)
    run = simulate_trace(trace, 1, config, make_policy("round-robin"), max_model_len=10_000)
    cached = sum(r.cached_tokens for r in run.records)
    prompt = sum(r.prompt_tokens for r in run.records)
    want = infinite_cache(BlockAccesses.of(trace))
    assert run.refused == 0 and len(run.records) == 40
    assert cached / prompt == pytest.approx(want["full_block_hit_ratio"], abs=1e-9)


def test_requests_over_max_model_len_are_refused_and_counted(tmp_path):
    rows = [{"timestamp": i, "input_length": 600 if i % 2 else 2000, "output_length": 8,
             "hash_ids": [i, 1000 + i] if i % 2 else [i, 1000 + i, 2000 + i, 3000 + i]}
            for i in range(10)]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    config = WorkerConfig(num_blocks=400, block_size=16, cost=INSTANT)
    run = simulate_trace(trace, 2, config, make_policy("round-robin"), max_model_len=1024)
    assert run.refused == 5 and len(run.records) == 5


def test_sim_cli_trace_writes_json_and_bad_flags_are_one_line(tmp_path, capsys):
    rows = [{"timestamp": 100 * i, "input_length": 1024, "output_length": 16, "hash_ids": [i % 3, 50 + i]}
            for i in range(30)]
    path = write_trace(tmp_path / "t.jsonl", rows)
    out = tmp_path / "sim.json"
    folder = tmp_path / "sim"
    assert main(["sim", "--trace", str(path), "-W", "2", "--policy", "random,kv-aware",
                 "--kv-capacity-tokens", "64K", "--json", str(out), "--out", str(folder)]) == 0
    points = {p["policy"]: p for p in json.loads(out.read_text())["points"]}
    # No --retention: each policy as kvroute serve runs it (kv-aware with retention auto).
    kv = "kv-aware+retain-auto"
    assert set(points) == {"random", kv} and points[kv]["requests"] == 30
    assert points[kv]["token_hit_rate"] >= points["random"]["token_hit_rate"]
    # The folder: the points in the bench's summary contract, and the replay's plots.
    summary = json.loads((folder / "summary.json").read_text())
    assert {p["policy"] for p in summary["points"]} == {"random", kv}
    assert summary["meta"]["command"] == "sim --trace"
    for png in ("hit_rate_over_time.png", "worker_load_over_time.png", "ttft_cdf.png"):
        assert (folder / png).read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["sim", "--trace", str(path), "--time-scale", "0"]) == 2
    err = capsys.readouterr().err
    assert "--time-scale" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_experiment_replays_a_trace_through_service_and_router_beside_the_simulator(tmp_path, capsys):
    """``kvroute experiment --trace`` on emulated workers: both topologies replay the trace's
    requests by their timestamps, the two hit measures agree, the simulator's replay of the
    same requests is beside them (exact for the router with instant timing: its decisions
    depend on nothing but the events), and the report plots the replay over time."""
    rows = [{"timestamp": 40 * i, "input_length": 1024 + 512 * (i % 2), "output_length": 4,
             "hash_ids": [i % 4, 10 + i % 4, 100 + i][: 2 + i % 2]} for i in range(24)]
    path = write_trace(tmp_path / "t.jsonl", rows)
    out = tmp_path / "exp"
    assert main(["experiment", "--trace", str(path), "--workers", "2", "--timing", "instant",
                 "--kv-capacity-tokens", "20K", "--max-model-len", "8192", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1. Trace replay by topology" in printed and "max |Δ| = 0.0000" in printed
    summary = json.loads((out / "summary.json").read_text())
    measured = {p["policy"]: p for p in summary["points"]}
    assert set(measured) == {"service", "router"}
    assert all(p["requests"] == 24 and p["failed"] == 0 and p["concurrency"] == 0 for p in measured.values())
    assert summary["meta"]["trace"]["path"] == str(path) and summary["meta"]["max_model_len"] == 8192
    predicted = {p["policy"]: p for p in summary["meta"]["sim"]["points"]}
    assert predicted["router"]["token_hit_rate"] == pytest.approx(measured["router"]["token_hit_rate"])
    assert measured["router"]["token_hit_rate"] > measured["service"]["token_hit_rate"]
    for png in ("hit_rate_over_time.png", "worker_load_over_time.png", "ttft_cdf.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    page = (out / "report.html").read_text()
    assert page.index("1. Trace replay") < page.index('title="hit_rate_over_time.png"')


def test_experiment_trace_flags_that_do_not_fit_are_one_line(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 512, "output_length": 4,
                                              "hash_ids": [1]}])
    for argv, needle in (
        (["--trace", str(tmp_path / "missing.jsonl")], "no such file. Shipped with kvroute: --trace synthetic"),
        (["--trace", str(path), "--concurrency", "4"], "--concurrency"),
        (["--duration", "60"], "are for --trace"),
        (["--engine", "urls", "--worker", "http://127.0.0.1:9", "--kv-capacity-tokens", "3M"], "--kv-capacity-tokens"),
    ):
        assert main(["experiment", *argv, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
