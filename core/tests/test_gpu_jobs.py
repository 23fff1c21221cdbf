"""bench/gpu_jobs.py: every job's steps name files that exist and lowlat commands that parse."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def jobs():
    spec = importlib.util.spec_from_file_location("gpu_jobs", ROOT / "bench" / "gpu_jobs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_jobs"] = mod
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["gpu_jobs"]


def _steps(jobs):
    opts = jobs.Options(jobs.DEFAULT_MODELS.split(","), jobs.DEFAULT_PLUGINS.split(","), 1.0)
    return [(name, s) for name, make in jobs.JOBS.items() for s in make(opts)]


def test_every_job_has_steps_with_unique_output_files(jobs):
    steps = _steps(jobs)
    assert {name for name, _ in steps} == set(jobs.JOBS)
    outs = [s.out for _, s in steps]
    assert len(outs) == len(set(outs)), "two steps write the same output file"


def test_scripts_the_steps_run_exist(jobs):
    for _, s in _steps(jobs):
        for a in s.argv[1:2]:
            if a.endswith(".py"):
                assert (ROOT / a).is_file(), f"{s.name}: {a} does not exist"


def test_lowlat_commands_parse(jobs):
    from lowlat.cli import build_parser

    parser = build_parser()
    for _, s in _steps(jobs):
        if s.argv[1:3] == ["-m", "lowlat.cli"]:
            parser.parse_args(s.argv[3:])  # SystemExit on an unknown flag


def test_compare_steps_echo_the_verdict(jobs):
    """The compare step's summary shows ``lowlat run --compare``'s verdict line, whichever it is (its rc: 0 for
    identical tokens or a near-tie, 1 for a divergence)."""
    import re

    opts = jobs.Options(["llama-3.2-1b"], ["nvidia_mega"], 1.0)
    (step,) = jobs.compare(opts)
    assert "--compare" in step.argv and "--compare-strict" not in step.argv
    for line in ("verdict: tokens identical (exit 0)", "verdict: tokens differ in 1 of 1 request, each first at a "
                 "near-tie within the documented bound (docs/contract.md): accepted (exit 0; --compare-strict exits "
                 "1 on any difference)", "verdict: DIVERGED: tokens differ in 1 of 1 request; the first difference "
                 "of request 0 is not a near-tie within the documented bound (exit 1)"):
        assert re.search(step.show, line), line


def test_unknown_job_is_an_error_naming_the_jobs(jobs, capsys):
    with pytest.raises(SystemExit):
        jobs.main(["no-such-job"])
    assert "smoke" in capsys.readouterr().err


def test_e2e_tpot_script_runs_on_cpu(tmp_path):
    """The e2e-tpot job's script end to end on a tiny preset (CPU smoke: both loops give the same tokens)."""
    import json
    import subprocess

    out = tmp_path / "e2e.json"
    cmd = [sys.executable, str(ROOT / "bench" / "scripts" / "e2e_tpot.py"), "--model", "tiny-llama", "--device", "cpu",
           "--dtype", "float32", "--context", "40", "--new-tokens", "8", "--batch-sizes", "1,2", "--iters", "2",
           "--warmup", "1", "--repeats", "1", "--paths", "general", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["identical"] and r["step_ms"] > 0 for r in rows)


def test_spec_ngram_script_runs_on_cpu(tmp_path):
    """The spec-ngram job's script end to end on a tiny preset: one row per (workload, batch), float32 greedy
    speculative tokens equal plain decoding's, and the figures hang together."""
    import json
    import subprocess

    out = tmp_path / "ngram.json"
    cmd = [sys.executable, str(ROOT / "bench" / "scripts" / "spec_ngram.py"), "--model", "tiny-llama", "--device",
           "cpu", "--dtype", "float32", "--paths", "none", "--batch-sizes", "1,2", "--warmup-tokens", "24",
           "--new-tokens", "24", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| path | workload | batch | copyable |" in proc.stdout and "| auto-off at end |" in proc.stdout
    head = "tok/s/req: per request (mean over the batch), output tokens only, rejected drafts not counted"
    assert head in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["batch"]) for r in rows] == [("copy", 1), ("copy", 2), ("fresh", 1), ("fresh", 2)]
    for r in rows:
        assert r["same"] == r["batch"] and 0.0 <= r["copyable"] <= 1.0 and r["speedup"] > 0
        assert r["verify_steps"] + r["decode_steps"] > 0 and 1.0 <= r["tokens_per_step"] <= 6.0
        if r["verify_steps"]:
            assert 1.0 <= r["acceptance_length"] <= 6.0 and r["draft_us_per_step"] > 0 and 0 < r["draft_share"] < 1


