"""The tensor-parallel benchmark's results (``lowlat.bench.tp_bench``): rows from the ranks' reports, Markdown, files.

A table row is (path, batch): rank 0's median and p10-p90 ms per step at full depth, the same at the second
depth, per-layer µs (``lowlat.bench.harness.per_layer_slope``: the slope between the depths, or a note why
none), the ratio to ``general`` at the same batch (general's median over this row's: > 1 = faster) and every
rank's median. The all-reduce table: µs per call (median, p10-p90) of NCCL and of the peer all-reduce per size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lowlat.bench.measure import Measurement
from lowlat.bench.timing import Stats

SCHEMA = "lowlat-tp-bench/1"  # the JSON's format
GENERAL = "general"  # the row every other row's ratio is taken against


def _stats(d: dict[str, Any]) -> Stats:
    return Stats(**d)


def _table_row(cfg: Any, label: str, b: int, reports: list[dict[str, Any]]) -> dict[str, Any]:
    from lowlat.bench.harness import per_layer_slope

    per_rank = [next(r for r in rep["rows"] if r["label"] == label) for rep in reports]
    row0 = per_rank[0]
    spec = next(r for r in cfg.rows if r.label == label)
    out: dict[str, Any] = {"path": label, "plugin": spec.plugin, "engine": dict(spec.engine), "env": dict(spec.env),
                           "batch_size": b, "context": cfg.context, "layers": cfg.full_depth,
                           "second_depth": cfg.depths[1] if len(cfg.depths) > 1 else None, "info": row0["info"]}
    if row0["status"] != "ok":
        return {**out, "status": "skipped", "reason": row0["reason"]}
    full = row0["depths"][cfg.full_depth][b]
    if "error" in full:
        return {**out, "status": "skipped", "reason": f"batch {b}: {full['error']}"}
    out.update(status="ok", reason=None, ran_on=full["ran_on"], graphed=full["graphed"], step_ms=full["step_ms"],
               repeat_ms=full["repeat_ms"], rank_median_ms=[r["depths"][cfg.full_depth][b]["step_ms"]["median"]
                                                            for r in per_rank],
               second_depth_ms=None, per_layer_us=None, per_layer_slope_us=None, per_layer_note=None)
    if out["second_depth"] is None:
        out["per_layer_note"] = f"the model has {cfg.full_depth} layer(s), not more than --layer-depth"
        return out
    second = row0["depths"][out["second_depth"]][b]
    if "error" in second:
        out["per_layer_note"] = f"L={out['second_depth']}: {second['error']}"
        return out
    m = Measurement(step=_stats(full["step_ms"]), repeat=_stats(full["repeat_ms"]))
    m2 = Measurement(step=_stats(second["step_ms"]), repeat=_stats(second["repeat_ms"]))
    slope, note = per_layer_slope(m, m2, cfg.full_depth, out["second_depth"])
    out.update(second_depth_ms=second["step_ms"], per_layer_slope_us=slope, per_layer_us=None if note else slope,
               per_layer_note=note)
    return out


def assemble(cfg: Any, meta: dict[str, Any], reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The results dict: schema, meta, settings, ``rows`` (one per path and batch size, in run order, each
    ``status`` "ok" with figures or "skipped" with ``reason``), ``all_reduce`` (rank 0's, with every rank's
    medians), ``skipped`` (path: reason)."""

    rows = [_table_row(cfg, r.label, b, reports) for r in cfg.rows for b in cfg.batch_sizes]
    ref = {r["batch_size"]: r for r in rows if r["path"] == GENERAL and r["status"] == "ok"}
    for r in rows:
        g = ref.get(r["batch_size"])
        r["x_general"] = g["step_ms"]["median"] / r["step_ms"]["median"] if g and r["status"] == "ok" else None
    ar = reports[0]["all_reduce"]
    if ar is not None:
        for i, size in enumerate(ar["sizes"]):
            for way in ("nccl", "peer"):
                if f"{way}_us" in size:
                    size[f"{way}_rank_median_us"] = [rep["all_reduce"]["sizes"][i][f"{way}_us"]["median"]
                                                     for rep in reports]
    skipped = {}
    for r in rows:
        if r["status"] != "ok":
            skipped.setdefault(r["path"], r["reason"])
    return {"schema": SCHEMA, "meta": meta, "settings": cfg.to_json(), "rows": rows, "all_reduce": ar,
            "skipped": skipped}


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def header_lines(res: dict[str, Any]) -> list[str]:
    """Where and how it ran: date, GPUs, versions, commit, settings, command (and the CPU note)."""
    m, s = res["meta"], res["settings"]
    where = f"{m['gpus']} x {m.get('gpu')}" if m.get("gpus") else f"CPU ({m.get('cpu') or 'unknown'}), no GPU"
    commit = (m.get("commit") or "unknown")[:12] + (" (dirty)" if m.get("dirty") else "")
    lines = [f"{m.get('date')}, {where}, driver {m.get('driver') or '-'}, commit {commit}; torch {m.get('torch')}, "
             f"triton {m.get('triton') or '-'}.",
             f"{s['model']} at TP {s['world']}, DECODE, context {s['context']}, {s['dtype']}, {s['input_sets']} input "
             f"sets; {s['warmup']} warm-up + 2 x {s['iters']} timed steps per row, rank 0's figures (ranks start each "
             f"timed run together); per-layer us from the slope between {' and '.join(map(str, s['depths']))} "
             "layers; x general = general's median / this row's (> 1 = faster).",
             f"Command: `{m.get('command')}`"]
    if m.get("note"):
        lines.insert(0, f"**{m['note']}.**")
    return lines


