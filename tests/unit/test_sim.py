"""Simulator: the reference experiment's exact first-contact counts, the C/K shape, policy
effects, determinism."""

import random

import numpy as np
import pytest

from kvroute.blocks import BlockHasher
from kvroute.cli import main
from kvroute.engine import REFERENCE_GPU
from kvroute.errors import UserError
from kvroute.routing.policies import PrefixHashPolicy, RequestView, WorkerState, make_policy
from kvroute.sim import SweepPoint, WorkerConfig, run_point, run_trial
from kvroute.workload import LengthDist, WorkloadSpec, generate

REFERENCE = WorkerConfig(num_blocks=585, block_size=16, cost=REFERENCE_GPU)


@pytest.mark.parametrize("workers, hits", [(6, 190), (3, 196)])
def test_k2_random_misses_exactly_first_contacts_every_trial(workers, hits):
    workload = generate(WorkloadSpec(prefixes=2, seed=0))
    point = run_point(SweepPoint(workers, 2, 8, "random"), workload, REFERENCE, trials=3, seed=0)
    assert [t.hits for t in point.trials] == [hits] * 3
    assert [t.requests for t in point.trials] == [200] * 3


def test_hit_rate_follows_c_over_k_and_does_not_depend_on_workers():
    capacity = 584 / 152  # usable blocks / blocks one reference request leaves cached
    for k in (7, 12, 24):
        workload = generate(WorkloadSpec(prefixes=k, seed=0))
        rates = [
            run_point(SweepPoint(w, k, 8, "random"), workload, REFERENCE, 3, 0).median("request_hit_rate")
            for w in (6, 3)
        ]
        for rate in rates:
            assert rate == pytest.approx(capacity / k, abs=0.06)
        assert abs(rates[0] - rates[1]) < 0.07


def test_prefix_hash_far_above_random_at_k24():
    workload = generate(WorkloadSpec(prefixes=24, seed=0))
    rnd = run_point(SweepPoint(6, 24, 8, "random"), workload, REFERENCE, 1, 0)
    owned = run_point(SweepPoint(6, 24, 8, "prefix-hash"), workload, REFERENCE, 1, 0)
    assert owned.median("request_hit_rate") > rnd.median("request_hit_rate") + 0.4


def test_both_hit_measures_agree_in_the_simulator():
    workload = generate(WorkloadSpec(prefixes=12, seed=3))
    trial = run_trial(workload, 6, 16, REFERENCE, make_policy("random", random.Random(1))).stats()
    assert trial.metrics_token_hit_rate == pytest.approx(trial.token_hit_rate, abs=1e-12)


def test_hit_and_miss_ttft_match_the_calibration():
    workload = generate(WorkloadSpec(prefixes=24, seed=0))
    point = run_point(SweepPoint(6, 24, 4, "random"), workload, REFERENCE, 1, 0)
    assert point.median("ttft_hit_p50_ms") == pytest.approx(40, abs=5)
    assert 105 <= point.median("ttft_miss_p50_ms") <= 113


def test_same_seed_same_results_other_seed_other_order():
    def run(seed):
        workload = generate(WorkloadSpec(prefixes=7, seed=seed))
        return run_trial(workload, 6, 8, REFERENCE, make_policy("random", random.Random(seed))).records

    a, b, c = run(5), run(5), run(6)
    assert [(r.prefix_id, r.cached_tokens, r.ttft_s, r.worker) for r in a] == [
        (r.prefix_id, r.cached_tokens, r.ttft_s, r.worker) for r in b
    ]
    assert [r.prefix_id for r in a] != [r.prefix_id for r in c]


def test_request_too_large_for_a_worker_is_a_user_error():
    workload = generate(WorkloadSpec(prefixes=2, requests=4))
    tiny = WorkerConfig(num_blocks=20, block_size=16, cost=REFERENCE_GPU)
    with pytest.raises(UserError, match="needs .* KV blocks"):
        run_trial(workload, 2, 1, tiny, make_policy("random"))


