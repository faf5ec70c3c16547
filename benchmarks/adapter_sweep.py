"""kv-aware's adapter term on the simulator: ``kvroute sim`` on the tenant workload for each
``adapter_weight``, ``--max-loras`` and workload seed, then per (weight, max_loras, c) the
median and range over the seeds of the request hit rate and TTFT p50 / p99.

    python benchmarks/adapter_sweep.py                                   # the docs' sweep
    python benchmarks/adapter_sweep.py --weights 0,1024 --seeds 0,1 --max-loras 1
    python benchmarks/adapter_sweep.py --plain       # the same without tenants (the term is idle)

Each point's JSON (``kvroute sim --json``) is kept under ``--out``; the table is printed as
Markdown, for docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="adapter_sweep.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default="0,256,512,1024,2048,4096",
                   help="adapter_weight values; 'default' runs without the option (default %(default)s)")
    p.add_argument("--max-loras", default="1,2,4", help="vLLM's --max-loras values (default %(default)s)")
    p.add_argument("--seeds", default="0,1,2,3,4", help="workload seeds (default %(default)s)")
    p.add_argument("--concurrency", "-c", default="8,16", help="closed-loop levels (default %(default)s)")
    p.add_argument("--workers", "-W", type=int, default=6)
    p.add_argument("--prefixes", "-K", type=int, default=24)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--adapter-zipf", type=float, default=1.0)
    p.add_argument("--plain", action="store_true", help="no adapters nor salts (one max_loras row)")
    p.add_argument("--out", type=Path, default=Path("kvroute-results/adapter-sweep"))
    args = p.parse_args(argv)
    try:
        args.weight_list = [None if w.strip() == "default" else float(w) for w in args.weights.split(",") if w.strip()]
        args.loras, args.seed_list, args.levels = ints(args.max_loras), ints(args.seeds), ints(args.concurrency)
    except ValueError as exc:
        p.error(f"expected comma-separated numbers: {exc}")
    if args.plain:
        args.loras = [0]
    return args


def label(weight: float | None) -> str:
    return "default" if weight is None else f"{weight:g}"


def run_point(args: argparse.Namespace, weight: float | None, max_loras: int, seed: int) -> list[dict]:
    """One ``kvroute sim`` run (every concurrency level): its points."""
    path = args.out / f"w{label(weight)}-l{max_loras}-s{seed}.json"
    cmd = [sys.executable, "-m", "kvroute", "sim", "-W", str(args.workers), "-K", str(args.prefixes),
           "-c", ",".join(map(str, args.levels)), "--policy", "kv-aware", "--trials", "1",
           "--seed", str(seed), "--json", str(path)]
    if weight is not None:
        cmd += ["--policy-option", f"adapter_weight={weight:g}"]
    if not args.plain:
        cmd += ["--adapters", str(args.adapters), "--adapter-zipf", f"{args.adapter_zipf:g}", "--salted",
                "--max-loras", str(max_loras)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())["points"]


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    total = len(args.weight_list) * len(args.loras) * len(args.seed_list)
    done = 0
    for max_loras in args.loras:
        for weight in args.weight_list:
            by_c: dict[int, list[dict]] = {c: [] for c in args.levels}
            for seed in args.seed_list:
                for point in run_point(args, weight, max_loras, seed):
                    by_c[point["concurrency"]].append(point)
                done += 1
                print(f"\r{done}/{total} runs", end="", file=sys.stderr, flush=True)
            for c, points in by_c.items():
                rows.append((max_loras or "-", label(weight), c,
                             spread([p["request_hit_rate"] for p in points], ".3f"),
                             spread([p["ttft_p50_ms"] for p in points], ".0f"),
                             spread([p["ttft_p99_ms"] for p in points], ".0f")))
    print(file=sys.stderr)
    print(f"median (min–max) over workload seeds {args.seeds}; W={args.workers}, K={args.prefixes}"
          + ("" if args.plain else f", {args.adapters} adapters (Zipf {args.adapter_zipf:g}), salted"))
    print("\n| max_loras | adapter_weight | c | hit rate | TTFT p50 ms | TTFT p99 ms |\n|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
