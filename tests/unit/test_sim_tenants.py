"""The simulator with tenants: LoRA adapters and cache salts key each request's blocks for the
engine and the router alike, and adapters take the engines' LoRA slots."""

import dataclasses

import numpy as np
import pytest

from kvroute.cli import main
from kvroute.engine import REFERENCE_GPU
from kvroute.routing.policies import make_policy
from kvroute.sim import Simulation, SweepPoint, WorkerConfig, retention_modes, run_point, workload_tenants
from kvroute.workload import RequestSpec, WorkloadSpec, generate

REFERENCE = WorkerConfig(num_blocks=585, block_size=16, cost=REFERENCE_GPU)


def kv_aware_point(spec: WorkloadSpec, concurrency: int, config: WorkerConfig) -> float:
    """kv-aware's median request hit rate over 2 trials at W = 6, as ``kvroute sim`` runs it
    (the retention kvroute serve ships with it)."""
    (retention,) = retention_modes("kv-aware", None)
    point = SweepPoint(6, spec.prefixes, concurrency, "kv-aware", retention)
    return run_point(point, generate(spec), config, trials=2, seed=0).median("request_hit_rate")


@pytest.mark.parametrize("concurrency", [8, 16])
def test_eight_adapters_over_24_prefixes_hit_as_the_plain_workload(concurrency):
    plain = WorkloadSpec(prefixes=24, seed=0)
    tenants = dataclasses.replace(plain, adapters=8, adapter_zipf=1.0, salted=True)
    slots = dataclasses.replace(REFERENCE, max_loras=4)
    base = kv_aware_point(plain, concurrency, REFERENCE)
    keyed = kv_aware_point(tenants, concurrency, slots)
    assert base > 0.9
    assert keyed == pytest.approx(base, abs=0.02)


def test_workload_tenants_are_what_bench_sends():
    spec = WorkloadSpec(prefixes=24, seed=0, adapters=8, adapter_zipf=1.0, salted=True)
    tenants = workload_tenants(generate(spec))
    adapters = spec.adapter_of_prefix()
    assert len(tenants) == 24
    for p, (name, lora_id, salt) in enumerate(tenants):
        assert (name, salt) == spec.tenant_of(p, adapters)
        assert lora_id == adapters[p] + 1
    assert workload_tenants(generate(WorkloadSpec(prefixes=3))) is None


def same_prompt_twice(tenants):
    """Two requests of the same 64-token prompt on one worker, one after the other, as prefix
    0 then prefix 1 (the same tokens) under ``tenants``: the cached tokens of each."""
    prefix = np.arange(1000, 1064, dtype=np.uint32)
    suffix = np.arange(5000, 5005, dtype=np.uint32)
    sim = Simulation(1, REFERENCE, make_policy("kv-aware"))
    requests = [RequestSpec(i, p, prefix, suffix, 4) for i, p in enumerate((0, 1))]
    records = sim.run(requests, 1, np.arange(7, 11, dtype=np.uint32), tenants=tenants)
    return [r.cached_tokens for r in records]


def test_another_salt_or_adapter_misses_and_the_same_tenant_hits():
    assert same_prompt_twice(None) == [0, 64]
    assert same_prompt_twice([(None, None, "a"), (None, None, "a")]) == [0, 64]
    assert same_prompt_twice([(None, None, "a"), (None, None, "b")]) == [0, 0]
    assert same_prompt_twice([("x", 1, None), ("y", 2, None)]) == [0, 0]
    assert same_prompt_twice([("x", 1, "a"), ("x", 1, "a")]) == [0, 64]


def test_one_lora_slot_slows_eight_adapters_down():
    spec = WorkloadSpec(prefixes=24, seed=0, adapters=8)
    workload = generate(spec)
    point = SweepPoint(6, 24, 16, "kv-aware")

    def ttft_p50(max_loras):
        config = dataclasses.replace(REFERENCE, max_loras=max_loras, lora_load_s=0.02)
        return run_point(point, workload, config, trials=1, seed=0).median("ttft_p50_ms")

    assert ttft_p50(1) > ttft_p50(8) + 10


def test_sim_cli_runs_tenants(capsys):
    argv = ["sim", "-W", "3", "-K", "6", "-c", "4", "--trials", "1", "--policy", "kv-aware",
            "--adapters", "4", "--salted", "--max-loras", "2", "--requests", "60"]
    assert main(argv) == 0
    assert "kv-aware" in capsys.readouterr().out


def test_sim_cli_bad_lora_slots_is_one_line(capsys):
    assert main(["sim", "-W", "2", "-K", "2", "-c", "1", "--adapters", "2", "--max-loras", "0"]) != 0
    assert "--max-loras" in capsys.readouterr().err


def test_sim_cli_tenants_with_a_trace_is_one_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    assert main(["sim", "--trace", str(trace), "--adapters", "2"]) != 0
    assert "drop --trace" in capsys.readouterr().err