def test_prefix_hash_bounded_load_spills_from_a_busy_owner():
    hasher = BlockHasher(16)
    view = RequestView(hasher.hash_blocks(np.arange(32)), 32)
    workers = [WorkerState(f"w{i}") for i in range(4)]
    policy = PrefixHashPolicy(load_factor=0.25)
    owner = policy.choose(view, workers)
    assert PrefixHashPolicy().choose(view, workers) == owner
    workers[owner].in_flight = 6
    spilled = policy.choose(view, workers)
    assert spilled != owner
    assert spilled == policy.ranking(view, workers)[1]  # the next in the prefix's own order
    assert PrefixHashPolicy().choose(view, workers) == owner  # unbounded never spills


def test_workload_reference_shape():
    wl = generate(WorkloadSpec(prefixes=7, seed=0))
    assert len(wl.requests) == 200 and len(wl.warmup) == 7
    assert wl.mean_prompt_tokens == 2371
    counts = np.bincount([r.prefix_id for r in wl.requests])
    assert counts.max() - counts.min() <= 1  # each prefix equally often (200 = 7·28 + 4)
    assert all(np.array_equal(r.prefix, wl.prefixes[r.prefix_id]) for r in wl.requests)
    suffixes = {r.suffix.tobytes() for r in wl.requests + wl.warmup}
    assert len(suffixes) == 207  # every suffix unique
    assert len(generate(WorkloadSpec(prefixes=24)).requests) == 480


def test_workload_zipf_and_mixed_lengths():
    wl = generate(
        WorkloadSpec(prefixes=64, zipf_alpha=1.2, prefix_tokens=LengthDist.parse("500:3000"),
                     suffix_tokens=LengthDist.parse("100,300"), requests=2000, seed=4)
    )
    counts = np.bincount([r.prefix_id for r in wl.requests], minlength=64)
    assert counts[0] > 5 * counts[10] > 0  # rank 1 far more popular than rank 11
    lengths = {len(p) for p in wl.prefixes}
    assert len(lengths) > 30 and min(lengths) >= 500 and max(lengths) <= 3000
    assert {r.prompt_tokens - r.prefix_len for r in wl.requests} == {100, 300}


def _generate_one_request_at_a_time(spec, vocab):
    """The straightforward generator: each suffix drawn by its own call, in request order."""
    rng = np.random.default_rng(spec.seed)
    prefix_lens = spec.prefix_tokens.sample(rng, spec.prefixes)
    prefixes = [vocab[rng.integers(0, len(vocab), size=int(n))] for n in prefix_lens]
    n, k = spec.num_requests, spec.prefixes
    order = np.arange(n) % k if spec.zipf_alpha == 0 else rng.choice(k, size=n, p=spec.popularity())
    rng.shuffle(order)
    suffix_lens = spec.suffix_tokens.sample(rng, k + n)
    prefix_ids = [*range(k), *order.tolist()]
    return [
        (prefixes[p].tobytes(), vocab[rng.integers(0, len(vocab), size=int(m))].tobytes())
        for p, m in zip(prefix_ids, suffix_lens)
    ]


@pytest.mark.parametrize("chunk", [1, 50, 1 << 22])
@pytest.mark.parametrize(
    "spec",
    [
        WorkloadSpec(prefixes=5, requests=40, seed=3, suffix_tokens=LengthDist.parse("0:30")),
        WorkloadSpec(prefixes=3, requests=30, seed=4, zipf_alpha=1.0,
                     prefix_tokens=LengthDist.parse("0,7"), suffix_tokens=LengthDist.parse("1:9")),
    ],
)
def test_workload_suffixes_drawn_in_chunks_equal_one_draw_per_request(monkeypatch, spec, chunk):
    """generate() draws many suffixes per numpy call; the tokens must be exactly those of one
    call per request (same seed, same workload), whatever the chunk size."""
    monkeypatch.setattr("kvroute.workload._SUFFIX_CHUNK_TOKENS", chunk)
    vocab = np.arange(7, 300, dtype=np.uint32)
    wl = generate(spec, vocab)
    got = [(r.prefix.tobytes(), r.suffix.tobytes()) for r in wl.warmup + wl.requests]
    assert got == _generate_one_request_at_a_time(spec, vocab)
    assert [r.index for r in wl.warmup] == list(range(spec.prefixes))
    assert [r.index for r in wl.requests] == list(range(spec.num_requests))
    assert all(r.warmup for r in wl.warmup) and not any(r.warmup for r in wl.requests)