def test_spec_ngram_copyable_share():
    import importlib.util

    spec = importlib.util.spec_from_file_location("spec_ngram", ROOT / "bench" / "scripts" / "spec_ngram.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # after [1 2 3], "1" has no earlier 3 to follow (a miss); every later token continues the period-3 loop
    assert mod.copyable([1, 2, 3], [1, 2, 3, 1, 2, 3], 3, 1024) == pytest.approx(5 / 6)
    assert mod.copyable([1, 2, 3], [4, 5, 6], 3, 1024) == 0.0 and mod.copyable([1], [], 3, 1024) == 0.0
    # the off-switch column says whether it fired, not a bare "on" / "off"
    assert mod.off_switch({"on": True, "switches": 0}) == "not triggered"
    assert mod.off_switch({"on": False, "switches": 1}) == "triggered, 1 switches" and mod.off_switch({}) == "-"


def test_serve_job_with_speculation_parses(jobs, monkeypatch):
    from lowlat.cli import build_parser

    monkeypatch.setenv("SPECULATIVE", "simulated:3.51")
    monkeypatch.setenv("SPEC_ONLY", "1")
    monkeypatch.setenv("SPEC_ADAPTIVE", "0")
    (step,) = jobs.serve(jobs.Options(["llama-3.2-1b"], ["nvidia_mega"], 1.0))
    args = build_parser().parse_args(step.argv[3:])
    assert args.speculative == "simulated:3.51" and args.num_draft_tokens == 5 and args.speculative_only
    assert args.serve_arg == ["--no-spec-adaptive"] and step.out.endswith("_simulated_3.51.txt")


@pytest.mark.parametrize(("env", "flags", "out"), [("", [], "tune_attention.txt"),
                                                   ("1", ["--in-layer", "attn"], "tune_attention_inlayer_attn.txt"),
                                                   ("full", ["--in-layer", "full"], "tune_attention_inlayer_full.txt")])
def test_mega_attn_in_layer_env(jobs, monkeypatch, env, flags, out):
    """``ATTN_IN_LAYER`` picks tune_attention.py's in-layer mode, with its own output files."""
    monkeypatch.setenv("ATTN_IN_LAYER", env)
    (step,) = jobs.mega_attn(jobs.Options(["llama-3.2-1b"], ["nvidia_mega"], 1.0))
    argv = step.argv[2:]
    assert [a for a in argv if a in ("--in-layer", "attn", "full")] == flags and step.out == out
    assert argv[argv.index("--json") + 1].endswith(out.replace("tune_attention", "attn").replace(".txt", ".json"))


def test_mega_ab_env_side(jobs, monkeypatch):
    """``AB_ENV`` makes B the same lowlat command with one nvidia_mega switch set (A without it); a variable that is
    not an nvidia_mega switch is refused; unset, B is plan_ab.py's table entry."""
    opts = jobs.Options(["qwen3-30b-a3b"], ["nvidia_mega"], 1.0)
    monkeypatch.setenv("AB_ENV", "LOWLAT_MEGA_MOE_CONFIG=down_block_n=32,down_warps=4")
    steps = jobs.mega_ab(opts)
    assert [s.name.split()[0] for s in steps] == ["A1", "B1", "A2", "B2"]
    for s in steps:
        assert "plan_ab.py" not in " ".join(s.argv) and "bench" in s.argv
        want = {"LOWLAT_MEGA_MOE_CONFIG": "down_block_n=32,down_warps=4"} if s.name[0] == "B" else {}
        assert s.env == want, s
    monkeypatch.setenv("AB_ENV", "CUDA_VISIBLE_DEVICES=1")
    with pytest.raises(SystemExit, match="LOWLAT_MEGA_"):
        jobs.mega_ab(opts)
    for bad in ("LOWLAT_MEGA_LM_HEAD_CONFIG", "LOWLAT_MEGA_LM_HEAD_CONFIG=", "LOWLAT_MEGA_PDL= "):
        monkeypatch.setenv("AB_ENV", bad)  # no value: B would run as A
        with pytest.raises(SystemExit, match="NAME=VALUE"):
            jobs.mega_ab(opts)
    monkeypatch.setenv("AB_ENV", "LOWLAT_MEGA_PDL=0")
    monkeypatch.setenv("AB_KEY", "qkv,3072,2048,bfloat16")  # two changes at once: refused
    with pytest.raises(SystemExit, match="one change per A/B"):
        jobs.mega_ab(opts)
    monkeypatch.delenv("AB_ENV")
    monkeypatch.delenv("AB_KEY")
    assert all(("plan_ab.py" in " ".join(s.argv)) == (s.name[0] == "B") and not s.env for s in jobs.mega_ab(opts))
    for bad in ("general", "", "general,,nvidia_mega", "nvidia-mega"):
        monkeypatch.setenv("AB_PATHS", bad)
        with pytest.raises(SystemExit, match="AB_PATHS"):
            jobs.mega_ab(opts)
    monkeypatch.setenv("AB_PATHS", "nvidia_mega")
    assert all(s.argv[s.argv.index("--paths") + 1] == "nvidia_mega" for s in jobs.mega_ab(opts))
    monkeypatch.setenv("AB_KEY", "gemm,2048,2048,bfloat16;gated,8192,2048,bfloat16")  # several entries, in pairs
    monkeypatch.setenv("AB_VALUE", "8,2048,8,1,1,2;2,2048,4,1,1,4")
    b = next(s for s in jobs.mega_ab(opts) if s.name[0] == "B").argv
    pairs = [(b[i + 1], b[i + 3]) for i, a in enumerate(b) if a == "--key"]
    assert pairs == [("gemm,2048,2048,bfloat16", "8,2048,8,1,1,2"), ("gated,8192,2048,bfloat16", "2,2048,4,1,1,4")]
    monkeypatch.setenv("AB_VALUE", "8,2048,8,1,1,2")
    with pytest.raises(SystemExit, match="one value per key"):
        jobs.mega_ab(opts)
    # items that only plan_ab.py on the device would refuse, after A had run: refused when the job is built
    good_k, good_v = "gemm,2048,2048,bfloat16", "8,2048,8,1"
    for key, value, match in [(f"{good_k};", f"{good_v};", "AB_KEY"), (f"{good_k}; gated,8192,2048,bfloat16",
                                                                      f"{good_v};1,2048,4,3", "AB_KEY"),
                              ("", "", "AB_KEY"), (f"{good_k};gemm,2048,02048,bfloat16", f"{good_v};none",
                                                   "given already"),
                              ("gemm,2048,bfloat16", good_v, "kind,N,K,dtype"), (good_k, "8,2048,x", "AB_VALUE"),
                              (good_k, f" {good_v}", "AB_VALUE")]:
        monkeypatch.setenv("AB_KEY", key)
        monkeypatch.setenv("AB_VALUE", value)
        with pytest.raises(SystemExit, match=match):
            jobs.mega_ab(opts)
    monkeypatch.setenv("AB_KEY", good_k)
    monkeypatch.setenv("AB_VALUE", good_v)
    for table in ("", "TUNED_ROW"):
        monkeypatch.setenv("AB_TABLE", table)
        with pytest.raises(SystemExit, match="AB_TABLE"):
            jobs.mega_ab(opts)
