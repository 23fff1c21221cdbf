"""bench/scripts/tp_bench.py on CPU (2 gloo ranks, tiny-llama, the Triton interpreter): every row in the table and
the JSON with figures or a reason, the all-reduce alone, and a dead or hung rank failing the run in bounded time.

The figures are meaningless on a CPU; the tests check that each is there, consistent and from the right path."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest
from lowlat.bench.tp_bench import ROWS, TPBenchConfig, TPBenchError, TPRow, run_tp_bench, select_rows

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["general", "general-peer", "nvidia_mega", "no-such-plugin"]


def _script():
    spec = importlib.util.spec_from_file_location("tp_bench_script", ROOT / "bench" / "scripts" / "tp_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_bench")
    argv = ["--device", "cpu", "--model", "tiny-llama", "--tp", "2", "--paths", ",".join(PATHS), "--batch-sizes", "1",
            "--layer-depth", "1", "--ar-kib", "4", "--rank-timeout-s", "60", "--stall-s", "120", "--out", str(out),
            "--json", str(out / "sub" / "res.json")]
    rc = _script().main(argv)
    return rc, json.loads((out / "sub" / "res.json").read_text()), (out / "tp_bench.md").read_text()


def _row(res, path):
    (row,) = [r for r in res["rows"] if r["path"] == path]
    return row


def test_every_row_is_measured_or_says_why(run):
    rc, res, md = run
    assert rc == 0 and res["schema"] == "lowlat-tp-bench/1"
    assert [(r["path"], r["batch_size"]) for r in res["rows"]] == [(p, 1) for p in PATHS]
    assert res["settings"]["world"] == 2 and res["settings"]["depths"] == [2, 1] and res["meta"]["figures"] == "cpu"
    for path in PATHS[:3]:
        r = _row(res, path)
        s = r["step_ms"]
        assert r["status"] == "ok" and r["reason"] is None
        assert 0 < s["p10"] <= s["median"] <= s["p90"] and s["n"] == 2 and r["repeat_ms"]["n"] == 2
        assert len(r["rank_median_ms"]) == 2 and r["rank_median_ms"][0] == s["median"] and min(r["rank_median_ms"]) > 0
        assert r["second_depth_ms"]["median"] > 0 and r["layers"] == 2 and r["second_depth"] == 1
        assert (r["per_layer_us"] is None) == (r["per_layer_note"] is not None)  # a figure, or the reason for none
        assert r["x_general"] == pytest.approx(_row(res, "general")["step_ms"]["median"] / s["median"])
    assert _row(res, "general")["x_general"] == 1.0
    # each row ran the path it names: the general rows the general forward (one over peer buffers), the plugin row
    # the plugin, at both depths
    for path, ran, plugin, peer in (("general", "general", None, False), ("general-peer", "general", None, True),
                                    ("nvidia_mega", "plugin", "nvidia_mega", False)):
        r = _row(res, path)
        assert r["ran_on"] == ran and set(r["info"]) == {"2", "1"}
        assert all(i["plugin"] == plugin and i["peer_all_reduce"] is peer for i in r["info"].values())
    assert _row(res, "general-peer")["engine"] == {"all_reduce": "peer"}
    assert "CPU figures" in md and "mean nothing about speed" in md
    for path in PATHS[:3]:
        assert f"| {path} | 1 | {_row(res, path)['step_ms']['median']:.4f} |" in md


def test_an_unknown_plugin_is_a_skipped_row_not_a_crash(run):
    rc, res, md = run
    r = _row(res, "no-such-plugin")
    assert r["status"] == "skipped" and "step_ms" not in r and r["x_general"] is None
    assert "PluginNotFound" in r["reason"] and "no-such-plugin" in r["reason"]
    assert res["skipped"] == {"no-such-plugin": r["reason"]}
    assert "| no-such-plugin | 1 | skipped |" in md and f"- no-such-plugin: {r['reason']}" in md


def test_the_all_reduce_alone_both_ways(run):
    _, res, md = run
    ar = res["all_reduce"]
    assert ar["dtype"] == "bfloat16" and ar["hidden"] == 64 and ar["peer_error"] is None
    assert [(z["label"], z["elements"], z["bytes"]) for z in ar["sizes"]] == [("1 x 64", 64, 128),
                                                                              ("4 KiB", 2048, 4096)]
    for z in ar["sizes"]:
        for way in ("nccl", "peer"):
            f = z[f"{way}_us"]
            assert 0 < f["p10"] <= f["median"] <= f["p90"] and f["n"] == 2 and f["calls_per_sample"] == 1
            assert len(z[f"{way}_rank_median_us"]) == 2 and z[f"{way}_rank_median_us"][0] == f["median"]
    assert "| 1 x 64 | 128 |" in md and "| 4 KiB | 4096 |" in md and "| gloo median us |" in md


def test_select_rows_keeps_the_order_and_makes_unknown_names_plugins():
    assert select_rows(["nvidia_mega-nccl", "general"]) == (ROWS[3], ROWS[0])
    assert ROWS[3].env == (("LOWLAT_MEGA_TP_REDUCE", "nccl"),) and ROWS[3].plugin == "nvidia_mega"
    assert select_rows(["x", "x"]) == (TPRow("x", "x"),)
    with pytest.raises(ValueError, match="empty"):
        select_rows([])


DIED = r"^rank 1 exited \(exit code 3\) before finishing"
HUNG = r"rank\(s\) 0, 1 sent nothing for 4 s: a hung rank .*rank 1 last said: nothing"


@pytest.mark.parametrize("fault, match", [("die:1", DIED), ("hang:1", HUNG)])
def test_a_dead_or_hung_rank_fails_the_run_in_bounded_time(fault, match):
    cfg = TPBenchConfig(model="tiny-llama", device="cpu", rows=(ROWS[0],), batch_sizes=(1,), context=8, warmup=0,
                        iters=1, input_sets=1, all_reduce=False, rank_timeout_s=30, stall_s=4, timeout_s=60,
                        fault=fault)
    t0 = time.monotonic()
    with pytest.raises(TPBenchError, match=match):
        run_tp_bench(cfg, log=lambda line: None)
    assert time.monotonic() - t0 < 25
    assert not [p for p in mp.active_children() if p.name.startswith("tp-bench-rank")]  # none left behind


def test_the_gpu_job_runs_this_script_with_flags_it_takes():
    spec = importlib.util.spec_from_file_location("gpu_jobs_speed", ROOT / "bench" / "gpu_jobs_speed.py")
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        jobs = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(jobs)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    steps = jobs.tp_bench(jobs.Options(["llama-3.2-1b", "qwen3-30b-a3b"], ["nvidia_mega"], 1.0))
    assert [s.name for s in steps] == ["tp-bench llama-3.2-1b", "tp-bench qwen3-30b-a3b"]
    for s in steps:
        args = _script().build_parser().parse_args(s.argv[2:])
        assert (args.tp, args.batch_sizes, args.device) == (2, "1,8", "cuda")
        assert select_rows(args.paths.split(",")) == ROWS and args.timeout_s < s.timeout_s


def test_bench_serve_passes_tp_to_every_server_it_starts(tmp_path):
    """``lowlat bench serve --serve-arg=--tp=2`` (the tp-serve GPU job): each started ``lowlat serve`` gets --tp 2."""
    import argparse

    from lowlat.bench.serve_bench import ServerProcess
    from lowlat.cli import bench as bench_cli
    from lowlat.cli import build_parser
    from lowlat.cli.bench_serve import config_from_args

    parser = argparse.ArgumentParser(prog="lowlat")
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "serve", "--device", "cpu", "--paths", "general", "--serve-arg=--tp=2"])
    served = build_parser().parse_args(ServerProcess(config_from_args(args), "general", tmp_path / "log").argv[3:])
    assert (served.command, served.tp, served.plugin) == ("serve", 2, "none")
