"""The simulator's router replicas (``kvroute_core::sim::replicas``) through ``kvroute.sim`` and
``kvroute sim --router-replicas``: one replica is one router, exactly; several without the mesh
lose hits, and the mesh wins them back."""

import json
import random

import pytest

from kvroute.cli import main
from kvroute.engine import REFERENCE_GPU
from kvroute.routing.policies import make_policy
from kvroute.sim import DEFAULT_MESH_LAG_S, Simulation, SweepPoint, WorkerConfig, run_point
from kvroute.workload import WorkloadSpec, generate

REFERENCE = WorkerConfig(num_blocks=585, block_size=16, cost=REFERENCE_GPU)


def _hit_rate(replicas: int, mesh_lag: float | None, seeds=range(3)) -> float:
    workload = generate(WorkloadSpec(prefixes=24, seed=0))
    point = SweepPoint(6, 24, 16, "kv-aware", "auto", replicas, mesh_lag)
    rates = [run_point(point, workload, REFERENCE, 2, seed).median("request_hit_rate") for seed in seeds]
    return sum(rates) / len(rates)


def test_replicas_without_the_mesh_lose_hits_and_with_it_predict_one_router():
    one = _hit_rate(1, None)
    alone = _hit_rate(3, None)
    meshed = _hit_rate(3, DEFAULT_MESH_LAG_S)
    assert alone < one - 0.01, (one, alone)
    assert abs(meshed - one) < (one - alone) / 2, (one, alone, meshed)


def test_every_replicas_load_accounting_returns_to_zero_and_each_keeps_its_own_index():
    workload = generate(WorkloadSpec(prefixes=12, requests=120, seed=5))
    policies = [make_policy("kv-aware", random.Random(r)) for r in range(3)]
    sim = Simulation(3, REFERENCE, policies[0], retention="on", replica_policies=policies[1:],
                     mesh_lag=0.002, balancer_seed=4)
    output = workload.vocab[:64]
    sim.run(workload.warmup, 1, output)
    records = sim.run(workload.requests, 8, output)
    assert len(records) == 120
    steps = [sim.routing] + [step for step, _ in sim.replicas]
    for step in steps:
        for i in range(3):
            state = step.state(i)
            assert (state.in_flight, state.in_flight_tokens) == (0, 0)
    assert len({id(step.index) for step in steps}) == 3


def test_sim_cli_sweeps_replicas_and_labels_them(tmp_path):
    out = tmp_path / "replicas.json"
    rc = main(["sim", "-W", "6", "-K", "24", "-c", "8", "--trials", "1", "--policy", "kv-aware",
               "--router-replicas", "1,2", "--no-mesh", "--json", str(out)])
    assert rc == 0
    labels = [p["policy"] for p in json.loads(out.read_text())["points"]]
    assert labels == ["kv-aware+retain-auto", "kv-aware+retain-auto ×2 replicas, no mesh"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sim", "--router-replicas", "0"], "--router-replicas"),
        (["sim", "--router-replicas", "2", "--mesh-lag", "-1"], "--mesh-lag must be between"),
        (["sim", "--router-replicas", "2", "--trace", "t.jsonl"], "drop it with --trace"),
    ],
)
def test_bad_replica_flags_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_mesh_lag_and_no_mesh_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        main(["sim", "--mesh-lag", "0.01", "--no-mesh"])
    assert "not allowed with" in capsys.readouterr().err
