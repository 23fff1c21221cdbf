"""Render a results dict (the ``results.json`` of ``lowlat bench``) as a markdown section or a console table.

``lowlat bench --report results.json`` prints ``render_markdown``: the section docs/benchmark-results.md's "Latest H200
results" is made of (header lines, one table, the notes under it, the skipped rows' reasons).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HEADERS = ("model", "path", "step", "median ms", "p10-p90 ms", "repeat ms", "replay ms", "tok/s/req",
           "roofline ms", "% roofline", "us/layer", "layer roofline us", "launches/layer", "x general", "x hf")


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a results JSON. Raises ValueError when it is missing or not a lowlat bench results file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p} does not exist; give the results.json a `lowlat bench` run wrote")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith("lowlat-bench/"):
        raise ValueError(f"{p} is not a lowlat bench results file (no 'schema': 'lowlat-bench/...')")
    return data


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(x: float | None, digits: int) -> str:
    """A ratio or percentage: ``digits`` decimals, or two significant figures where those would print 0 (an
    interpreter run is thousands of times slower than the general path; "0.00" would read as no figure)."""
    if x is not None and 0 < abs(x) < 10 ** -digits:
        return f"{x:.2g}"
    return _f(x, digits)


def step_label(row: dict[str, Any]) -> str:
    """"decode b=4" or "verify b=1 x6"."""
    extra = f" x{row['tokens_per_req']}" if row["mode"] == "VERIFY" else ""
    return f"{row['mode'].lower()} b={row['batch_size']}{extra}"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    """One list of cells (``HEADERS`` order) per row; a skipped row says "skipped" and is explained by ``skipped``."""
    out = []
    for r in results["rows"]:
        head = [r["model"], r["path"], step_label(r)]
        if r["status"] != "ok":
            out.append(head + ["skipped"] + ["-"] * 3 + ["-", _f(r.get("roofline_ms"), 4)] + ["-"] * 6)
            continue
        s = r["step_ms"]
        # a general variant runs on the general path by definition; a plugin row that fell back says so
        ran = "" if r["ran_on"] in (r["path"], "plugin") or (
            r["ran_on"] == "general" and r["path"].startswith("general")) else f" (ran on {r['ran_on']})"
        out.append(head[:1] + [r["path"] + ran, head[2]] + [
            _f(s["median"], 4), f"{s['p10']:.4f}-{s['p90']:.4f}", _f(r["repeat_ms"]["median"], 4),
            _f(r["replay_ms"]["median"], 4) if r.get("replay_ms") else "-", _f(r["tokens_per_s_per_req"], 1),
            _f(r.get("roofline_ms"), 4), _ratio(r.get("pct_of_roofline"), 1), _f(r.get("per_layer_us"), 1),
            _f(r.get("layer_roofline_us"), 1), _f(r.get("launches_per_layer"), 1),
            _ratio(r.get("speedup_vs_general"), 2), _ratio(r.get("speedup_vs_hf"), 2),
        ])
    return out


def skipped(results: dict[str, Any]) -> list[str]:
    """"model path (steps): reason" for the skipped rows, rows sharing a model, path and reason grouped."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for r in results["rows"]:
        if r["status"] != "ok":
            groups.setdefault((r["model"], r["path"], r["reason"]), []).append(step_label(r))
    return [f"{m} {p} ({', '.join(steps)}): {reason}" for (m, p, reason), steps in groups.items()]


def verify_note(results: dict[str, Any]) -> str | None:
    """What tok/s/req counts in a verify row (every verified token), when the results hold one; else None."""
    if not any(r["mode"] == "VERIFY" for r in results["rows"]):
        return None
    return ("tok/s/req of a verify row counts all k+1 verified tokens per request, rejected drafts included: the "
            "bound when every draft is accepted, not the tokens a request gains per second (the mean acceptance "
            "length, the token after the kept drafts included, x 1000 / median ms)")


def per_layer_notes(results: dict[str, Any]) -> list[str]:
    """"model path (steps): why" for measured rows without a per-layer figure whose second depth was measured
    (a slope <= 0 or within the noise; ``harness.per_layer_slope``), rows sharing a model, path and reason grouped."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for r in results["rows"]:
        if r["status"] == "ok" and r.get("per_layer_us") is None and r.get("second_depth_ms") is not None:
            note = r.get("per_layer_note") or "no per-layer figure"
            groups.setdefault((r["model"], r["path"], note), []).append(step_label(r))
    return [f"{m} {p} ({', '.join(steps)}): {note}" for (m, p, note), steps in groups.items()]


UNSTABLE_PCT = 25.0
"""A row whose timed run and repeat differ by more than this (% of the median) is named under the table."""


def unstable_notes(results: dict[str, Any]) -> list[str]:
    """"model path step: ..." for measured rows whose timed run and its repeat (the same configuration timed again)
    differ by more than ``UNSTABLE_PCT`` of the median: a cold start (compilation, autotuning) or a loaded machine
    inside the timed steps, which the row's ratios then carry."""
    out = []
    for r in results["rows"]:
        noise = r.get("noise_pct")
        if r["status"] == "ok" and noise is not None and noise > UNSTABLE_PCT:
            out.append(f"{r['model']} {r['path']} {step_label(r)}: median {r['step_ms']['median']:.4f} ms, repeat "
                       f"{r['repeat_ms']['median']:.4f} ms ({noise:.0f}% apart); rerun before reading this row")
    return out


