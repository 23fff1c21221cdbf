"""Run a lowlat CLI command with one entry of nvidia_mega's launch-plan tables replaced: the B side of an A/B.

An entry goes into ``kernels/tuned_plans.py`` only after a side-by-side run shows the step is faster with it
(docs/kernels.md, "Launch plans"). This runs ``lowlat bench`` (or any ``lowlat`` subcommand) in this process with
``TABLE[(gpu, kind, n, k, dtype)] = VALUE`` set for the GPU's own name and every name it reads
(``tuned_plans.plan_sources``), so the A side is the same command without this wrapper, in the same call:

    python3 bench/scripts/plan_ab.py --table TUNED_ROW1 --key qkv,3072,2048,bfloat16 --value 8,2048,8,1 -- \\
        bench --model llama-3.2-1b --paths general,nvidia_mega --batch-sizes 1 --modes decode --no-plot

Prints the replaced entries first. Exit status: the CLI's.

Raises:
    SystemExit: an unknown table, or a key / value that is not comma-separated integers where the table has them.
"""

from __future__ import annotations

import argparse
import sys

import torch

TABLES = ("TUNED", "TUNED_ROW1")


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 usage="%(prog)s --table T --key K --value V -- LOWLAT_SUBCOMMAND [ARGS ...]")
    ap.add_argument("--table", choices=TABLES, required=True)
    ap.add_argument("--key", required=True, help="kind,N,K,dtype, e.g. qkv,3072,2048,bfloat16")
    ap.add_argument("--value", required=True, help="the plan's integers, comma-separated")
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])  # -h / --help print the usage and exit here
    if cut == len(argv):
        ap.error("put the lowlat command after '--', e.g. -- bench --model llama-3.2-1b ...")
    return args, argv[cut + 1:]


def main(argv: list[str] | None = None) -> int:
    args, rest = _parse(sys.argv[1:] if argv is None else argv)
    from lowlat.cli import main as cli_main
    from lowlat_nvidia_mega.kernels import tuned_plans

    try:
        kind, n, k, dtype = args.key.split(",")
        key = (kind, int(n), int(k), dtype)
        value = tuple(int(v) for v in args.value.split(","))
    except ValueError as e:
        raise SystemExit(f"plan_ab.py: --key is kind,N,K,dtype and --value integers: {e}") from None
    table = getattr(tuned_plans, args.table)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = set(tuned_plans.plan_sources(dev)) or {tuned_plans.device_name(dev)}
    for name in sorted(names):
        print(f"plan_ab: {args.table}[{(name, *key)!r}] = {value!r} (was {table.get((name, *key))!r})", flush=True)
        table[(name, *key)] = value
    return cli_main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
