"""``run_bench``: measure every model, path and shape of a BenchConfig, then write JSON, markdown and a PNG.

Order of a run: the copy bandwidth (before any model is on the device); then per model, per path one after
another (each freeing its memory before the next, so a 61 GB model and its peer never coexist), the full model
and the model cut to the second depth; then the copy bandwidth again. Rows combine the measurements with the
roofline (``lowlat.bench.roofline``) and the ratios to the general path and the hf peer (docs/benchmarks.md).
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lowlat.bench.config import ALL_PLUGINS, GENERAL_PATH, HF_PATH, BenchConfig, Shape
from lowlat.bench.env import environment
from lowlat.bench.lowlat_path import run_lowlat_path
from lowlat.bench.measure import DepthResult, Measurement
from lowlat.bench.peers import run_hf_path
from lowlat.bench.roofline import layer_bytes, roofline_ms, step_bytes
from lowlat.bench.timing import CopyBandwidth, copy_bandwidth
from lowlat.config import DTYPES, ModelConfig

SCHEMA = "lowlat-bench/1"
CPU_NOTE = ("CPU figures: wall-clock time of eager steps on a CPU, for checking the harness only; a plugin row "
            "runs its Triton kernels under the interpreter, so its ratios measure the interpreter, not the kernels; "
            "GPU figures need a GPU (CUDA-graph replays timed with CUDA events)")
Log = Callable[[str], None]


def expand_paths(paths: tuple[str, ...]) -> list[str]:
    """Replace "plugins" by every discovered plugin's name (sorted), drop duplicates, keep the order."""
    out: list[str] = []
    for p in paths:
        if p == ALL_PLUGINS:
            from lowlat.runtime.plugin_host.discovery import discover

            out += sorted(discover().plugins)
        else:
            out.append(p)
    return list(dict.fromkeys(out))


def resolve_device(device: str) -> torch.device:
    """"cuda" -> the current CUDA device; "cpu" -> cpu. Raises ValueError when CUDA is asked for but absent."""
    if device == "cuda":
        if not torch.cuda.is_available():
            from lowlat.platform import no_cuda_message

            raise ValueError(no_cuda_message("--device cuda", "--device cpu"))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def measure_model(cfg: BenchConfig, model: str, paths: list[str], device: torch.device, log: Log
                  ) -> tuple[ModelConfig, dict[str, dict[int, DepthResult]], dict[Shape, list[float]], str]:
    """Run every path of one model at its depths. Returns (config, results[path][depth], routing, routing source)."""
    from lowlat.loader import resolve_model

    mc = resolve_model(model)
    full = mc.num_hidden_layers
    depths = cfg.depths(full)
    shapes = cfg.shapes()
    results: dict[str, dict[int, DepthResult]] = {}
    routing: dict[Shape, list[float]] = {}
    source = ""
    lowlat_paths = [p for p in paths if p != HF_PATH]
    for path in paths:
        if path == HF_PATH:
            results[path] = run_hf_path(cfg, model, mc, shapes, depths, device,
                                        want_routing=mc.is_moe and not lowlat_paths, log=log)
        else:
            results[path] = {}
            for depth in ([full] if depths is None else list(depths)):
                need = [s for s in shapes if s not in routing] if depth == full and mc.is_moe else None
                results[path][depth] = run_lowlat_path(cfg, model, path, depth, full, shapes, device,
                                                       routing_for=need, log=log)
        for res in results[path].values():
            for shape, experts in res.routing.items():
                if shape not in routing:
                    routing[shape], source = experts, res.routing_source
    return mc, results, routing, source


def _m(results: dict[str, dict[int, DepthResult]], path: str, depth: int | None, shape: Shape
       ) -> Measurement | str | None:
    if depth is None or path not in results or depth not in results[path]:
        return None
    return results[path][depth].rows.get(shape, "not run")


