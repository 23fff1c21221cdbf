"""The PNG of a results dict: per model, step latency against batch size, percent of roofline, per-layer latency.

Left panel: DECODE median step time per path (p10-p90 as error bars) over batch size, the roofline as a dashed
black line; VERIFY rows as hollow markers at their batch size with their roofline as a black cross. Middle
panel: percent of the roofline each path reaches, grouped by row. Right panel: per-decoder-layer latency per
path and row, with the per-layer roofline as a black tick. Drawn with matplotlib's object API on the Agg
canvas (no pyplot, so no global state or display is touched).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MARKERS = "osD^v<>ph*"


def _ok(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["status"] == "ok"]


def plot_results(results: dict[str, Any], path: str | Path) -> Path:
    """Write the figure to ``path`` (PNG). Raises ImportError when matplotlib is missing."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    models = list(results["models"])
    paths = results["paths"]
    cpu = results["meta"].get("figures") == "cpu"
    fig = Figure(figsize=(19, 4.6 * max(1, len(models))), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(1, len(models)), 3, squeeze=False)
    colors = {p: f"C{i % 10}" for i, p in enumerate(paths)}
    for (ax_lat, ax_pct, ax_layer), model in zip(axes, models):
        rows = [r for r in results["rows"] if r["model"] == model]
        _latency_panel(ax_lat, rows, paths, colors)
        _bars(ax_pct, rows, paths, colors, "pct_of_roofline", "% of roofline (roofline ms / step ms)")
        ax_pct.axhline(100, color="k", lw=0.8)
        _bars(ax_layer, rows, paths, colors, "per_layer_us", "per-decoder-layer latency, us (slope)",
              ref="layer_roofline_us")
        suffix = " (CPU figures)" if cpu else ""
        ax_lat.set_title(f"{model}: step latency, context {results['settings']['context']}{suffix}")
        ax_pct.set_title(f"{model}: percent of roofline{suffix}")
        ax_layer.set_title(f"{model}: per-layer latency{suffix}")
    meta = results["meta"]
    fig.suptitle(f"lowlat bench, {meta.get('gpu') or 'CPU'}, {meta.get('date', '')}, "
                 f"copy bandwidth {results['copy_bandwidth']['gb_per_s']:.0f} GB/s")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def _latency_panel(ax: Any, rows: list[dict[str, Any]], paths: list[str], colors: dict[str, str]) -> None:
    decode = [r for r in rows if r["mode"] == "DECODE"]
    verify = [r for r in rows if r["mode"] == "VERIFY"]
    for i, path in enumerate(paths):
        mine = sorted(_ok([r for r in decode if r["path"] == path]), key=lambda r: r["batch_size"])
        if mine:
            xs = [r["batch_size"] for r in mine]
            med = [r["step_ms"]["median"] for r in mine]
            err = [[m - r["step_ms"]["p10"] for m, r in zip(med, mine)],
                   [r["step_ms"]["p90"] - m for m, r in zip(med, mine)]]
            ax.errorbar(xs, med, yerr=err, marker=MARKERS[i % len(MARKERS)], color=colors[path], capsize=3,
                        label=f"{path} decode")
        for r in _ok([r for r in verify if r["path"] == path]):
            ax.plot([r["batch_size"]], [r["step_ms"]["median"]], marker=MARKERS[i % len(MARKERS)], ls="none",
                    mfc="none", color=colors[path], ms=9, label=f"{path} verify x{r['tokens_per_req']}")
    roof = {r["batch_size"]: r["roofline_ms"] for r in decode if r.get("roofline_ms")}
    if roof:
        xs = sorted(roof)
        ax.plot(xs, [roof[x] for x in xs], "k--", label="roofline (decode)")
    vroof = {r["batch_size"]: r["roofline_ms"] for r in verify if r.get("roofline_ms")}
    if vroof:
        ax.plot(list(vroof), list(vroof.values()), "kx", ms=9, label="roofline (verify)")
    xs_all = sorted({r["batch_size"] for r in rows})
    if xs_all:
        ax.set_xticks(xs_all)
    ax.set_xlabel("batch size (requests)")
    ax.set_ylabel("step time, ms (median, p10-p90)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _label(r: dict[str, Any]) -> str:
    return f"{r['mode'].lower()} b={r['batch_size']}" + (f" x{r['tokens_per_req']}" if r["mode"] == "VERIFY" else "")


def _bars(ax: Any, rows: list[dict[str, Any]], paths: list[str], colors: dict[str, str], key: str, ylabel: str,
          ref: str | None = None) -> None:
    """Grouped bars of ``row[key]`` per path and row label; ``ref`` (one value per label) as black ticks."""
    labels = list(dict.fromkeys(_label(r) for r in rows))
    width = 0.8 / max(1, len(paths))
    for i, path in enumerate(paths):
        vals = {_label(r): r.get(key) or 0.0 for r in _ok(rows) if r["path"] == path}
        xs = [j + (i - (len(paths) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [vals.get(lab, 0.0) for lab in labels], width=width, color=colors[path], label=path)
    if ref is not None:
        refs = {_label(r): r.get(ref) for r in rows if r.get(ref)}
        pts = [(j, refs[lab]) for j, lab in enumerate(labels) if lab in refs]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "k_", ms=40, mew=2, label="roofline")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
