"""``lowlat new-plugin NAME [--dir D]``: write a plugin distribution that passes the contract suite as generated.

The distribution (``lowlat.kit``): pyproject with the entry point and core range, spec, build, a Triton
kernel with its launcher and interpreter test, a README and a CI snippet that runs the contract suite.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``new-plugin`` subcommand to ``subparsers``; it sets ``func=run``."""
    p = subparsers.add_parser(
        "new-plugin", help="write a new plugin distribution (spec, build, a Triton kernel, tests, CI)",
        description="Write a plugin distribution lowlat-NAME that passes the contract suite as generated: "
                    "lowlat's reference decode step with its norm stage as a Triton kernel. Then: pip install -e "
                    "DIR, TRITON_INTERPRET=1 pytest --pyargs lowlat_contract --lowlat-plugin NAME.")
    p.add_argument("name", metavar="NAME", help="the plugin name (--plugin NAME), a lower-case identifier")
    p.add_argument("--dir", metavar="D", default=None, help="where to write it (default ./lowlat-NAME)")
    p.add_argument("--force", action="store_true", help="overwrite the generated files in a non-empty --dir")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Write the files and print what to run next."""
    from lowlat.kit import plugin_names, write_plugin

    files = write_plugin(args.name, args.dir, force=args.force)
    root = Path(args.dir) if args.dir else Path.cwd() / plugin_names(args.name).distribution
    for f in files:
        print(f"wrote {f}")
    print(f"\nnext:\n  pip install -e {root}\n  TRITON_INTERPRET=1 pytest -q {root / 'tests'}\n"
          f"  TRITON_INTERPRET=1 pytest -q --pyargs lowlat_contract --lowlat-plugin {args.name}")
    return 0
