"""``lowlat bench serve`` on CPU at tiny sizes: a started server per path, and --url against a running one."""

from __future__ import annotations

import argparse
import json

from _serve_util import running_server
from lowlat.bench.serve_bench import percentiles, ratios
from lowlat.cli import bench as bench_cli

TINY = ["--device", "cpu", "--input-len", "8", "--output-len", "4", "--concurrency", "1,2", "--requests", "2",
        "--warmup", "1"]


def _parse(argv):
    parser = argparse.ArgumentParser(prog="lowlat")
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "serve", *argv])


def _check(out, paths):
    res = json.loads((out / "results.json").read_text())
    assert res["schema"] == "lowlat-bench-serve/1" and res["paths"] == paths
    assert [(lv["path"], lv["concurrency"]) for lv in res["levels"]] == [(p, c) for p in paths for c in (1, 2)]
    for lv in res["levels"]:
        assert lv["requests"] == 2 and lv["errors"] == 0
        assert lv["per_user_decode_tok_s"]["mean"] > 0 and lv["ttft_ms"]["p99"] >= lv["ttft_ms"]["p50"] > 0
        assert lv["tpot_ms"]["mean"] > 0 and lv["itl_ms"]["p90"] is not None and lv["output_throughput_tok_s"] > 0
    assert "| path | conc |" in (out / "results.md").read_text()
    assert (out / "results.png").stat().st_size > 1000
    return res


def test_bench_serve_starts_a_server_per_path(tmp_path, capsys):
    args = _parse([*TINY, "--paths", "general", "--out", str(tmp_path)])
    assert args.func(args) == 0
    res = _check(tmp_path, ["general"])
    assert res["server_steps"]["general"]["DECODE/general"] >= 2 * 2 * 3
    assert "general" in capsys.readouterr().out
    assert (tmp_path / "server-general.log").is_file()


def test_a_path_that_cannot_start_is_skipped_and_the_rest_measured(tmp_path):
    args = _parse([*TINY, "--concurrency", "1", "--paths", "general,no_such_plugin", "--out", str(tmp_path),
                   "--no-plot"])
    assert args.func(args) == 1
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["paths"] == ["general"] and [s["path"] for s in res["skipped"]] == ["no_such_plugin"]
    assert "skipped" in (tmp_path / "results.md").read_text()


def test_bench_serve_drives_a_running_server(tmp_path):
    with running_server() as (url, *_):
        args = _parse([*TINY, "--url", url, "--label", "mine", "--out", str(tmp_path)])
        assert args.func(args) == 0
    _check(tmp_path, ["mine"])


def test_ratios_and_percentiles():
    def level(path, c, tok_s, tpot):
        return {"path": path, "concurrency": c, "per_user_decode_tok_s": {"mean": tok_s},
                "output_throughput_tok_s": tok_s * c, "tpot_ms": {"mean": tpot}}

    got = ratios([level("general", 1, 100, 10), level("p", 1, 150, 5), level("p", 2, 1, 1)])
    assert got == [{"path": "p", "concurrency": 1, "per_user_tok_s_x_general": 1.5,
                    "output_throughput_x_general": 1.5, "tpot_speedup_x_general": 2.0}]
    q = percentiles([1.0, 2.0, 3.0, 4.0])
    assert q["mean"] == 2.5 and q["p50"] == 2.5 and 3.9 < q["p99"] <= 4.0
    assert percentiles([])["p50"] is None
