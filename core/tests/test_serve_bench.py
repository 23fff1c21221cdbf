"""``lowlat bench serve`` on CPU at tiny sizes: a started server per path, and --url against a running one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve tests need lowlat[serve] (fastapi, uvicorn)")
from _serve_util import running_server  # noqa: E402
from lowlat.bench.serve_bench import percentiles, ratios, spec_ratios  # noqa: E402
from lowlat.cli import bench as bench_cli  # noqa: E402

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
    assert got == [{"path": "p", "spec": None, "concurrency": 1, "per_user_tok_s_x_general": 1.5,
                    "output_throughput_x_general": 1.5, "tpot_speedup_x_general": 2.0}]
    # with speculation: a path is held to general with the same setting, and to its own plain server
    spec = [{**level("general", 1, 200, 5), "spec": "ngram"}, {**level("p", 1, 450, 2), "spec": "ngram"}]
    got = ratios([level("general", 1, 100, 10), level("p", 1, 150, 5), *spec])
    assert [(r["path"], r["spec"], r["per_user_tok_s_x_general"]) for r in got] == [("p", None, 1.5),
                                                                                   ("p", "ngram", 2.25)]
    sr = spec_ratios([level("general", 1, 100, 10), level("p", 1, 150, 5), *spec])
    assert [(r["path"], r["per_user_tok_s_x_plain"]) for r in sr] == [("general", 2.0), ("p", 3.0)]
    q = percentiles([1.0, 2.0, 3.0, 4.0])
    assert q["mean"] == 2.5 and q["p50"] == 2.5 and 3.9 < q["p99"] <= 4.0
    assert percentiles([])["p50"] is None


def test_bench_serve_with_speculation_on_and_off(tmp_path):
    """--speculative: each path served plain and speculating; the speculative levels carry their acceptance (from
    the server's lowlat_spec_* counters over the measured requests only) and their ratio to the plain server."""
    args = _parse([*TINY, "--concurrency", "1", "--output-len", "12", "--paths", "general", "--speculative",
                   "simulated:2", "--num-draft-tokens", "3", "--serve-arg=--no-spec-adaptive", "--out", str(tmp_path),
                   "--no-plot"])
    assert args.func(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["paths"] == ["general"] and [s["label"] for s in res["series"]] == ["general", "general +simulated:2"]
    plain, spec = res["levels"]
    assert plain["spec"] is None and plain["acceptance"] is None and spec["spec"] == "simulated:2"
    acc = spec["acceptance"]
    assert acc["method"] == "simulated:2" and acc["k"] == 3 and acc["simulated"] and acc["on_at_end"]
    # 2 measured requests of 12 tokens: 11 after the first each, in VERIFY steps of at most 4 tokens per request
    assert 2 * 11 / 4 <= acc["verify_steps"] <= 2 * 11 and 1.0 <= acc["acceptance_length"] <= 4.0
    (r,) = res["spec_ratios"]
    assert r["path"] == "general" and r["per_user_tok_s_x_plain"] > 0 and res["ratios"] == []
    md = (tmp_path / "results.md").read_text()
    assert "| general +simulated:2 | 1 |" in md and "accept len" in md and "SIMULATED acceptance" in md
    assert (tmp_path / "server-general.log").is_file() and (tmp_path / "server-general__simulated_2.log").is_file()


def test_spec_counters_on_metrics_and_their_difference():
    from lowlat.bench.serve_bench import acceptance, spec_counts

    with running_server() as (url, *_):  # a plain server exposes none
        assert spec_counts(url) == {} and acceptance({}, spec_counts(url)) is None
    with running_server(speculative_method="ngram", num_draft_tokens=3, speculative_adaptive=False) as (url, _, e, _s):
        import httpx

        before = spec_counts(url)
        assert before["method"] == "ngram" and before["k"] == "3" and before["verify_steps"] == 0.0
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "abcabcabcabcabc",
                                                      "max_tokens": 16, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        after = spec_counts(url)
        s = e.speculator.stats
        assert after["verify_steps"] == s.verify_steps > 0 and after["emitted_tokens"] == s.emitted
        assert after["draft_seconds"] == s.draft_s and after["on"] == 1.0
        acc = acceptance(before, after)
        assert acc["verify_steps"] == s.verify_steps and acc["acceptance_length"] == s.acceptance_length
        assert not acc["simulated"] and acc["acceptance_rate"] == s.acceptance_rate


def test_speculative_flags_are_checked():
    import pytest
    from lowlat.bench.serve_bench import ServeBenchConfig

    base = dict(model="tiny-llama", device="cpu", input_len=8, output_len=4, concurrency=(1,))
    assert ServeBenchConfig(**base).spec_modes() == [None]
    assert ServeBenchConfig(**base, speculative="ngram").spec_modes() == [None, "ngram"]
    assert ServeBenchConfig(**base, speculative="ngram", speculative_only=True).spec_modes() == ["ngram"]
    with pytest.raises(ValueError, match="need --speculative"):
        ServeBenchConfig(**base, speculative_only=True)
    with pytest.raises(ValueError, match="--url"):
        ServeBenchConfig(**base, speculative="ngram", url="http://127.0.0.1:1")


def test_spec_counts_parse_any_method_label():
    from types import SimpleNamespace

    from lowlat.bench.serve_bench import parse_spec_counts
    from lowlat.runtime.speculative import SpecStats
    from lowlat.serve.metrics import ServeMetrics

    stats = SpecStats(method='draft:/ck pts/a,b"c', k=4, verify_steps=7, emitted=20, draft_s=0.25)
    m = ServeMetrics()
    m.bind_speculative(SimpleNamespace(stats=stats, controller=SimpleNamespace(on=False)))
    got = parse_spec_counts(m.render().decode())
    assert got["method"] == 'draft:/ck pts/a,b"c' and got["k"] == "4" and got["simulated"] == "false"
    assert got["verify_steps"] == 7.0 and got["emitted_tokens"] == 20.0 and got["draft_seconds"] == 0.25
    assert got["on"] == 0.0 and got["accepted_tokens"] == 0.0


def test_default_out_dir_is_in_the_current_directory(tmp_path, monkeypatch):
    import lowlat.bench.serve_bench as serve_bench

    seen = []

    def fake(cfg, *, out_dir, **kw):
        seen.append(out_dir)
        raise RuntimeError("stop here")

    monkeypatch.setattr(serve_bench, "run_serve_bench", fake)
    monkeypatch.chdir(tmp_path)
    args = _parse(TINY)
    assert args.func(args) == 2
    assert len(seen) == 1 and not seen[0].is_absolute() and seen[0].name.startswith("lowlat-bench-serve-")
    assert len(seen[0].parts) == 1  # ./lowlat-bench-serve-<UTC time>, not bench/results/...
    args = _parse([*TINY, "--name", "mine"])
    assert args.func(args) == 2
    assert seen[-1] == Path("mine")
