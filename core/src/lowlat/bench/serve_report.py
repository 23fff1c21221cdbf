"""Markdown and PNG of a ``lowlat bench serve`` results dict.

The table has one row per path (with its speculative setting, ``general +ngram``) and concurrency: per-user
decode tok/s (mean, p50), TTFT / TPOT / ITL / E2E (mean and p99, ms), output throughput, the ratio to the general
path, and for speculative servers the mean acceptance length of the level and the ratio to the same path's plain
server. The PNG plots per-user decode tok/s against concurrency, one line per path and setting (left), and TTFT
p50 (right); matplotlib's object API on Agg.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HEADERS = ("path", "conc", "reqs", "err", "user tok/s mean", "user tok/s p50", "TTFT ms mean", "TTFT ms p99",
           "TPOT ms mean", "TPOT ms p99", "ITL ms p50", "ITL ms p99", "E2E ms mean", "E2E ms p99", "out tok/s",
           "x general", "accept len", "x plain")


def _f(x: float | None, d: int = 1) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def _label(path: str, spec: str | None) -> str:
    return path if spec is None else f"{path} +{spec}"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    ratio = {(r["path"], r.get("spec"), r["concurrency"]): r["per_user_tok_s_x_general"] for r in results["ratios"]}
    plain = {(r["path"], r["spec"], r["concurrency"]): r["per_user_tok_s_x_plain"]
             for r in results.get("spec_ratios", ())}
    rows = []
    for lv in results["levels"]:
        u, t, p, i, e = (lv[k] for k in ("per_user_decode_tok_s", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
        key = (lv["path"], lv.get("spec"), lv["concurrency"])
        acc = lv.get("acceptance")
        rows.append([_label(lv["path"], lv.get("spec")), str(lv["concurrency"]), str(lv["requests"]), str(lv["errors"]),
                     _f(u["mean"]),
                     _f(u["p50"]), _f(t["mean"]), _f(t["p99"]), _f(p["mean"], 3), _f(p["p99"], 3), _f(i["p50"], 3),
                     _f(i["p99"], 3), _f(e["mean"]), _f(e["p99"]), _f(lv["output_throughput_tok_s"]),
                     _f(ratio.get(key), 3), _f(acc["acceptance_length"], 2) if acc else "-", _f(plain.get(key), 3)])
    return rows


def render_serve_markdown(results: dict[str, Any]) -> str:
    s, m = results["settings"], results["meta"]
    lines = [f"### lowlat bench serve: {s['model']}, {m.get('gpu') or 'CPU'}, {m.get('date', '')}", "",
             f"input {s['input_len']} / output {s['output_len']} tokens per request, concurrency "
             f"{', '.join(map(str, s['concurrency']))}; commit {m.get('commit')}; `{m.get('command')}`", "",
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(results)]
    for path, steps in (results.get("server_steps") or {}).items():
        lines.append("")
        lines.append(f"Steps served by {path}: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(steps.items())))
    for lv in results["levels"]:
        acc = lv.get("acceptance")
        if acc and acc["simulated"]:
            lines += ["", "SIMULATED acceptance (benchmark only: the text is not the model's) in the rows of "
                      f"{acc['method']}"]
            break
    accs = [lv for lv in results["levels"] if lv.get("acceptance")]
    if accs:
        lines += ["", "Speculation per level (the server's lowlat_spec_* counters over the measured requests):", ""]
    for lv in accs:
        acc = lv["acceptance"]
        if acc:
            lines.append(f"- {_label(lv['path'], lv.get('spec'))} c={lv['concurrency']}: {acc['method']} k={acc['k']}, "
                         f"acceptance length {acc['acceptance_length']:.2f}, rate {100 * acc['acceptance_rate']:.1f}%, "
                         f"{acc['verify_steps']} VERIFY / {acc['decode_steps']} DECODE steps, speculation "
                         f"{'on' if acc['on_at_end'] else 'off'} at the end")
    for sk in results.get("skipped") or ():
        why = [line for line in sk["reason"].splitlines() if line.strip()]
        lines += ["", f"Path {_label(sk['path'], sk.get('spec'))} skipped: {why[0]}"
                  + (f" ... {why[-1]}" if len(why) > 1 else "")]
    errs = [(lv["path"], lv["concurrency"], e) for lv in results["levels"] for e in lv["error_examples"]]
    if errs:
        lines += ["", "Errors:"] + [f"- {p} c={c}: {e}" for p, c, e in errs]
    return "\n".join(lines) + "\n"


def plot_serve(results: dict[str, Any], path: str | Path) -> Path:
    """Write the PNG. Raises ImportError when matplotlib is missing."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_user, ax_ttft = fig.subplots(1, 2)
    series = results.get("series") or [{"path": p, "spec": None} for p in results["paths"]]
    for i, sr in enumerate(series):
        p = _label(sr["path"], sr["spec"])
        lv = sorted((x for x in results["levels"] if (x["path"], x.get("spec")) == (sr["path"], sr["spec"])),
                    key=lambda x: x["concurrency"])
        conc = [x["concurrency"] for x in lv]
        ax_user.plot(conc, [x["per_user_decode_tok_s"]["mean"] or 0 for x in lv], marker="o", color=f"C{i}", label=p)
        ax_ttft.plot(conc, [x["ttft_ms"]["p50"] or 0 for x in lv], marker="o", color=f"C{i}", label=p)
    s = results["settings"]
    for ax, ylabel in ((ax_user, "per-user decode tokens/s (mean)"), (ax_ttft, "TTFT p50, ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["concurrency"], [str(c) for c in s["concurrency"]])
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    gpu = results["meta"].get("gpu") or "CPU"
    fig.suptitle(f"lowlat bench serve: {s['model']} on {gpu}, input {s['input_len']} / output {s['output_len']}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
