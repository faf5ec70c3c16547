"""Golden runs of the simulator (``kvroute.sim.run_trial``) with the round-robin policy.

Recorded from the Python simulator (``src/kvroute/sim.py`` over the pure-Python engine, at
commit 19c5014, stepping one step at a time) for the
Rust event loop (``crates/kvroute-core/src/sim.rs``) to reproduce exactly: its tests read
``sim_round_robin.txt``. So that Rust can rebuild the very same prompts without numpy, the
tokens come from a small formula (``token``, splitmix64 over the prefix or request number and
the position) instead of ``kvroute.workload.generate``; prefix order, lengths and output
lengths are seeded draws written into the file.

The file is plain text, one ``key values...`` line each (floats as Python's repr, which Rust's
``f64::from_str`` reads back exactly):

    run NAME
    config WORKERS CONCURRENCY NUM_BLOCKS BLOCK_SIZE STEP_BASE PREFILL_TOKEN DECODE_SEQ FRONTEND MAX_BATCHED MAX_SEQS
    prefix_lens L0 L1 ...          (prefix p's tokens: token(p, i))
    warmup PID:SUFFIX_LEN:OUTPUT ...     (request k's suffix tokens: token(SUFFIX_BASE + k, i),
    requests PID:SUFFIX_LEN:OUTPUT ...    k counting warmup then measured requests from 0)
    duration SECONDS
    window REQUESTS QUERIES HITS PREEMPTED_REQUESTS PREEMPTED_QUERIES PREEMPTED_HITS   (one per worker)
    rec INDEX PREFIX_ID SEND PROMPT CACHED TTFT E2E OUTPUT WORKER   (one per measured request)
    end

Re-recorded once, from the native simulator, when the engine model's free order changed
deliberately to vLLM 0.32's (a freed block that holds no hash goes to the head of the free
queue). Re-record only for such a change, with its reason in the commit:

    python tests/data/golden/sim_round_robin.py
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from kvroute.engine import CostModel
from kvroute.routing.policies import make_policy
from kvroute.sim import WorkerConfig, run_trial
from kvroute.workload import RequestSpec, Workload, WorkloadSpec

HERE = Path(__file__).parent
MASK = (1 << 64) - 1
SUFFIX_BASE = 1 << 40


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def token(stream: int, i: int) -> int:
    """Token ``i`` of stream ``stream`` (a prefix id, or SUFFIX_BASE + request number)."""
    return 1000 + splitmix64(stream * 1_000_003 + i) % 29000


def tokens(stream: int, n: int) -> np.ndarray:
    return np.array([token(stream, i) for i in range(n)], dtype=np.uint32)


REFERENCE = (0.006, 0.0000334, 0.0002, 0.0226, 8192, 256)  # reference-gpu

#: name, W, c, K, seed, num_blocks, block size, cost, prefix lens (lo, hi), suffix lens,
#: output lens (lo, hi), measured requests, Zipf-ish skew (0: uniform)
RUNS = [
    *(
        (f"reference_w{w}_k{k}_c{c}", w, c, k, 100 + 10 * w + k + c, 585, 16, REFERENCE,
         (2032, 2032), (339, 339), (64, 64), max(200, 20 * k) // 2, 0.0)
        for w in (3, 6) for k in (2, 24) for c in (4, 8)
    ),
    ("small_kv_mixed", 4, 12, 6, 7, 160, 16, REFERENCE, (200, 1500), (0, 400), (1, 150), 150, 1.0),
    ("instant_ties", 3, 5, 4, 8, 120, 8, (0.0, 0.0, 0.0, 0.0, 8192, 256), (40, 300), (1, 80),
     (1, 30), 120, 0.5),
    ("chunked_seqcap", 2, 9, 3, 9, 300, 16, (0.003, 0.00002, 0.0001, 0.01, 256, 4), (100, 900),
     (10, 200), (1, 60), 100, 0.0),
]


def build(run) -> tuple[Workload, WorkerConfig, list[str]]:
    name, w, c, k, seed, num_blocks, bs, cost, plens, slens, olens, n, skew = run
    rng = random.Random(seed)
    prefix_lens = [rng.randint(*plens) for _ in range(k)]
    prefixes = [tokens(p, n_) for p, n_ in enumerate(prefix_lens)]
    weights = [(i + 1) ** -skew for i in range(k)]
    order = list(range(k)) + [rng.choices(range(k), weights)[0] for _ in range(n)]
    max_out = olens[1]
    specs = []
    lines = []
    for j, pid in enumerate(order):
        sl = rng.randint(*slens)
        if prefix_lens[pid] + sl == 0:
            sl = 1
        out = rng.randint(*olens)
        warm = j < k
        specs.append(RequestSpec(j if warm else j - k, pid, prefixes[pid], tokens(SUFFIX_BASE + j, sl),
                                 out, warm))
        lines.append(f"{pid}:{sl}:{out}")
    spec = WorkloadSpec(prefixes=k, output_tokens=max_out, requests=n, seed=seed)
    work = Workload(spec, prefixes, specs[:k], specs[k:])
    base, pt, ds, fe, mb, ms = cost
    config = WorkerConfig(num_blocks, bs, CostModel("golden", base, pt, ds, fe, mb, ms))
    header = [
        f"run {name}",
        f"config {w} {c} {num_blocks} {bs} {base!r} {pt!r} {ds!r} {fe!r} {mb} {ms}",
        "prefix_lens " + " ".join(map(str, prefix_lens)),
        "warmup " + " ".join(lines[:k]),
        "requests " + " ".join(lines[k:]),
    ]
    return work, config, header


def record(run) -> list[str]:
    work, config, out = build(run)
    workers, concurrency = run[1], run[2]
    # Recorded from the Python simulator's single steps (coalesce=False, at 19c5014): its
    # coalesced decode runs equalled them except with zero-time steps (instant_ties), where a
    # run lumped steps an arrival at the same instant would have fallen between. Today's
    # simulator only steps singly.
    result = run_trial(work, workers, concurrency, config, make_policy("round-robin"))
    out.append(f"duration {result.duration_s!r}")
    for s in result.window_stats:
        out.append(f"window {s.requests} {s.queries} {s.hits} {s.preempted_requests} "
                   f"{s.preempted_queries} {s.preempted_hits}")
    for r in result.records:
        worker = int(r.worker.rsplit("-", 1)[1])
        out.append(f"rec {r.index} {r.prefix_id} {r.send_time!r} {r.prompt_tokens} {r.cached_tokens} "
                   f"{r.ttft_s!r} {r.e2e_s!r} {r.output_tokens} {worker}")
    out.append("end")
    hits = sum(1 for r in result.records if r.cached_tokens)
    print(f"{run[0]}: {len(result.records)} requests, {hits} with a hit, {result.duration_s:.3f} s")
    return out


def main() -> None:
    lines: list[str] = []
    for run in RUNS:
        lines += record(run)
    (HERE / "sim_round_robin.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
