"""The ``kvroute`` command line.

Each subcommand lives in its own module under ``kvroute.commands`` and provides:

* ``NAME`` and ``HELP`` (one line),
* ``DESCRIPTION`` (the longer ``--help`` text, optional),
* ``add_arguments(parser)`` and ``run(args) -> int``.

Commands are discovered, so adding one means adding a module (named as its command, with
``_`` for ``-``). Only the module of the command given is imported (the others pull in aiohttp,
rich, matplotlib...: ~0.5 s of start-up); ``kvroute --help`` and an unknown command import them
all. A ``UserError`` raised anywhere becomes a one-line error and exit status 2; Ctrl-C exits
130 after the command has saved what it had.
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


def _command_module_names() -> list[str]:
    """The command modules' names, without importing them."""
    import kvroute.commands as package

    return sorted(info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_"))


def _command_modules(only: str | None = None):
    """The command modules, imported: all of them, or the one of command ``only``."""
    for name in _command_module_names():
        if only is None or name == only.replace("-", "_"):
            yield importlib.import_module(f"kvroute.commands.{name}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of command ``only`` alone (a known command's name)."""
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules(only):
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
    argv = sys.argv[1:] if argv is None else argv
    known = {name.replace("_", "-") for name in _command_module_names()}
    parser = build_parser(argv[0] if argv and argv[0] in known else None)
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