def render_markdown(res: dict[str, Any]) -> str:
    """The header lines, the step table, the all-reduce table and the notes (skipped rows, per-layer notes)."""
    depths = res["settings"]["depths"]
    second = f"L={depths[1]} median ms" if len(depths) > 1 else "second depth"
    lines = [*header_lines(res), "", f"| path | batch | median ms | p10-p90 ms | {second} | us/layer | x general "
             "| ran on | rank medians ms |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    notes = []
    for r in res["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['path']} | {r['batch_size']} | skipped | - | - | - | - | - | - |")
            continue
        s = r["step_ms"]
        lines.append(f"| {r['path']} | {r['batch_size']} | {s['median']:.4f} | {s['p10']:.4f}-{s['p90']:.4f} | "
                     f"{_f((r['second_depth_ms'] or {}).get('median'), 4)} | {_f(r['per_layer_us'], 1)} | "
                     f"{_f(r['x_general'], 2)} | {r['ran_on']}{' graph' if r['graphed'] else ''} | "
                     f"{', '.join(f'{x:.4f}' for x in r['rank_median_ms'])} |")
        if r["per_layer_note"]:
            notes.append(f"{r['path']} b={r['batch_size']}: {r['per_layer_note']}")
    ar = res.get("all_reduce")
    lib = "NCCL" if res["meta"].get("gpus") else "gloo"  # torch.distributed.all_reduce's backend
    if ar:
        lines += ["", f"All-reduce alone ({ar['dtype']}, hidden {ar['hidden']}; us per call, rank 0; on CUDA a graph "
                  f"of {res['settings']['ar_calls']} calls per sample):", "",
                  f"| message | bytes | {lib} median us | {lib} p10-p90 | peer median us | peer p10-p90 | faster |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for z in ar["sizes"]:
            cells = []
            for way in ("nccl", "peer"):
                f = z.get(f"{way}_us")
                cells += [f"{f['median']:.2f}", f"{f['p10']:.2f}-{f['p90']:.2f}"] if f else ["failed", "-"]
                if z.get(f"{way}_error"):
                    notes.append(f"all-reduce {way} {z['label']}: {z[f'{way}_error']}")
            both = z.get("nccl_us") and z.get("peer_us")
            best = (lib if z["nccl_us"]["median"] <= z["peer_us"]["median"] else "peer") if both else "-"
            lines.append(f"| {z['label']} | {z['bytes']} | {' | '.join(cells)} | {best} |")
        if ar.get("peer_error"):
            notes.append(f"peer all-reduce: {ar['peer_error']}")
    if res["skipped"]:
        lines += ["", "Skipped rows:", ""] + [f"- {p}: {why}" for p, why in res["skipped"].items()]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write(res: dict[str, Any], out_dir: Path, json_path: Path | None = None) -> tuple[Path, Path]:
    """Write ``tp_bench.md`` into ``out_dir`` and the JSON to ``json_path`` (default ``out_dir/tp_bench.json``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jp = json_path or out_dir / "tp_bench.json"
    jp.parent.mkdir(parents=True, exist_ok=True)
    jp.write_text(json.dumps(res, indent=1))
    md = out_dir / "tp_bench.md"
    md.write_text(render_markdown(res))
    return md, jp