def build_rows(cfg: BenchConfig, model: str, mc: ModelConfig, paths: list[str],
               results: dict[str, dict[int, DepthResult]], routing: dict[Shape, list[float]],
               gb_per_s: float) -> list[dict[str, Any]]:
    """One JSON row per (path, shape): latency, roofline, per-layer figures and ratios (docs/benchmarks.md)."""
    full = mc.num_hidden_layers
    depths = cfg.depths(full)
    second = depths[1] if depths else None
    dtype_bytes = torch.empty((), dtype=DTYPES[cfg.dtype]).element_size()
    rows: list[dict[str, Any]] = []
    for shape in cfg.shapes():
        experts = routing.get(shape)
        roof: dict[str, Any] = {"roofline_bytes": None, "roofline_ms": None, "layer_roofline_us": None,
                                "experts_touched_mean": None, "roofline_note": None}
        if mc.is_moe and experts is None:
            roof["roofline_note"] = "no MoE routing was measured (no lowlat path or hf peer ran this shape)"
        else:
            sb = step_bytes(mc, dtype_bytes=dtype_bytes, batch_size=shape.batch_size,
                            tokens_per_req=shape.tokens_per_req, context=cfg.context, experts_touched=experts)
            lb = layer_bytes(mc, dtype_bytes=dtype_bytes, batch_size=shape.batch_size, context=cfg.context,
                             experts_touched=experts)
            roof.update(roofline_bytes=sb.as_dict(), roofline_ms=roofline_ms(sb.total, gb_per_s),
                        layer_roofline_us=1e3 * roofline_ms(lb, gb_per_s),
                        experts_touched_mean=sum(experts) / len(experts) if experts else None)
        for path in paths:
            rows.append(_row(cfg, model, path, shape, full, second, _m(results, path, full, shape),
                             _m(results, path, second, shape), roof))
    _add_ratios(rows)
    return rows


def _row(cfg: BenchConfig, model: str, path: str, shape: Shape, full: int, second: int | None,
         m: Measurement | str | None, m2: Measurement | str | None, roof: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "model": model, "path": path, "mode": shape.mode.name, "batch_size": shape.batch_size,
        "tokens_per_req": shape.tokens_per_req, "context": cfg.context, "layers": full, "second_depth": second,
        **roof,
    }
    if not isinstance(m, Measurement):
        row.update(status="skipped", reason=m or "not run")
        return row
    med = m.step.median
    row.update(
        status="ok", reason=None, ran_on=m.ran_on, graphed=m.graphed, step_ms=m.step.as_dict(),
        repeat_ms=m.repeat.as_dict(), noise_pct=100.0 * abs(m.repeat.median - med) / med,
        replay_ms=m.replay.as_dict() if m.replay else None,
        tokens_per_s_per_req=shape.tokens_per_req * 1e3 / med, compile_s=m.compile_s, inputs=m.inputs,
        pct_of_roofline=100.0 * roof["roofline_ms"] / med if roof["roofline_ms"] else None,
        launches={str(full): m.launches}, launches_how=m.launches_how, launches_error=m.launches_error,
        second_depth_ms=None, per_layer_us=None, per_layer_slope_us=None, pct_of_layer_roofline=None,
        launches_per_layer=None, per_layer_note=None,
    )
    if second is None:
        row["per_layer_note"] = "the model has one decoder layer; no second depth"
    elif not isinstance(m2, Measurement):
        row["per_layer_note"] = f"second depth (L={second}) not measured: {m2 or 'not run'}"
    else:
        row["second_depth_ms"] = m2.step.as_dict()
        slope, note = per_layer_slope(m, m2, full, second)
        row["per_layer_slope_us"] = slope
        if note is None:
            row["per_layer_us"] = slope
            if roof["layer_roofline_us"]:
                row["pct_of_layer_roofline"] = 100.0 * roof["layer_roofline_us"] / slope
        else:
            row["per_layer_note"] = note
        row["launches"][str(second)] = m2.launches
        if m.launches is not None and m2.launches is not None:
            row["launches_per_layer"] = (m.launches - m2.launches) / (full - second)
    return row


