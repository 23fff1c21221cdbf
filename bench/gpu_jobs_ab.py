"""The A/B job of nvidia_mega's launch-plan tables and switches (``mega-ab``): bench/gpu_jobs.py runs it.

Stdlib only: it runs on the device image as it is.
"""

from __future__ import annotations

import os

from gpu_job_base import LOWLAT, PY, Options, Step, slug


def mega_ab(o: Options) -> list[Step]:
    """nvidia_mega's step with one change (B) against the code as it is (A), A B A B per model in one call, each
    beside the general path: DECODE at ``BATCHES`` (default 1). B is one plan-table entry replaced
    (``bench/scripts/plan_ab.py``, ``AB_TABLE`` / ``AB_KEY`` / ``AB_VALUE``), or, with ``AB_ENV=NAME=VALUE``, the
    same command with that nvidia_mega switch set (e.g. ``LOWLAT_MEGA_MOE_CONFIG=down_warps=4``). ``AB_KEY`` and
    ``AB_VALUE`` may hold several entries separated by ``;`` (pairs in order, replaced together). ``AB_VALUE=none``
    removes the entry instead; the default is that for llama-3.2-1b's qkv_rope in the row-pair form (in both chips'
    tables since bench/results/2026-12-06-h200-mega-ab), i.e. what the entry buys. ``AB_PATHS=nvidia_mega`` leaves
    the general path out (two engines of qwen3-30b-a3b do not fit an H100's 80 GB)."""
    out = os.environ.get("OUT", "/tmp/out")
    env_name, eq, env_value = os.environ.get("AB_ENV", "").partition("=")
    if env_name and not (env_name.startswith("LOWLAT_MEGA_") and eq and env_value.strip()):
        raise SystemExit(f"AB_ENV={os.environ['AB_ENV']!r}: give NAME=VALUE, an nvidia_mega switch (LOWLAT_MEGA_*) "
                         "and a value (empty would run B as A)")
    table_vars = [v for v in ("AB_TABLE", "AB_KEY", "AB_VALUE") if os.environ.get(v)]
    if env_name and table_vars:
        raise SystemExit(f"AB_ENV and {', '.join(table_vars)} both set: one change per A/B (B would ignore the entry)")
    paths = os.environ.get("AB_PATHS", "general,nvidia_mega").split(",")
    if "nvidia_mega" not in paths or not all(p.strip() for p in paths):
        raise SystemExit(f"AB_PATHS={','.join(paths)!r}: comma-separated paths without empty items, nvidia_mega "
                         "among them (the A/B is nvidia_mega's)")
    table, keys, values = _table_change()
    ab = ["--table", table, *(a for k, v in zip(keys, values, strict=True) for a in ("--key", k, "--value", v)), "--"]
    b_cmd = LOWLAT if env_name else [PY, "bench/scripts/plan_ab.py", *ab]
    args = ["--paths", ",".join(paths),
            "--batch-sizes", os.environ.get("BATCHES", "1"), "--modes", "decode",
            "--context", "1024", "--input-sets", "2", "--warmup", "5", "--iters", "50", "--no-plot"]
    return [Step(f"{side}{i} {m}", 150,
                 [*(b_cmd if side == "B" else LOWLAT), "bench", "--model", m, *args,
                  "--out", f"{out}/ab_{side}{i}_{m}"],
                 f"ab_{side}{i}_{slug(m)}.txt", r"plan_ab|L=\d+ DECODE|could not start",
                 env={env_name: env_value} if side == "B" and env_name else {})
            for m in o.models for i in (1, 2) for side in ("A", "B")]


def _table_change() -> tuple[str, list[str], list[str]]:
    """``AB_TABLE``, ``AB_KEY`` and ``AB_VALUE`` (defaults where unset), checked when the job is built, so an A/B that
    could only fail in its B steps never spends device time on its A steps: a known table, ``;``-separated items
    without blanks or surrounding spaces, keys of kind,N,K,dtype with integer N and K, each named once, values of
    comma-separated integers or ``none``, one value per key. ``plan_ab.py`` checks the rest on the device (kinds,
    plans).

    Raises:
        SystemExit: naming the variable and the item.
    """
    table = os.environ.get("AB_TABLE", "TUNED_ROW1")
    if table not in ("TUNED", "TUNED_ROW1"):
        raise SystemExit(f"AB_TABLE={table!r}: TUNED or TUNED_ROW1")
    items = {}
    for var, default in (("AB_KEY", "qkv,3072,2048,bfloat16"), ("AB_VALUE", "none")):
        raw = os.environ.get(var, default)
        items[var] = raw.split(";")
        for it in items[var]:
            if not it or it != it.strip():
                raise SystemExit(f"{var}={raw!r}: an empty item or one with spaces around it ({it!r}); give "
                                 "';'-separated items without blanks")
    keys, values = items["AB_KEY"], items["AB_VALUE"]
    if len(keys) != len(values):
        raise SystemExit(f"AB_KEY has {len(keys)} entries and AB_VALUE {len(values)} (';'-separated): give one value "
                         "per key")
    seen = set()
    for key in keys:
        parts = key.split(",")
        if len(parts) != 4 or not all(p.lstrip("-").isdigit() for p in parts[1:3]):
            raise SystemExit(f"AB_KEY item {key!r}: kind,N,K,dtype with integer N and K")
        norm = (parts[0], int(parts[1]), int(parts[2]), parts[3])
        if norm in seen:
            raise SystemExit(f"AB_KEY item {key!r} names an entry given already: one value per entry")
        seen.add(norm)
    for value in values:
        if value != "none" and not all(v.lstrip("-").isdigit() for v in value.split(",")):
            raise SystemExit(f"AB_VALUE item {value!r}: comma-separated integers, or none")
    return table, keys, values
