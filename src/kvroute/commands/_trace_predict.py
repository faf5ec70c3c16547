"""``kvroute predict --trace``: a trace's own reuse structure, printed, plotted and saved.

The flags (``add_arguments``) and the run (``run``) for ``kvroute.commands.predict``; the
analysis itself is ``kvroute.trace.reuse``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from rich import box
from rich.table import Table

from kvroute.commands._common import add_trace_window_arguments
from kvroute.errors import UserError
from kvroute.report import output_console
from kvroute.trace import load_trace
from kvroute.trace.format import trace_path
from kvroute.trace.plots import write_plots
from kvroute.trace.reuse import POLICIES, TraceReuse, _fmt_tokens, analyze
from kvroute.workload import parse_int_list

#: The paper's (Mooncake, FAST'25) figures for its traces, for the side-by-side line.
PAPER = {
    "synthetic_trace.jsonl": "paper: cache ratio 66% (Table 2); 3M-token LRU ≈ 48% of max (Figure 9)",
    "conversation_trace.jsonl": "paper: cache ratio 40% (Table 2)",
    "toolagent_trace.jsonl": "paper: cache ratio 59% (Table 2)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("trace (instead of a workload shape)")
    g.add_argument("--trace", type=trace_path, default=None, metavar="JSONL|synthetic",
                   help="analyze a trace: Mooncake's format (hash_ids) or kvroute's, auto-detected; `synthetic`: Mooncake's synthetic trace, shipped with kvroute")
    add_trace_window_arguments(g)
    g.add_argument("--warmup", type=float, default=0.0, metavar="S",
                   help="requests of the first S seconds fill the caches but are not counted")
    g.add_argument("--seed", type=int, default=0, help="random balancing's draws (default 0)")
    g.add_argument("--out", type=Path, default=None,
                   help="folder for summary.json and the plots (default ./kvroute-results/predict-<time>)")


def run(args: argparse.Namespace, capacity_of: Callable[[argparse.Namespace], tuple[int, str]]) -> int:
    workers = parse_int_list(args.workers or "8", "--workers")
    if min(workers) < 1:
        raise UserError("--workers must be >= 1")
    capacity, capacity_from = capacity_of(args)
    trace = load_trace(args.trace).select(args.start, args.duration, args.max_requests, args.cut_sessions)
    reuse = analyze(trace, workers, capacity, args.seed, args.warmup)
    console = output_console()
    _print(console, reuse, capacity_from)
    out = args.out or Path("kvroute-results") / time.strftime("predict-%Y%m%d-%H%M%S")
    try:
        paths = write_plots(reuse, out)
        summary = out / "summary.json"
        summary.write_text(json.dumps(reuse.to_json(), indent=2) + "\n")
        if args.json is not None:
            args.json.write_text(json.dumps(reuse.to_json(), indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write to {out}: {exc.strerror or exc}") from None
    console.print(f"wrote {out}/: summary.json, {', '.join(p.name for p in paths)}"
                  + (f"; {args.json}" if args.json is not None else ""))
    return 0


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _print(console, reuse: TraceReuse, capacity_from: str) -> None:
    s = reuse.summary
    console.print(
        f"[bold]{Path(s['path']).name}[/] ({s['format']} format): {s['requests']:,} requests in "
        f"{s['sessions']:,} sessions over {s['duration_s']:,.0f} s; mean input "
        f"{s['mean_input_tokens']:,.0f} tokens (max {s['max_input_tokens']:,}), mean output "
        f"{s['mean_output_tokens']:,.0f}",
        highlight=False,
    )
    if s.get("warmup_s"):
        console.print(f"requests of the first {s['warmup_s']:g} s warm the caches and are not counted",
                      highlight=False)
    head = s["common_head_blocks"]
    console.print(
        "sessions: requests sharing their first hash id"
        + (f" after the {head}-block head every request starts with" if head else ""),
        highlight=False,
    )
    x = reuse.capacity_tokens
    inf = reuse.infinite

    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, title="one cache, no engine")
    for name in ("cache", "tokens hit", "blocks hit", "full blocks hit", "of max (tokens)"):
        t.add_column(name, justify="left" if name == "cache" else "right", no_wrap=True)
    t.add_row("infinite", _pct(inf["token_hit_ratio"]), _pct(inf["block_hit_ratio"]),
              _pct(inf["full_block_hit_ratio"]), "100%")
    for c in sorted({10**4, 10**5, 10**6, x, 10**7, 10**8}):
        a = reuse.single.at(c)
        t.add_row(f"LRU {_fmt_tokens(c)} tokens" + (" (X)" if c == x else ""), _pct(a["token_hit_ratio"]),
                  _pct(a["block_hit_ratio"]), _pct(a["full_block_hit_ratio"]), _pct(reuse.fraction_of_max(c)))
    console.print(t)
    paper = PAPER.get(Path(s["path"]).name)
    if paper:
        console.print(
            f"{paper}; here: infinite {_pct(inf['full_block_hit_ratio'])} of full blocks, "
            f"{_pct(inf['token_hit_ratio'])} of tokens; LRU at {_fmt_tokens(x)} = "
            f"{reuse.fraction_of_max(x):.0%} of max",
            highlight=False,
        )
    f = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
              title=f"W workers of X = {_fmt_tokens(x)} tokens each ({capacity_from})")
    for name in ("W", *POLICIES, "busiest worker (random / affine)"):
        f.add_column(name, justify="right", no_wrap=True)
    for fl in reuse.fleets:
        f.add_row(str(fl.workers), *(_pct(float(fl.curves[p].token_hit(x))) for p in POLICIES),
                  f"{fl.busiest_share('random'):.2f}× / {fl.busiest_share('prefix-affine'):.2f}× mean")
    console.print(f)
    console.print(
        "token hit ratios; random: a Service (seeded uniform draws); prefix-affine: a hash of the "
        "session key picks the worker; pooled: one LRU of W·X (a shared KV store). A block hits "
        "only if all blocks before it in the prompt hit; output tokens are not cached.",
        highlight=False,
    )

