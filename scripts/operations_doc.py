#!/usr/bin/env python
"""Regenerate the generated parts of docs/operations.md from the code itself.

The flag tables come from each command's argparse parser (the same text as ``--help``); the
metrics table from a running router's ``/metrics`` (``# HELP`` and ``# TYPE`` lines). Each part
sits between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->`` markers; the prose
around them is written by hand. tests/docs/test_operations_doc.py fails when a part is stale.

    python scripts/operations_doc.py --write                          # flag tables
    python scripts/operations_doc.py --write --metrics-url http://127.0.0.1:8000/metrics
"""

from __future__ import annotations

import argparse
import re
import sys
import urllib.request
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
#: The commands whose flags the reference lists, in its order.
COMMANDS = ("serve", "epp", "emulate", "bench", "experiment", "sim")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def flags_table(command: str) -> str:
    """A Markdown table of ``kvroute COMMAND``'s flags: names, default, help (as --help has it)."""
    from kvroute.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.choices[command]
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for group in p._action_groups:
        for action in group._group_actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            names = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.metavar and action.nargs != 0:
                names += f" {_cell(str(action.metavar))}"
            help_text = p._get_formatter()._expand_help(action) if action.help else ""
            default = action.default
            shown = "" if default in (None, [], False) or default is argparse.SUPPRESS else f"`{default}`"
            if action.choices and not isinstance(action.choices, dict):
                help_text += f" (one of: {', '.join(map(str, action.choices))})"
            rows.append(f"| {names} | {shown} | {_cell(help_text)} |")
    return "\n".join(rows)


def metrics_table(text: str) -> str:
    """A Markdown table of the metrics a ``/metrics`` answer describes (HELP and TYPE)."""
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if m := re.match(r"# HELP (\S+) (.*)", line):
            helps[m[1]] = m[2]
        elif m := re.match(r"# TYPE (\S+) (\S+)", line):
            types[m[1]] = m[2]
    rows = ["| metric | type | what it counts |", "|---|---|---|"]
    rows += [f"| `{name}` | {types.get(name, '')} | {_cell(helps[name])} |" for name in helps]
    return "\n".join(rows)


def replace_part(doc: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- generated:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- /generated:{re.escape(name)} -->)", re.S)
    if not pattern.search(doc):
        raise SystemExit(f"{DOC}: no <!-- generated:{name} --> part")
    return pattern.sub(lambda m: m[1] + body + "\n" + m[2], doc)


def generated(doc: str, metrics_url: str | None) -> str:
    for command in COMMANDS:
        doc = replace_part(doc, f"flags:{command}", flags_table(command))
    if metrics_url:
        with urllib.request.urlopen(metrics_url, timeout=10) as answer:
            doc = replace_part(doc, "metrics", metrics_table(answer.read().decode()))
    return doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite docs/operations.md (else: check it)")
    parser.add_argument("--metrics-url", help="a running router's /metrics, for the metrics table")
    args = parser.parse_args()
    doc = DOC.read_text()
    new = generated(doc, args.metrics_url)
    if args.write:
        DOC.write_text(new)
        return 0
    if new != doc:
        print(f"{DOC} is stale: run python scripts/operations_doc.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
