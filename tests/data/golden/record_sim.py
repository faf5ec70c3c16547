"""Record the simulator's golden traces (tests/data/golden/sim_*.json.gz).

First recorded from the Python simulator (src/kvroute/sim.py with the Python engine, index and
policies, before the native core replaced them), stepping every engine step singly: its
coalesced decode runs, an optimization meant to give the same results, admitted a waiting
request one step late in two of these trials (tight-prefix-hash-s1 and -s2, a small cache with
preemption). The native simulator reproduced that record bit for bit. Re-recorded once since,
from the native simulator, for one deliberate change of the engine model: a freed block that
holds no hash (a request's partial last block) goes to the head of the free queue, as in vLLM
0.32's ``free_blocks``, which made the model agree with real vLLM request for request
(tests/vllm/test_engine_parity.py); 126 of the 156 trials changed. kv-aware runs without its
admission guard (``admission_wait=None``, the guard came after the record): the traces pin the
engine and the policy's other paths; tests/unit/test_kv_aware.py and the core's tests cover the guard.

tests/unit/test_sim_golden.py requires today's simulator to reproduce every request exactly: worker,
cached tokens, TTFT and end-to-end latency (as float reprs), and each worker's prefix-cache
counters over the measured window.

    python tests/data/golden/record_sim.py      # rewrites the files: only with a reason
"""

from __future__ import annotations

import gzip
import inspect
import json
import random
from pathlib import Path

from kvroute.engine import get_preset
from kvroute.routing.policies import make_policy, policy_parameters
from kvroute.sim import WorkerConfig, run_trial, trial_seed
from kvroute.workload import LengthDist, WorkloadSpec, generate

HERE = Path(__file__).parent
REFERENCE = dict(num_blocks=585, block_size=16)
#: How the traces were recorded: the Python simulator's single steps (see the docstring).
#: Today's simulator steps singly and takes no such option.
SINGLE_STEPS = {"coalesce": False} if "coalesce" in inspect.signature(run_trial).parameters else {}


def cases():
    """(name, spec kwargs, workers, concurrency, policy, worker config kwargs, seed)."""
    for policy in ("random", "round-robin", "least-loaded", "prefix-hash", "kv-aware"):
        for workers in (6, 3):
            for k in (2, 7, 12, 24):
                for c in (4, 8, 16):
                    yield f"ref-{policy}-W{workers}-K{k}-c{c}", dict(prefixes=k), workers, c, policy, REFERENCE, 0
    for seed in (0, 1, 2):
        for policy in ("random", "prefix-hash", "kv-aware"):
            yield f"zipf1.2-{policy}-s{seed}", dict(prefixes=64, zipf_alpha=1.2, seed=seed, requests=600), 6, 8, policy, REFERENCE, seed
            yield f"zipf0.8-{policy}-s{seed}", dict(prefixes=64, zipf_alpha=0.8, seed=seed, requests=600), 6, 16, policy, REFERENCE, seed
            yield (f"mixed-{policy}-s{seed}",
                   dict(prefixes=16, prefix_tokens=LengthDist.parse("500:3000"), suffix_tokens=LengthDist.parse("50:600"),
                        output_tokens=48, seed=seed, requests=400), 4, 8, policy, REFERENCE, seed)
            # Small caches and a small token budget: eviction, preemption and chunked prefill.
            yield (f"tight-{policy}-s{seed}", dict(prefixes=8, seed=seed, requests=300), 3, 16, policy,
                   dict(num_blocks=220, block_size=16), seed)


def record(name, spec_kwargs, workers, concurrency, policy, config_kwargs, seed, timing="reference-gpu"):
    workload = generate(WorkloadSpec(**spec_kwargs))
    cost = get_preset(timing)
    config = WorkerConfig(config_kwargs["num_blocks"], config_kwargs["block_size"], cost)
    options = {"block_size": config.block_size} if "block_size" in policy_parameters(policy) else {}
    if "admission_wait" in policy_parameters(policy):
        options["admission_wait"] = None
    result = run_trial(workload, workers, concurrency, config,
                       make_policy(policy, rng=random.Random(trial_seed(seed, 0)), **options), **SINGLE_STEPS)
    return {
        "name": name, "spec": {k: str(v) for k, v in spec_kwargs.items()}, "workers": workers,
        "concurrency": concurrency, "policy": policy, "config": config_kwargs, "seed": seed, "timing": timing,
        "duration": repr(result.duration_s),
        "records": [[r.index, r.worker, r.cached_tokens, repr(r.ttft_s), repr(r.e2e_s), repr(r.send_time), r.output_tokens]
                    for r in result.records],
        "window": [[s.requests, s.queries, s.hits, s.preempted_requests, s.preempted_queries, s.preempted_hits]
                   for s in result.window_stats],
    }


def main() -> None:
    out = [record(*case) for case in cases()]
    with gzip.open(HERE / "sim_traces.json.gz", "wt") as f:
        json.dump({"about": __doc__.splitlines()[0], "traces": out}, f)
    print(f"{len(out)} traces")


if __name__ == "__main__":
    main()
