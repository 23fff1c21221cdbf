"""``lowlat bench`` end to end on a CPU: tiny-llama and tiny-qwen3-moe, general path, hf skipped, JSON, PNG, report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lowlat.bench.config import BenchConfig, Shape
from lowlat.bench.measure import Measurement
from lowlat.bench.roofline import step_bytes
from lowlat.bench.timing import summarize
from lowlat.cli import main
from lowlat.forward_batch import ForwardMode
from lowlat.loader.presets import get_preset

ARGS = ["bench", "--device", "cpu", "--model", "tiny-llama,tiny-qwen3-moe", "--paths", "general,no_such_plugin,hf",
        "--batch-sizes", "1,2", "--verify-tokens", "3", "--context", "24", "--input-sets", "2", "--warmup", "1",
        "--iters", "2", "--copy-bytes", str(1 << 20), "--page-size", "8"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("bench")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = main([*ARGS, "--out", str(out)])
    finally:
        torch.set_num_threads(n)
    assert rc == 1, "no_such_plugin could not start: the rows are written, the exit status says so"
    return out, json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def _rows(results: dict, **match: object) -> list[dict]:
    return [r for r in results["rows"] if all(r[k] == v for k, v in match.items())]


def test_files_and_metadata(bench_run):
    out, results, md = bench_run
    png = (out / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    meta = results["meta"]
    assert results["schema"] == "lowlat-bench/1" and meta["figures"] == "cpu" and "CPU figures" in meta["note"]
    for key in ("commit", "date", "command", "torch", "triton", "gpu", "driver"):
        assert key in meta
    assert meta["command"].startswith("lowlat bench --model tiny-llama,tiny-qwen3-moe")
    assert "--device cpu" in meta["command"]
    assert results["copy_bandwidth"]["gb_per_s"] > 0 and results["copy_bandwidth_end"]["gb_per_s"] > 0
    assert results["paths"] == ["general", "no_such_plugin", "hf"]
    assert "CPU figures" in md and "| tiny-qwen3-moe | general | verify b=1 x3 |" in md
    # the dtype it ran, and that lowlat run's CPU default differs; what a verify row's tok/s/req counts
    assert results["settings"]["dtype"] == "bfloat16"
    assert "dtype bfloat16 (weights, activations, KV; not lowlat run's CPU default, float32" in md
    assert "tok/s/req of a verify row counts all k+1 verified tokens per request, rejected drafts included" in md


def test_every_row_is_there_and_general_rows_are_measured(bench_run):
    _, results, _ = bench_run
    assert len(results["rows"]) == 2 * 3 * 3  # models x paths x (decode 1, 2 + verify 1)
    general = _rows(results, path="general")
    assert len(general) == 6 and all(r["status"] == "ok" for r in general)
    for r in general:
        s = r["step_ms"]
        assert 0 < s["p10"] <= s["median"] <= s["p90"] and s["n"] == 2 and r["repeat_ms"]["n"] == 2
        assert r["ran_on"] == "general" and not r["graphed"] and r["replay_ms"] is None
        assert r["tokens_per_s_per_req"] == pytest.approx(r["tokens_per_req"] * 1e3 / s["median"])
        assert r["pct_of_roofline"] == pytest.approx(100 * r["roofline_ms"] / s["median"])
        assert r["speedup_vs_general"] == pytest.approx(1.0) and r["speedup_vs_hf"] is None
        assert r["layers"] == 2 and r["second_depth"] == 1 and r["second_depth_ms"]["n"] == 2
        slope = 1e3 * (s["median"] - r["second_depth_ms"]["median"])  # us per layer: 2 layers against 1
        assert r["per_layer_slope_us"] == pytest.approx(slope)
        if r["per_layer_us"] is None:  # CPU timings: the slope may be <= 0 or within the noise; the note says so
            assert r["per_layer_note"].startswith("no per-layer figure") and r["pct_of_layer_roofline"] is None
        else:
            assert r["per_layer_us"] == pytest.approx(slope) and slope > 0 and r["per_layer_note"] is None
        assert r["launches"]["2"] > r["launches"]["1"] > 0 and "aten" in r["launches_how"]
        assert r["launches_per_layer"] == r["launches"]["2"] - r["launches"]["1"]


def _measurement(median: float, repeat: float) -> Measurement:
    return Measurement(step=summarize([median] * 3), repeat=summarize([repeat] * 3), ran_on="general")


@pytest.mark.parametrize("full_ms, second_ms, figure, why", [
    ((2.0, 2.0), (1.0, 1.0), 1000.0, None),  # 1 ms more for the second layer: 1000 us/layer
    ((1.0, 1.0), (1.2, 1.2), None, "is -200.0 us/layer, not positive"),  # the shallower model timed slower
    ((1.0, 1.0), (1.0, 1.0), None, "is 0.0 us/layer, not positive"),
    ((1.10, 1.30), (1.0, 1.0), None, "differ by 0.1000 ms, within the run-to-run spread (0.2000 ms"),
])
def test_per_layer_figure_only_for_a_positive_slope_above_the_noise(bench_run, full_ms, second_ms, figure, why):
    from lowlat.bench.harness import _row
    from lowlat.bench.report import HEADERS, render_markdown, table_rows

    _, results, _ = bench_run
    cfg = BenchConfig.with_defaults("cpu")
    roof = {"roofline_bytes": None, "roofline_ms": 0.5, "layer_roofline_us": 100.0, "experts_touched_mean": None,
            "roofline_note": None}
    row = _row(cfg, "tiny-llama", "general", Shape(ForwardMode.DECODE, 1, 1), 2, 1, _measurement(*full_ms),
               _measurement(*second_ms), roof)
    assert row["per_layer_slope_us"] == pytest.approx(1e3 * (full_ms[0] - second_ms[0]))
    if figure is not None:
        assert row["per_layer_us"] == pytest.approx(figure) and row["per_layer_note"] is None
        assert row["pct_of_layer_roofline"] == pytest.approx(10.0)
        return
    assert row["per_layer_us"] is None and row["pct_of_layer_roofline"] is None
    assert row["per_layer_note"].startswith("no per-layer figure: ") and why in row["per_layer_note"]
    # the tables print "-" for it (never a negative number) and the reason under the table
    doctored = {**results, "rows": [{**row, "speedup_vs_general": None, "speedup_vs_hf": None}]}
    cells = dict(zip(HEADERS, table_rows(doctored)[0]))
    assert cells["us/layer"] == "-" and cells["layer roofline us"] == "100.0"
    md = render_markdown(doctored)
    assert "No per-layer figure (us/layer -):" in md
    # a ratio too small for its decimals (an interpreter run) keeps two significant figures, never "0.00"
    tiny = {**results, "rows": [{**row, "speedup_vs_general": 0.00047, "pct_of_roofline": 0.012}]}
    cells = dict(zip(HEADERS, table_rows(tiny)[0]))
    assert (cells["x general"], cells["% roofline"], cells["x hf"]) == ("0.00047", "0.012", "-")
    assert f"- tiny-llama general (decode b=1): {row['per_layer_note']}" in md


def test_failing_paths_are_skipped_rows_with_reasons(bench_run):
    _, results, md = bench_run
    hf = _rows(results, path="hf")
    assert len(hf) == 6 and all(r["status"] == "skipped" and "CUDA" in r["reason"] for r in hf)
    missing = _rows(results, path="no_such_plugin")
    assert len(missing) == 6 and all(r["status"] == "skipped" and "no_such_plugin" in r["reason"] for r in missing)
    assert "Skipped rows:" in md and "the hf peer needs a CUDA GPU" in md


def test_roofline_of_the_moe_rows_uses_the_measured_union(bench_run):
    _, results, _ = bench_run
    cfg = get_preset("tiny-qwen3-moe")
    touched = results["models"]["tiny-qwen3-moe"]["experts_touched"]
    assert results["models"]["tiny-qwen3-moe"]["routing_source"].startswith("lowlat general forward")
    for shape in (Shape(ForwardMode.DECODE, 1, 1), Shape(ForwardMode.DECODE, 2, 1), Shape(ForwardMode.VERIFY, 1, 3)):
        per_layer = touched[shape.label]
        k, tokens = cfg.num_experts_per_tok, shape.num_tokens
        assert len(per_layer) == 2 and all(k <= e <= min(cfg.num_experts, k * tokens) for e in per_layer)
        if tokens == 1:
            assert per_layer == [k, k]  # one token picks exactly top-k distinct experts
        row = _rows(results, model="tiny-qwen3-moe", path="general", mode=shape.mode.name,
                    batch_size=shape.batch_size)[0]
        want = step_bytes(cfg, dtype_bytes=2, batch_size=shape.batch_size, tokens_per_req=shape.tokens_per_req,
                          context=24, experts_touched=per_layer)
        assert row["roofline_bytes"] == pytest.approx(want.as_dict())
        assert row["roofline_ms"] == pytest.approx(want.total / (results["copy_bandwidth"]["gb_per_s"] * 1e6))


def test_report_prints_the_markdown_of_a_results_file(bench_run, capsys):
    out, _, md = bench_run
    assert main(["bench", "--report", str(out / "results.json")]) == 0
    assert capsys.readouterr().out == md


def test_report_of_a_bad_file_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LOWLAT_DEBUG", raising=False)
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": []}))
    assert main(["bench", "--report", str(bad)]) == 2
    assert "not a lowlat bench results file" in capsys.readouterr().err
    assert main(["bench", "--report", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [
    (["--batch-sizes", "1,x"], "--batch-sizes must be comma-separated integers"),
    (["--modes", "prefill"], "--modes takes decode and verify"),
    (["--verify-tokens", "1"], "--verify-tokens is k+1"),
    (["--context", "0"], "context must be >= 1"),
    (["--model", "no-such-preset", "--copy-bytes", str(1 << 20)], "no-such-preset"),
])
def test_bad_flags_are_one_error_line(capsys, monkeypatch, tmp_path, argv, msg):
    monkeypatch.delenv("LOWLAT_DEBUG", raising=False)
    assert main(["bench", "--device", "cpu", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_help_names_the_dtype_and_lowlat_runs_cpu_default(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "bfloat16 (bf16, the default on a CPU too" in text and "float32 on a CPU" in text


def test_cpu_and_gpu_defaults():
    cpu = BenchConfig.with_defaults("cpu")
    gpu = BenchConfig.with_defaults("cuda")
    assert cpu.models == ("tiny-llama",) and cpu.batch_sizes == (1, 2) and cpu.context == 64
    assert gpu.models == ("llama-3.2-1b",) and gpu.batch_sizes == (1, 2, 4, 8) and gpu.context == 1024
    assert gpu.paths == ("general", "plugins", "hf") and gpu.verify_tokens == 6 and gpu.verify_batch_sizes == (1,)
    assert [s.label for s in gpu.shapes()] == ["DECODE b=1", "DECODE b=2", "DECODE b=4", "DECODE b=8",
                                               "VERIFY b=1 k+1=6"]
    assert gpu.depths(16) == (16, 8) and gpu.depths(1) is None
    assert BenchConfig.with_defaults("cpu", layer_depth=3).depths(2) is None


def test_cpu_run_is_quiet_truthful_and_writes_into_the_current_directory(tmp_path):
    """A fresh process (torch's profiler reads KINETO_LOG_LEVEL once): no USDT lines from the launch count, no
    CUDA-graph claim on a CPU, and the default output directory is ./lowlat-bench-<UTC time>, not bench/results."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    argv = ["bench", "--device", "cpu", "--model", "tiny-llama", "--paths", "general", "--batch-sizes", "1",
            "--modes", "decode", "--context", "8", "--input-sets", "1", "--warmup", "1", "--iters", "1",
            "--copy-bytes", str(1 << 20), "--no-plot"]
    p = subprocess.run([sys.executable, "-m", "lowlat.cli", *argv], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "USDT" not in p.stderr and "profiler_start" not in p.stderr, p.stderr
    assert "CUDA graphs" not in p.stderr and "(eager steps)" in p.stderr, p.stderr
    assert "no CUDA GPU here" not in p.stderr  # --device cpu: the user said so
    made = [d.name for d in tmp_path.iterdir()]
    assert len(made) == 1 and made[0].startswith("lowlat-bench-"), made
    assert (tmp_path / made[0] / "results.json").is_file()


def test_a_gpu_command_run_on_a_cpu_says_so_at_once(tmp_path, capsys, monkeypatch):
    """--device auto that finds no GPU prints, before the first model loads, that it measures on the CPU (a README
    GPU command run here by mistake otherwise spends minutes on a 1 B model without a word)."""
    import torch
    from lowlat.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["bench", "--model", "tiny-llama", "--paths", "general", "--batch-sizes", "1", "--modes", "decode",
            "--context", "8", "--input-sets", "1", "--warmup", "1", "--iters", "1", "--copy-bytes", str(1 << 20),
            "--no-plot", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.index("no CUDA GPU here: measuring on the CPU") < err.index("tiny-llama"), err


def test_readme_bench_examples_say_where_they_run():
    """Every `lowlat bench` example of the README runs on a CPU (--device cpu) or its comment says it needs a GPU."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    examples = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("lowlat bench ") and not line.startswith("lowlat bench serve"):
                comment = [line.partition("#")[2]]
                comment += [x.strip().lstrip("#") for x in lines[i + 1:] if x.startswith(" ") and x.strip()[:1] == "#"]
                examples.append((line.partition("#")[0], " ".join(comment)))
    assert len(examples) >= 3, examples
    for command, comment in examples:
        assert "--device cpu" in command or "(GPU" in comment, (command, comment)
    variants = next(c for cmd, c in examples if "general-compiled" in cmd)
    assert "On a CPU" in variants and "hf is skipped" in variants


def test_a_row_whose_repeat_disagrees_is_named_under_the_table(bench_run):
    """A cold start inside the timed steps (one CPU run of general-compiled: median 88.7 ms, repeat 1.41 ms) must
    not pass as a figure: the row is named, with both medians; rows within UNSTABLE_PCT are not."""
    from lowlat.bench import report

    _, results, _ = bench_run
    rows = [dict(r) for r in results["rows"] if r["status"] == "ok"][:2]
    rows[0].update(noise_pct=6189.0, step_ms={**rows[0]["step_ms"], "median": 88.67},
                   repeat_ms={**rows[0]["repeat_ms"], "median": 1.41})
    rows[1].update(noise_pct=report.UNSTABLE_PCT)  # at the bound: not flagged
    faked = {**results, "rows": rows}
    notes = report.unstable_notes(faked)
    assert len(notes) == 1 and "88.6700 ms" in notes[0] and "1.4100 ms" in notes[0] and "6189%" in notes[0]
    assert notes[0] in report.render_markdown(faked)
    assert report.unstable_notes({**results, "rows": rows[1:]}) == []


def test_metadata_records_the_switches_in_the_environment(monkeypatch):
    """An A/B whose B side is an environment switch has the baseline's command line: ``meta.env`` tells the two
    results apart (``LOWLAT_*`` and ``TRITON_*`` variables, nothing else)."""
    from lowlat.bench.env import environment

    monkeypatch.setenv("LOWLAT_MEGA_LM_HEAD_CONFIG", "min_rows=8")
    monkeypatch.setenv("LOWLAT_TEST_UNRELATED_HOME", "/x")
    monkeypatch.setenv("HOME_NOT_RECORDED", "secret")
    env = environment(torch.device("cpu"), ["lowlat", "bench"])["env"]
    assert env["LOWLAT_MEGA_LM_HEAD_CONFIG"] == "min_rows=8" and "HOME_NOT_RECORDED" not in env
    assert all(k.startswith(("LOWLAT_", "TRITON_")) for k in env)