def dtype_line(dtype: str, cpu: bool) -> str:
    """"dtype D (weights, activations, KV)"; on a CPU, when D is not float32, also that it is not what
    ``lowlat run`` computes in there (its ``--dtype auto`` is float32 on a CPU; the bench keeps bfloat16)."""
    if cpu and dtype != "float32":
        return (f"dtype {dtype} (weights, activations, KV; not lowlat run's CPU default, float32: --dtype float32 "
                "measures that)")
    return f"dtype {dtype} (weights, activations, KV)"


def header_lines(results: dict[str, Any]) -> list[str]:
    """What ran where: device, commit, versions, bandwidth, settings, and the CPU note when it applies."""
    m, s = results["meta"], results["settings"]
    bw, bw_end = results.get("copy_bandwidth") or {}, results.get("copy_bandwidth_end") or {}
    where = m.get("gpu") or f"CPU ({m.get('cpu') or 'unknown'})"
    commit = (m.get("commit") or "unknown")[:12] + (" (dirty)" if m.get("dirty") else "")
    cpu = m.get("figures") == "cpu"
    lines = [
        f"{m.get('date', '?')}, {where}, driver {m.get('driver') or '-'}, commit {commit}; torch {m.get('torch')}, "
        f"triton {m.get('triton') or '-'}, transformers {m.get('transformers') or '-'}.",
        f"Copy bandwidth ({'host memory' if cpu else 'device-to-device'}, read + write, "
        f"median of {s.get('copy_reps')}): "
        f"{_f(bw.get('gb_per_s'), 1)} GB/s at the start, {_f(bw_end.get('gb_per_s'), 1)} GB/s at the end.",
        f"Context {s['context']} tokens per request, {dtype_line(s['dtype'], cpu)}, "
        f"{s['input_sets']} input sets rotated, "
        f"{s['warmup']} warm-up + 2 x {s['iters']} timed steps per row; per-layer figures from the slope between "
        + ", ".join(f"{' and '.join(map(str, v['depths']))} layers ({k})" for k, v in results["models"].items())
        + ".",
        f"Command: `{m.get('command', '?')}`",
    ]
    if m.get("note"):
        lines.insert(0, f"**{m['note']}.**")
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    """The markdown section: header lines, the table, the notes under it, then the reasons of skipped rows."""
    lines = [*header_lines(results), ""]
    lines.append("| " + " | ".join(HEADERS) + " |")
    lines.append("|" + "|".join(["---"] * 3 + ["---:"] * (len(HEADERS) - 3)) + "|")
    for cells in table_rows(results):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    note = verify_note(results)
    if note:
        lines += ["", f"Note: {note}."]
    unstable = unstable_notes(results)
    if unstable:
        lines += ["", "Unstable rows (the timed run and its repeat disagree):", ""] + [f"- {n}" for n in unstable]
    layer = per_layer_notes(results)
    if layer:
        lines += ["", "No per-layer figure (us/layer -):", ""] + [f"- {n}" for n in layer]
    notes = skipped(results)
    if notes:
        lines += ["", "Skipped rows:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def print_table(results: dict[str, Any]) -> None:
    """Print the figures with rich as two tables (latency; roofline, per-layer and ratios), header lines above, the
    notes (what a verify row's tok/s/req counts, unstable rows, rows without a per-layer figure) and the skipped
    rows' reasons below. Output that is not a terminal gets 160 columns, so tables are not squeezed."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    for line in header_lines(results):
        console.print(Text(line))
    cpu = " (CPU figures)" if results["meta"].get("figures") == "cpu" else ""
    cells = table_rows(results)
    for title, cols in ((f"step latency{cpu}", range(0, 8)),
                        (f"roofline, per layer and ratios{cpu}", [0, 1, 2, *range(8, len(HEADERS))])):
        table = Table(title=title)
        for i in cols:
            table.add_column(HEADERS[i], justify="left" if i < 3 else "right")
        for row in cells:
            table.add_row(*(row[i] for i in cols))
        console.print(table)
    note = verify_note(results)
    if note:
        console.print(Text(note))
    for n in unstable_notes(results):
        console.print(Text(f"unstable: {n}", style="bold"))
    for n in per_layer_notes(results):
        console.print(Text(f"us/layer -: {n}", style="dim"))
    for n in skipped(results):
        console.print(Text(f"skipped: {n}", style="dim"))