def per_layer_slope(m: Measurement, m2: Measurement, full: int, second: int) -> tuple[float, str | None]:
    """The per-decoder-layer slope in us between the ``full``-layer step ``m`` and the ``second``-layer step
    ``m2`` (medians), and None, or the reason it is no per-layer figure: a slope <= 0, or a difference between
    the two medians no larger than the run-to-run spread (first timed run against the repeat, at either depth)."""
    diff = m.step.median - m2.step.median
    slope = 1e3 * diff / (full - second)
    spread = max(abs(m.repeat.median - m.step.median), abs(m2.repeat.median - m2.step.median))
    if slope <= 0:
        return slope, (f"no per-layer figure: the slope between L={full} and L={second} is {slope:.1f} us/layer, "
                       "not positive (the difference between the depths is timing noise, not a layer's cost)")
    if diff <= spread:
        return slope, (f"no per-layer figure: the L={full} and L={second} medians differ by {diff:.4f} ms, within "
                       f"the run-to-run spread ({spread:.4f} ms, first timed run against the repeat)")
    return slope, None


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """speedup_vs_general / speedup_vs_hf: the reference path's median step time over this row's (>1 = faster)."""
    ok = {(r["path"], r["mode"], r["batch_size"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        for ref, key in ((GENERAL_PATH, "speedup_vs_general"), (HF_PATH, "speedup_vs_hf")):
            other = ok.get((ref, r["mode"], r["batch_size"]))
            r[key] = (other["step_ms"]["median"] / r["step_ms"]["median"]
                      if other is not None and r["status"] == "ok" else None)


def default_out_dir(name: str | None, prefix: str = "lowlat-bench") -> Path:
    """``name`` in the current directory, or ``<prefix>-<UTC timestamp>`` there when no name is given."""
    return Path(name or f"{prefix}-{datetime.datetime.now(datetime.timezone.utc).strftime('%Y%m%d-%H%M%S')}")


def run_bench(cfg: BenchConfig, *, out_dir: Path | None = None, command: list[str] | None = None,
              plot: bool = True, log: Log = print) -> dict[str, Any]:
    """Run the whole benchmark; write ``results.json``, ``results.md`` and (``plot``) ``results.png`` to ``out_dir``.

    Returns:
        The results dict (the JSON's content). Per-path failures become skipped rows, never exceptions.
    Raises:
        ValueError / ConfigError: bad configuration (unknown preset, CUDA asked for but absent).
    """
    from lowlat.bench.report import dtype_line, render_markdown

    t_start = time.perf_counter()
    device = resolve_device(cfg.device)
    paths = expand_paths(cfg.paths)
    out_dir = out_dir or default_out_dir(None)
    results: dict[str, Any] = {"schema": SCHEMA, "meta": environment(device, command), "settings": cfg.to_json(),
                               "paths": paths, "models": {}, "rows": []}
    if device.type == "cpu":
        results["meta"]["note"] = CPU_NOTE
        log(f"[bench] {CPU_NOTE}")
    log(f"[bench] {dtype_line(cfg.dtype, device.type == 'cpu')}")
    bw = copy_bandwidth(device, cfg.copy_bytes, cfg.copy_reps)
    log(f"[bench] copy bandwidth {bw.gb_per_s:.1f} GB/s ({cfg.copy_bytes / 2**20:.0f} MiB copied, read + write, "
        f"median of {cfg.copy_reps})")
    results["copy_bandwidth"] = bw.as_dict()
    for model in cfg.models:
        mc, per_path, routing, source = measure_model(cfg, model, paths, device, log)
        results["rows"] += build_rows(cfg, model, mc, paths, per_path, routing, bw.gb_per_s)
        results["models"][model] = _model_summary(cfg, mc, per_path, routing, source)
    end: CopyBandwidth = copy_bandwidth(device, cfg.copy_bytes, cfg.copy_reps)
    results["copy_bandwidth_end"] = end.as_dict()
    results["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(render_markdown(results))
    plotted = False
    if plot:
        from lowlat.bench.plot import plot_results

        try:
            plot_results(results, out_dir / "results.png")
            plotted = True
        except ImportError as e:
            log(f"[bench] no plot: {e} (matplotlib and the hf peer: pip install 'lowlat[bench]', in a checkout "
                "pip install -e 'core[bench]')")
    log(f"[bench] wrote {out_dir}/results.json, results.md{', results.png' if plotted else ''} "
        f"in {results['meta']['wall_s']:.0f} s")
    return results


def _model_summary(cfg: BenchConfig, mc: ModelConfig, per_path: dict[str, dict[int, DepthResult]],
                   routing: dict[Shape, list[float]], source: str) -> dict[str, Any]:
    return {
        "architecture": mc.architecture,
        "layers": mc.num_hidden_layers,
        "depths": list(cfg.depths(mc.num_hidden_layers) or [mc.num_hidden_layers]),
        "moe": mc.is_moe,
        "routing_source": source or None,
        "experts_touched": {s.label: v for s, v in routing.items()},
        "path_info": {p: {str(d): r.info for d, r in by_depth.items()} for p, by_depth in per_path.items()},
    }
