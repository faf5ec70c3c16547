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
    assert main(["sim", "--trace", str(path), "-W", "2", "--policy", "random,kv-aware",
                 "--kv-capacity-tokens", "64K", "--json", str(out)]) == 0
    points = {p["policy"]: p for p in json.loads(out.read_text())["points"]}
    assert set(points) == {"random", "kv-aware"} and points["kv-aware"]["requests"] == 30
    assert points["kv-aware"]["token_hit_rate"] >= points["random"]["token_hit_rate"]
    capsys.readouterr()
    assert main(["sim", "--trace", str(path), "--time-scale", "0"]) == 2
    err = capsys.readouterr().err
    assert "--time-scale" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
