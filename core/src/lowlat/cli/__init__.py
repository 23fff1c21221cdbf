"""The ``lowlat`` command: ``plugins | run | serve | make-checkpoint | bench | new-plugin``.

Each subcommand lives in its own module with ``add_parser(subparsers)``; this module only wires them
and turns expected errors into one clear line and exit code 2 (set LOWLAT_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("plugins", "run", "serve", "make_checkpoint", "bench", "new_plugin")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (subcommand modules that are not importable are reported, not hidden)."""
    from lowlat import __version__

    parser = argparse.ArgumentParser(prog="lowlat", description="Low-latency LLM decoding with kernel plugins.")
    parser.add_argument("--version", action="version", version=f"lowlat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"lowlat.cli.{name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lowlat`` console script. Returns the process exit code."""
    from lowlat.cli.errors import one_line_errors

    args = build_parser().parse_args(argv)
    try:
        return one_line_errors(args.command)(args.func)(args)
    except KeyboardInterrupt:
        return 130

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
