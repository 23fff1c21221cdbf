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
                    "LOWLAT_CHECKOUT/contract_tests pytest -e DIR, TRITON_INTERPRET=1 pytest --pyargs "
                    "lowlat_contract --lowlat-plugin NAME.")
    p.add_argument("name", metavar="NAME", help="the plugin name (--plugin NAME), a lower-case identifier")
    p.add_argument("--dir", metavar="D", default=None, help="where to write it (default ./lowlat-NAME)")
    p.add_argument("--force", action="store_true", help="overwrite the generated files in a non-empty --dir")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Write the files and print what to run next (with this core's checkout, where to install the suite from)."""
    from lowlat.kit import lowlat_checkout, plugin_names, write_plugin

    files = write_plugin(args.name, args.dir, force=args.force)
    root = Path(args.dir) if args.dir else Path.cwd() / plugin_names(args.name).distribution
    for f in files:
        print(f"wrote {f}")
    print("\n" + "\n".join(next_steps(args.name, root, lowlat_checkout())))
    return 0


def next_steps(name: str, root: Path, checkout: Path | None) -> list[str]:
    """The lines after "next:": install the contract suite, pytest and the plugin, then its tests and the suite.

    ``checkout``: the lowlat checkout core runs from (its ``contract_tests`` is installed from there: the suite
    is not on a package index), or None (a core from a wheel: install the suite's wheel from ``nox -s build``).
    """
    suite = f"-e {checkout / 'contract_tests'}" if checkout is not None else "-e LOWLAT/contract_tests"
    lines = ["next, in the environment lowlat is installed in (activate it, e.g. `. .venv/bin/activate`, or call "
             "its bin/pip and bin/pytest):",
             f"  pip install {suite} pytest -e {root}"]
    if checkout is None:
        lines.append("    (LOWLAT: a lowlat checkout; or the lowlat_contract_tests wheel from `nox -s build` there)")
    return lines + [f"  TRITON_INTERPRET=1 pytest -q {root / 'tests'}",
                    f"  TRITON_INTERPRET=1 pytest -q --pyargs lowlat_contract --lowlat-plugin {name}"]