def test_workload_rejects_an_empty_prompt():
    spec = WorkloadSpec(prefixes=2, requests=5, prefix_tokens=LengthDist.parse("0"),
                        suffix_tokens=LengthDist.parse("0,3"), seed=1)
    with pytest.raises(UserError, match="at least one token"):
        generate(spec)


def test_sim_cli_writes_json_with_the_point_contract(tmp_path, capsys):
    out = tmp_path / "points.json"
    rc = main(["sim", "--workers", "6", "--prefixes", "2,24", "--concurrency", "8", "--trials", "2",
               "--policy", "random,prefix-hash", "--json", str(out)])
    assert rc == 0
    import json

    data = json.loads(out.read_text())
    assert len(data["points"]) == 4
    for p in data["points"]:
        for key in ("workers", "prefixes", "concurrency", "policy", "trials", "request_hit_rate",
                    "token_hit_rate", "ttft_hit_p50_ms", "ttft_miss_p50_ms", "ttft_p50_ms",
                    "ttft_p99_ms", "throughput_rps", "per_trial"):
            assert key in p
        assert 0 <= p["request_hit_rate"] <= 1 and len(p["per_trial"]) == 2
    k2 = next(p for p in data["points"] if p["prefixes"] == 2 and p["policy"] == "random")
    assert k2["request_hit_rate"] == 0.95
    assert "Request hit rate" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sim", "--workers", "six"], "--workers"),
        (["sim", "--policy", "sticky"], "--policy"),
        (["sim", "--kv-cache-memory-bytes", "lots"], "bad size"),
        (["sim", "--prefix-tokens", "9:1"], "bad length"),
        (["sim", "--model-shape", "28,8,128,int3"], "unknown dtype"),
        (["sim", "--model-shape", "28,8"], "--model-shape"),
        (["sim", "--kv-cache-memory-bytes", "8M", "--workers", "1", "--prefixes", "1"], "KV blocks"),
        # The engine's context length: 5,339-token prompts the emulator and vLLM refuse.
        (["sim", "--prefix-tokens", "5000"], "longer than --max-model-len 4096"),
        (["sim", "--prefix-tokens", "3000", "--max-model-len", "3000"], "--max-model-len 3000"),
        (["sim", "--max-model-len", "0"], "--max-model-len must be >= 1"),
    ],
)
def test_sim_cli_bad_input_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_kv_aware_simulation_index_tracks_the_engines_and_accounting_returns_to_zero():
    """The simulator's router index, fed by the engines' events, ends the run agreeing with
    every engine's real cache; the load accounting drains to zero."""
    from kvroute.routing.index import KvIndex
    from kvroute.sim import Simulation

    workload = generate(WorkloadSpec(prefixes=12, requests=120, seed=5))
    sim = Simulation(3, REFERENCE, make_policy("kv-aware", random.Random(0)))
    assert isinstance(sim.index, KvIndex)
    output = workload.vocab[:64]
    sim.run(workload.warmup, 1, output)
    sim.run(workload.requests, 8, output)
    later = sim.now + 60  # predicted entries have expired: only events speak
    for prefix in workload.prefixes:
        hashes = sim.hasher.hash_blocks(prefix)
        want = [len(e.pool.find_longest_hit(hashes, len(hashes))) for e in sim.engines]
        assert sim.index.overlaps(hashes, sim.names, later) == want
    assert sum(sum(sim.index.overlaps(sim.hasher.hash_blocks(p), sim.names, later)) for p in workload.prefixes) > 0
    assert all(s.in_flight == 0 and s.in_flight_tokens == 0 for s in sim.states)


def test_policies_without_the_index_have_no_index_and_no_events():
    from kvroute.sim import Simulation

    sim = Simulation(2, REFERENCE, make_policy("random", random.Random(0)))
    assert sim.index is None and not any(e.pool.emit_events for e in sim.engines)
