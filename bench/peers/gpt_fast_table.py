"""One markdown table: gpt-fast's ms/token beside lowlat's e2e TPOT and step latency, with the ratios.

    python3 bench/peers/gpt_fast_table.py gpt_fast_peer_*.json --lowlat gpt_fast_lowlat_*.json [--out table.md]

Inputs are the JSON files of ``gpt_fast.py measure --json`` (``{"results": [...], "failed": [...]}``) and of
``bench/scripts/e2e_tpot.py --json`` (``{"rows": [...], "failed": [...]}``). ``x gpt-fast`` is gpt-fast's
decode-only ms over the row's overlapped TPOT (above 1: faster than gpt-fast; issue 17's target "within 10% of
gpt-fast" is x >= 1/1.1 = 0.909). Only batch-1 lowlat rows are compared (gpt-fast runs batch 1).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TARGET = 1 / 1.1  # issue 17: the general path within 10% of gpt-fast at batch 1


def render(gpt_fast: list[dict[str, Any]], lowlat: list[dict[str, Any]]) -> str:
    """The table (markdown) and a line per failure; an error line where a model has no gpt-fast figure.

    Raises:
        ValueError: an input is neither kind of file (no "results" nor "rows" key).
    """
    peers: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for doc in gpt_fast:
        if "results" not in doc:
            raise ValueError("not a gpt_fast.py measure JSON (no 'results' key)")
        peers.update({r["model"]: r for r in doc["results"]})
        notes += [f"gpt-fast {f['model']}: failed: {f['error'].splitlines()[0]}" for f in doc.get("failed", [])]
    rows: list[dict[str, Any]] = []
    for doc in lowlat:
        if "rows" not in doc:
            raise ValueError("not an e2e_tpot.py JSON (no 'rows' key)")
        rows += [r for r in doc["rows"] if r["batch"] == 1]
        notes += [f"lowlat {doc['rows'][0]['model'] if doc['rows'] else '?'} {p}: failed" for p in doc.get("failed",
                                                                                                             [])]
    out = ["| model | path | step ms | TPOT plain ms | TPOT overlap ms | gpt-fast ms | x gpt-fast | within 10% |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for model in sorted({*peers, *(r["model"] for r in rows)}):
        peer = peers.get(model)
        ref = peer["decode_ms"] if peer else None
        if peer:
            lo, hi = peer["decode_kv_window"]
            how = {"gpu-events": "GPU-timed steps"}.get(peer.get("decode_method", "difference"), "by difference")
            out.append(f"| {model} | gpt-fast (decode only, {how}, KV {lo}-{hi}) | - | - | - | {ref:.3f} | 1.00 | - |")
            out.append(f"| {model} | gpt-fast as it reports (1000 / tokens/s, prefill included) | - | - | - | "
                       f"{peer['reported_ms']:.3f} | - | - |")
        else:
            notes.append(f"{model}: no gpt-fast figure, ratios left out")
        for r in (r for r in rows if r["model"] == model):
            x = ref / r["tpot_overlap_ms"] if ref else None
            out.append(f"| {model} | {r['path']} | {r['step_ms']:.3f} | {r['tpot_plain_ms']:.3f} | "
                       f"{r['tpot_overlap_ms']:.3f} | {'-' if ref is None else f'{ref:.3f}'} | "
                       f"{'-' if x is None else f'{x:.2f}'} | "
                       f"{'-' if x is None else ('yes' if x >= TARGET else 'no')} |")
    diffs = sorted({f"{m}: {d}" for m, p in peers.items() for d in p.get("differences", [])})
    return "\n".join(out + [f"gpt-fast model differences: {d}" for d in diffs] + notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gpt_fast", nargs="+", type=Path, help="JSON files of gpt_fast.py measure --json")
    ap.add_argument("--lowlat", nargs="*", type=Path, default=[], help="JSON files of e2e_tpot.py --json")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    missing = [str(p) for p in [*args.gpt_fast, *args.lowlat] if not p.is_file()]
    if missing:
        ap.error(f"no such file(s): {', '.join(missing)} (did the step that writes them fail?)")
    text = render([json.loads(p.read_text()) for p in args.gpt_fast], [json.loads(p.read_text()) for p in args.lowlat])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
