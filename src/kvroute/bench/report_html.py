"""``report.html``: one self-contained page with a bench run's tables and plots."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from kvroute.errors import UserError

#: Settings too long for the page's settings block (they are in summary.json).
_LONG_SETTING_CHARS = 300


def _setting(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > _LONG_SETTING_CHARS:
        if isinstance(value, dict) and isinstance(value.get("points"), list):
            return f"{len(value['points'])} points (in summary.json)"
        return f"{len(text):,} characters (in summary.json)"
    return text


def _summary_line(meta: dict) -> str:
    """The run in one line: what was measured, on what, and whether it finished."""
    parts = []
    for key, label in (("engine", "engine"), ("workers", "workers"), ("topologies", "topologies"),
                       ("timing", "timing"), ("trials", "trials")):
        value = meta.get(key)
        if value not in (None, [], ""):
            shown = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
            parts.append(f"{label} {shown}")
    if meta.get("capacity_requests") is not None:
        parts.append(f"C = {meta['capacity_requests']:.2f} requests fit in one worker's KV cache")
    line = " · ".join(parts)
    if meta.get("partial"):
        line += " · stopped early: what was measured"
    return line


#: What each plot shows, as its caption in the report (the file name is in the image's title).
PLOT_CAPTIONS = {
    "hit_rate_vs_k.png": "Request hit rate against K, the number of distinct shared prefixes: measured "
                         "(lines, one colour per topology), the simulator's prediction (crosses), "
                         "min(1, C/K) (dashed) and the routing bound min(1, W·C/K) (dotted).",
    "ttft_cdf.png": "Time to first token, cumulative, at the lowest concurrency: hits (solid) and misses "
                    "(dashed) per topology. A few misses are drawn as points.",
    "ttft_vs_concurrency.png": "Time to first token as concurrency rises: median (p50, solid) and tail "
                               "(p99, dashed) per topology.",
    "hit_rate_over_time.png": "Token hit ratio over the replay, measured and as the simulator replays "
                              "the same requests.",
    "worker_load_over_time.png": "Requests in flight on each worker over the replay: a hotspot is one "
                                 "line far above the others.",
}


def write_html(path: Path, meta: dict, tables_html: str, pngs: list[Path], lead_html: str | None = None,
               headline_text: str | None = None) -> Path:
    """One self-contained page that leads with the answer: a headline sentence, the hit-rate
    table (``lead_html``, when given apart) beside the hit-rate plot, then the other tables and
    plots, each with a caption saying what it shows; the run's settings last, folded. Tables
    as rendered in the terminal (with their colours), plots as base64 PNGs."""

    def figure(p: Path) -> str:
        caption = PLOT_CAPTIONS.get(p.name, p.name)
        return (f'<figure><img alt="{html.escape(caption)}" title="{html.escape(p.name)}" '
                f'src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
                f'<figcaption>{html.escape(caption)}</figcaption></figure>')

    lead_pngs = [p for p in pngs if p.name in ("hit_rate_vs_k.png", "hit_rate_over_time.png")]
    other_pngs = [p for p in pngs if p not in lead_pngs]
    settings = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_setting(v))}</td></tr>" for k, v in meta.items()
    )
    command = str(meta.get("command") or "bench")
    title = f"kvroute {command} report"
    lead = lead_html if lead_html is not None else tables_html
    rest = tables_html if lead_html is not None else ""
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em 2em; max-width: 96em; color: #222; }}
h1 {{ margin-bottom: 0.2em; }}
p.headline {{ font-size: 1.15em; margin: 0.3em 0; }}
p.summary {{ color: #555; margin-top: 0; }}
.lead {{ display: flex; flex-wrap: wrap; gap: 1.5em; align-items: flex-start; }}
pre {{ font-size: 13px; line-height: 1.25; margin: 0; }}
figure {{ display: inline-block; margin: 0 1em 1em 0; }}
figcaption {{ color: #555; font-size: 13px; max-width: 46em; }}
img {{ max-width: 100%; }}
details {{ margin-top: 2em; }}
summary {{ cursor: pointer; font-weight: 600; }}
table.meta th {{ text-align: left; padding-right: 1em; vertical-align: top; }}
table.meta td {{ font-family: ui-monospace, monospace; font-size: 13px; }}
</style></head>
<body>
<h1>{html.escape(title)}</h1>
{f'<p class="headline">{html.escape(headline_text)}</p>' if headline_text else ""}
<p class="summary">{html.escape(_summary_line(meta))}</p>
<section class="lead" id="answer">
<div class="tables">{lead}</div>
{"".join(figure(p) for p in lead_pngs)}
</section>
{f'<h2>Latency and throughput</h2><section id="tables">{rest}</section>' if rest else ""}
{f'<h2>Plots</h2><section id="plots">{"".join(figure(p) for p in other_pngs)}</section>' if other_pngs else ""}
<details id="settings"><summary>Settings</summary>
<table class="meta">{settings}</table>
</details>
</body></html>
"""
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def tables_as_html(render) -> str:
    """Run ``render(console)`` on a recording rich console and return the output as an HTML
    fragment with inline styles (so the page needs no stylesheet)."""
    from rich.console import Console

    console = Console(record=True, file=io.StringIO(), width=140, force_terminal=True)
    render(console)
    return console.export_html(inline_styles=True, code_format="<pre>{code}</pre>")
