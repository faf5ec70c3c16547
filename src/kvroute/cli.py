"""The ``kvroute`` command line.

Each subcommand lives in its own module under ``kvroute.commands`` and provides:

* ``NAME`` and ``HELP`` (one line),
* ``DESCRIPTION`` (the longer ``--help`` text, optional),
* ``add_arguments(parser)`` and ``run(args) -> int``.

Commands are discovered, so adding one means adding a module. A ``UserError`` raised anywhere
becomes a one-line error and exit status 2; Ctrl-C exits 130 after the command has saved what
it had.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from kvroute import __version__
from kvroute.errors import UserError

DESCRIPTION = """\
kvroute measures, predicts and fixes prefix-cache reuse across a fleet of vLLM workers.

Behind an ordinary load balancer every replica recomputes and stores every shared prefix, so
the hit rate is about min(1, C/K) whatever the number of workers W; routing each request to
the worker that holds its prefix raises the bound to min(1, W*C/K).
"""


def _command_modules():
    import kvroute.commands as package

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"kvroute.commands.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        p = sub.add_parser(
            module.NAME,
            help=module.HELP,
            description=getattr(module, "DESCRIPTION", module.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        print(f"kvroute {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvroute {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
