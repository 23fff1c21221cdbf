"""Run a lowlat CLI command with one entry of nvidia_mega's launch-plan tables replaced: the B side of an A/B.

An entry goes into ``kernels/tuned_plans.py`` only after a side-by-side run shows the step is faster with it
(docs/kernels.md, "Launch plans"). This runs ``lowlat bench`` (or any ``lowlat`` subcommand) in this process with
``TABLE[(gpu, kind, n, k, dtype)] = VALUE`` set for the GPU's own name and every name it reads
(``tuned_plans.plan_sources``), so the A side is the same command without this wrapper, in the same call:

    python3 bench/scripts/plan_ab.py --table TUNED_ROW1 --key qkv,3072,2048,bfloat16 --value 8,2048,8,1 -- \\
        bench --model llama-3.2-1b --paths general,nvidia_mega --batch-sizes 1 --modes decode --no-plot

``--key`` / ``--value`` may repeat (pairs in order), replacing several entries at once: a plan family measured
together, such as the GEMV's weight stream at o_proj, gate_up and down. ``--value none`` removes the entry instead,
for this GPU's name and every name it reads, so B runs without it: the way to A/B an entry that is already in the
table, or one this GPU reads from another GPU of its chip (the A side then has it). Prints the replaced entries
first. Exit status: the CLI's.

Raises:
    SystemExit: an unknown table; a key that no lookup could read (a kind the table does not have, a non-positive N
        or K, a dtype torch does not name); a value that is not a plan of that table; ``LOWLAT_MEGA_TUNED=0`` (no
        table is read, so B would be A); a command whose work runs in other processes (``serve``, ``bench serve``,
        ``--tp`` above 1), which would never see the replaced entry; one entry named by two ``--key`` arguments.
"""

from __future__ import annotations

import argparse
import sys

import torch

TABLES = ("TUNED", "TUNED_ROW1")
KINDS = {"TUNED": ("qkv", "gemm", "gated"), "TUNED_ROW1": ("qkv", "qkv_late", "gemm", "gated")}


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 usage="%(prog)s --table T --key K --value V -- LOWLAT_SUBCOMMAND [ARGS ...]")
    ap.add_argument("--table", choices=TABLES, required=True)
    ap.add_argument("--key", required=True, action="append",
                    help="kind,N,K,dtype, e.g. qkv,3072,2048,bfloat16 (repeat with --value for several entries)")
    ap.add_argument("--value", required=True, action="append",
                    help="the plan's integers, comma-separated; 'none' removes the entry (a value starting with '-' "
                         "as --value=-1,...)")
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])  # -h / --help print the usage and exit here
    if cut == len(argv):
        ap.error("put the lowlat command after '--', e.g. -- bench --model llama-3.2-1b ...")
    if len(args.key) != len(args.value):
        raise SystemExit(f"plan_ab.py: give one --value per --key: {len(args.key)} keys, {len(args.value)} values")
    return args, argv[cut + 1:]


def _check(table: str, key_arg: str, value_arg: str, rest: list[str], tuned_plans) -> tuple[tuple, tuple | None]:  # type: ignore[no-untyped-def]
    """(key without the GPU name, value or None to remove) of a replacement the production lookups will read;
    SystemExit otherwise."""
    try:
        kind, n, k, dtype = key_arg.split(",")
        key = (kind, int(n), int(k), dtype)
        value = None if value_arg == "none" else tuple(int(v) for v in value_arg.split(","))
    except ValueError as e:
        raise SystemExit(f"plan_ab.py: --key is kind,N,K,dtype and --value integers, or 'none' to remove the "
                         f"entry: {e}") from None
    named = getattr(torch, dtype, None)
    if kind not in KINDS[table] or key[1] < 1 or key[2] < 1 or not isinstance(named, torch.dtype) \
            or str(named) != f"torch.{dtype}":  # the lookups key on str(dtype): 'half' or 'float' is never read
        raise SystemExit(f"plan_ab.py: --key {key_arg!r} is never read: kind one of {', '.join(KINDS[table])}, "
                         "N and K positive, dtype a torch dtype's own name such as bfloat16 or float16")
    try:
        if value is None:
            pass
        elif table == "TUNED_ROW1":
            tuned_plans._row1_entry(kind, key[1], key[2], value)  # the production lookups' own check
        elif len(value) != 5 or min(value) < 1:
            raise ValueError("TUNED takes five positive ints (BLOCK_N, BLOCK_K, split-K, warps, stages)")
    except (TypeError, ValueError) as e:
        raise SystemExit(f"plan_ab.py: --value {value_arg!r} is not a {table} plan: {e}") from None
    try:
        tables_on = tuned_plans.tuned_switch()
    except ValueError as e:
        raise SystemExit(f"plan_ab.py: {e}") from None
    if not tables_on:
        raise SystemExit("plan_ab.py: LOWLAT_MEGA_TUNED turns the tables off, so B would run as A; unset it")
    tp = next((rest[i + 1] if a == "--tp" else a[5:] for i, a in enumerate(rest)
               if a.startswith("--tp=") or (a == "--tp" and i + 1 < len(rest))), "1")
    if rest[:1] == ["serve"] or rest[:2] == ["bench", "serve"] or tp != "1":
        raise SystemExit("plan_ab.py: this command runs its work in other processes, which never see the replaced "
                         "entry; A/B it with `lowlat bench` or `lowlat run` at --tp 1")
    return key, value


def main(argv: list[str] | None = None) -> int:
    args, rest = _parse(sys.argv[1:] if argv is None else argv)
    from lowlat.cli import main as cli_main
    from lowlat_nvidia_mega.kernels import tuned_plans

    pairs = [_check(args.table, k, v, rest, tuned_plans) for k, v in zip(args.key, args.value, strict=True)]
    seen: dict[tuple, str] = {}
    for (key, _), arg in zip(pairs, args.key, strict=True):
        if key in seen:
            raise SystemExit(f"plan_ab.py: --key {arg!r} names the entry {key} that --key {seen[key]!r} named already: "
                             "one value per entry")
        seen[key] = arg
    table = getattr(tuned_plans, args.table)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = set(tuned_plans.plan_sources(dev)) or {tuned_plans.device_name(dev)}
    for key, value in pairs:
        if value is None and not any((name, *key) in table for name in names):
            raise SystemExit(f"plan_ab.py: {args.table} has no entry {key} for {', '.join(sorted(names))} to remove, "
                             "so B would run as A")
    for key, value in pairs:
        for name in sorted(names):
            was = table.pop((name, *key), None)
            print(f"plan_ab: {args.table}[{(name, *key)!r}] = {value!r} (was {was!r})", flush=True)
            if value is not None:
                table[(name, *key)] = value
    return cli_main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
