"""Launch-plan selection: the measured table on its GPU, the heuristic elsewhere (CPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lowlat_nvidia_mega.kernels import tuned_plans
from lowlat_nvidia_mega.kernels.gemm_plans import GemvPlan, plan_gemm
from lowlat_nvidia_mega.kernels.qkv_rope import plan_qkv


def test_tuned_entry_wins_on_its_gpu_and_heuristic_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    heuristic = tuned_plans.default_row1(8192, gated=False)
    assert tuned_plans.gemm_plan(2048, 8192, torch.bfloat16, cpu) == dataclasses.replace(
        plan_gemm(2048, 8192, torch.bfloat16, 4), row1=heuristic)
    monkeypatch.setattr(tuned_plans, "device_name", lambda dev: "NVIDIA H200")
    monkeypatch.setattr(tuned_plans, "num_sms", lambda dev: 132)
    p = tuned_plans.gemm_plan(2048, 8192, torch.bfloat16, cpu)
    bn, bk, s, w, st = tuned_plans.TUNED[("NVIDIA H200", "gemm", 2048, 8192, "bfloat16")]
    assert (p.block_n, p.block_k, p.split_k, p.num_warps, p.num_stages) == (bn, bk, s, w, st)
    assert p.k_per_split * p.split_k >= 8192 and p.pre_k % p.block_k == 0 and p.pre_k <= p.k_per_split
    assert p.row1 == GemvPlan(*tuned_plans.TUNED_ROW1[("NVIDIA H200", "gemm", 2048, 8192, "bfloat16")])
    assert p.row1 != heuristic
    # another dtype or shape is not in the table: the heuristics
    assert tuned_plans.gemm_plan(2048, 8192, torch.float16, cpu) == dataclasses.replace(
        plan_gemm(2048, 8192, torch.float16, 132), row1=heuristic)
    assert tuned_plans.gemm_plan(4096, 8192, torch.bfloat16, cpu) == dataclasses.replace(
        plan_gemm(4096, 8192, torch.bfloat16, 132), row1=heuristic)
    assert tuned_plans.gemm_plan(4096, 8192, torch.bfloat16, cpu, gated=True).row1 == \
        tuned_plans.default_row1(8192, gated=True)
    q = tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, cpu, qk_norm=False)
    assert q.block_n == 64 and q != plan_qkv(32, 8, 64, 2048, torch.bfloat16, 132)
    assert q.row1 == GemvPlan(*tuned_plans.TUNED_ROW1[("NVIDIA H200", "qkv", 3072, 2048, "bfloat16")])
    # a qkv shape without entries: the heuristic plan, at one row the row-pair form without q/k norm, else tl.dot
    for qk_norm in (False, True):
        q = tuned_plans.qkv_plan(16, 8, 64, 2048, torch.bfloat16, cpu, qk_norm=qk_norm)
        assert dataclasses.replace(q, row1=None) == plan_qkv(16, 8, 64, 2048, torch.bfloat16, 132)
        assert q.row1 == (None if qk_norm else GemvPlan(8, 1024, 4, 3))


@pytest.mark.parametrize("entry,qk_norm,want", [
    ((16, 2048, 8, 1), False, GemvPlan(16, 2048, 8, 1)),      # the row-pair form, a model without q/k norm
    ((16, 2048, 8, 1), True, None),                           # ... never for q/k norm: that model keeps tl.dot
    ((64, 256, 4, 3, 8), True, GemvPlan(64, 256, 4, 3, 8)),   # a head per program serves both
    ((128, 256, 4, 3, 8), False, GemvPlan(8, 1024, 4, 3)),    # block_n past the head dim: the default instead
    ((128, 256, 4, 3, 8), True, None),
])
def test_qkv_row1_entry_follows_the_models_qk_norm(monkeypatch: pytest.MonkeyPatch, entry: tuple, qk_norm: bool,
                                                   want: GemvPlan | None) -> None:
    """A "qkv" TUNED_ROW1 entry is keyed by (N, K) only, which a Llama and a Qwen3 of equal shapes share: the
    row-pair form reaches only the model without q/k norm."""
    _on_gpu(monkeypatch, "NVIDIA H200", H200_CHIP)
    monkeypatch.setitem(tuned_plans.TUNED_ROW1, ("NVIDIA H200", "qkv", 3072, 2048, "bfloat16"), entry)
    assert tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, torch.device("cpu"), qk_norm=qk_norm).row1 == want


def test_qkv_late_entry_serves_only_a_qk_norm_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """A "qkv_late" entry (the row-pair form with q/k norm finished in the attention) is read, before "qkv", by a
    model with q/k norm only; a head-per-program value under that kind is refused by name."""
    _on_gpu(monkeypatch, "NVIDIA H200", H200_CHIP)
    cpu = torch.device("cpu")
    late_key = ("NVIDIA H200", "qkv_late", 3072, 2048, "bfloat16")
    monkeypatch.setitem(tuned_plans.TUNED_ROW1, late_key, (8, 1024, 4, 3))
    assert tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, cpu, qk_norm=True).row1 == GemvPlan(8, 1024, 4, 3)
    assert tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, cpu, qk_norm=False).row1 == \
        GemvPlan(*tuned_plans.TUNED_ROW1[("NVIDIA H200", "qkv", 3072, 2048, "bfloat16")])
    monkeypatch.setitem(tuned_plans.TUNED_ROW1, late_key, (64, 256, 4, 3, 8))
    with pytest.raises(ValueError, match="qk_late serves"):
        tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, cpu, qk_norm=True)


@pytest.mark.parametrize("kind,value", [("qkv", (8, 1024, 4)), ("qkv", (6, 1024, 4, 3)), ("qkv", ()),
                                        ("qkv", ("8", 1024, 4, 3)), ("qkv_late", (8.0, 1024, 4, 3)),
                                        ("gemm", (8, 2048, 8)), ("gemm", (8, 2048, 8, 1, 1, -2))])
def test_a_malformed_row1_entry_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, kind: str, value: tuple) -> None:
    """A TUNED_ROW1 value that is not (BLOCK_N, BLOCK_K, warps, stages[, split-K]) of powers of two fails naming the
    entry, for either model (a q/k-norm model used to skip some of them silently)."""
    _on_gpu(monkeypatch, "NVIDIA H200", H200_CHIP)
    n, k = (2048, 2048) if kind == "gemm" else (3072, 2048)
    monkeypatch.setitem(tuned_plans.TUNED_ROW1, ("NVIDIA H200", kind, n, k, "bfloat16"), value)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=f"TUNED_ROW1 entry \\('{kind}'"):
        if kind == "gemm":
            tuned_plans.gemm_plan(n, k, torch.bfloat16, cpu)
        else:
            tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, cpu, qk_norm=True)


@pytest.mark.parametrize("kind,block_n,qk_norm", [("qkv", 8, False), ("qkv", 8, True), ("qkv", 64, True),
                                                   ("qkv", 128, False), ("qkv", 128, True), ("qkv_late", 8, True)])
def test_a_qkv_entry_with_a_weight_stream_is_refused(monkeypatch: pytest.MonkeyPatch, kind: str, block_n: int,
                                                     qk_norm: bool) -> None:
    """``per_sm`` is the GEMV's weight stream; qkv_rope's one-row loop has none, so a "qkv" entry asking for it is
    refused by name at plan time, for either model and whatever its block_n, never dropped for a default (an entry
    a model would not take otherwise was dropped silently before the check)."""
    _on_gpu(monkeypatch, "NVIDIA H200", H200_CHIP)
    monkeypatch.setitem(tuned_plans.TUNED_ROW1, ("NVIDIA H200", kind, 3072, 2048, "bfloat16"),
                        (block_n, 1024, 4, 3, 1, 2))
    with pytest.raises(ValueError, match="no weight-stream form"):
        tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, torch.device("cpu"), qk_norm=qk_norm)


def test_a_row1_value_of_seven_fields_is_refused_by_count(monkeypatch: pytest.MonkeyPatch) -> None:
    _on_gpu(monkeypatch, "NVIDIA H200", H200_CHIP)
    monkeypatch.setitem(tuned_plans.TUNED_ROW1, ("NVIDIA H200", "gemm", 2048, 2048, "bfloat16"),
                        (8, 2048, 8, 1, 1, 2, 0))
    with pytest.raises(ValueError, match="has 7 fields; it takes 4 to 6"):
        tuned_plans.gemm_plan(2048, 2048, torch.bfloat16, torch.device("cpu"))


def test_every_shipped_entry_is_a_valid_plan() -> None:
    """The tables as shipped: each TUNED value a five-int plan, each TUNED_ROW1 value a GemvPlan (a "qkv" one the
    head dim or a row-pair form), each TUNED_ATTN value an AttnPlan."""
    for (_, kind, n, k, _), v in tuned_plans.TUNED.items():
        assert len(v) == 5 and all(isinstance(x, int) and x > 0 for x in v), (kind, n, k, v)
    for (_, kind, n, k, _), v in tuned_plans.TUNED_ROW1.items():
        plan = tuned_plans._row1_entry(kind, n, k, v)
        assert kind in ("qkv", "qkv_late", "gemm", "gated")
        if kind.startswith("qkv"):
            assert plan.block_n <= 128 and (plan.block_n in (64, 128) or plan.split_k == 1)
    for v in tuned_plans.TUNED_ATTN.values():
        tuned_plans.AttnPlan(*v)


def test_qkv_row1_entry_of_the_pair_form_with_split_k_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _on_gpu(monkeypatch, "NVIDIA H200", H200_CHIP)
    monkeypatch.setitem(tuned_plans.TUNED_ROW1, ("NVIDIA H200", "qkv", 3072, 2048, "bfloat16"), (16, 256, 4, 1, 2))
    with pytest.raises(ValueError, match="split_k must be 1"):
        tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, torch.device("cpu"), qk_norm=False)


H200_CHIP = ((9, 0), 132)


def _on_gpu(monkeypatch: pytest.MonkeyPatch, name: str, chip: tuple[tuple[int, int], int] | None) -> None:
    monkeypatch.setattr(tuned_plans, "device_name", lambda dev: name)
    monkeypatch.setattr(tuned_plans, "device_chip", lambda dev: chip)
    monkeypatch.setattr(tuned_plans, "num_sms", lambda dev: 132)


def test_every_table_names_a_gpu_of_measured_on() -> None:
    """A device name in a table without its chip in ``MEASURED_ON`` would never serve a sibling GPU."""
    names = {k[0] for t in (tuned_plans.TUNED, tuned_plans.TUNED_ROW1, tuned_plans.TUNED_ATTN,
                            tuned_plans.TUNED_PRENORM) for k in t}
    assert names <= set(tuned_plans.MEASURED_ON)


def test_same_chip_reads_the_measured_table_other_chips_the_heuristic(monkeypatch: pytest.MonkeyPatch) -> None:
    """An H100 SXM (sm90, 132 SMs, one entry of its own) takes the H200's plans elsewhere; an H100 PCIe (114 SMs) or
    an sm89 GPU keeps the heuristics; a GPU with its own entry reads its own first and the sibling's for the rest;
    and the H200, which has entries for every shape the H100's entry covers, reads its own."""
    cpu = torch.device("cpu")
    key = ("gemm", 2048, 8192, "bfloat16")
    _on_gpu(monkeypatch, "NVIDIA H200", H200_CHIP)
    h200 = tuned_plans.gemm_plan(2048, 8192, torch.bfloat16, cpu)
    h200_o = tuned_plans.gemm_plan(2048, 2048, torch.bfloat16, cpu)
    heuristic = dataclasses.replace(plan_gemm(2048, 8192, torch.bfloat16, 132),
                                    row1=tuned_plans.default_row1(8192, gated=False))
    assert h200 != heuristic
    _on_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", H200_CHIP)
    assert tuned_plans.plan_sources(cpu) == ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
    assert tuned_plans.gemm_plan(2048, 8192, torch.bfloat16, cpu) == h200
    assert tuned_plans.prenorm_rows("dense", 2048, torch.bfloat16, cpu) == \
        tuned_plans.TUNED_PRENORM[("NVIDIA H200", "dense", 2048, "bfloat16")]
    attn_key = ("attn", 8, 1, 32, 8, 64, "bfloat16")
    assert tuned_plans.attn_plan(8, 1, 32, 8, 64, 2048, 132, torch.bfloat16, device=cpu).num_splits == \
        tuned_plans.TUNED_ATTN[("NVIDIA H200", *attn_key)][0]
    for name, chip in [("NVIDIA H100 PCIe", ((9, 0), 114)), ("NVIDIA L40S", ((8, 9), 142)), ("cpu", None)]:
        _on_gpu(monkeypatch, name, chip)
        assert tuned_plans.plan_sources(cpu) == (name,)
        assert tuned_plans.gemm_plan(2048, 8192, torch.bfloat16, cpu) == heuristic
        assert tuned_plans.prenorm_rows("dense", 2048, torch.bfloat16, cpu) == 0
    # its own entry first, the sibling's where it has none
    _on_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", H200_CHIP)
    monkeypatch.setitem(tuned_plans.MEASURED_ON, "NVIDIA H100 80GB HBM3", H200_CHIP)
    monkeypatch.setitem(tuned_plans.TUNED, ("NVIDIA H100 80GB HBM3", *key), (32, 64, 4, 4, 2))
    own = tuned_plans.gemm_plan(2048, 8192, torch.bfloat16, cpu)
    assert (own.block_n, own.block_k, own.split_k, own.num_warps, own.num_stages) == (32, 64, 4, 4, 2)
    assert own.row1 == h200.row1  # TUNED_ROW1 has no H100 entry for it: the H200's
    assert tuned_plans.gemm_plan(2048, 2048, torch.bfloat16, cpu) == h200_o
    qkv_key = ("qkv", 3072, 2048, "bfloat16")
    assert tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, cpu, qk_norm=False).row1 == \
        GemvPlan(*tuned_plans.TUNED_ROW1[("NVIDIA H100 80GB HBM3", *qkv_key)])
    _on_gpu(monkeypatch, "NVIDIA H200", H200_CHIP)
    assert tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, cpu, qk_norm=False).row1 == \
        GemvPlan(*tuned_plans.TUNED_ROW1[("NVIDIA H200", *qkv_key)])


@pytest.mark.parametrize("value", ["0", "off", "no"])
def test_tuned_off_reads_no_table(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """``LOWLAT_MEGA_TUNED=0``: the heuristics on the table's own GPU too (the ablation of what the tables buy)."""
    cpu = torch.device("cpu")
    _on_gpu(monkeypatch, "NVIDIA H200", H200_CHIP)
    monkeypatch.setenv(tuned_plans.TUNED_ENV, value)
    assert tuned_plans.plan_sources(cpu) == ()
    assert tuned_plans.gemm_plan(2048, 8192, torch.bfloat16, cpu) == dataclasses.replace(
        plan_gemm(2048, 8192, torch.bfloat16, 132), row1=tuned_plans.default_row1(8192, gated=False))
    assert tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, cpu, qk_norm=False) == dataclasses.replace(
        plan_qkv(32, 8, 64, 2048, torch.bfloat16, 132), row1=tuned_plans.default_qkv_row1(64, 2048, qk_norm=False))
    assert tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, cpu, qk_norm=True) == \
        plan_qkv(32, 8, 64, 2048, torch.bfloat16, 132)
    assert tuned_plans.prenorm_rows("dense", 2048, torch.bfloat16, cpu) == 0
    for on in ("1", "", "default"):
        monkeypatch.setenv(tuned_plans.TUNED_ENV, on)
        assert tuned_plans.plan_sources(cpu) == ("NVIDIA H200", "NVIDIA H100 80GB HBM3")


def test_tuned_switch_refuses_a_typo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tuned_plans.TUNED_ENV, "heuristic")
    with pytest.raises(ValueError, match="LOWLAT_MEGA_TUNED"):
        tuned_plans.plan_sources(torch.device("cpu"))


def test_tune_plans_smoke_runs_every_sweep(tmp_path: Path) -> None:
    """``tune_plans.py --smoke`` (CPU interpreter, tiny shapes) runs the plan sweeps, the one-row sweeps of all four
    kernels and the F.linear reference, and writes its JSON; on a GPU the same code times them."""
    script = Path(__file__).resolve().parents[1] / "tune_plans.py"
    out = tmp_path / "tune.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, str(script), "--smoke", "--rows", "1", "--json", str(out)], check=True, env=env,
                   capture_output=True, timeout=600)
    rows = {r["kernel"]: r for r in json.loads(out.read_text()) if "kernel" in r}
    assert set(rows) == {"qkv_rope", "o_proj", "gate_up", "down"}
    for r in rows.values():
        assert r["row1_best"]["split_k"] >= 1 and "cublas_us" in r and r["candidates"] >= 1


@pytest.mark.parametrize("env,rows,prenorm", [("1", 3, True), ("1", 1, False), ("0", 3, False), (None, 3, False)])
def test_tune_plans_times_the_norm_prologue_only_where_production_runs_it(
        monkeypatch: pytest.MonkeyPatch, env: str | None, rows: int, prenorm: bool) -> None:
    """The sweep's kernels with a norm prologue (qkv_rope, gate_up) run without it on a prenorm step, as
    ``MegaForward`` runs them (``norm_rows.prenorm_step``; on CPU no table entry, so only ``LOWLAT_MEGA_PRENORM=1``
    makes one): a plan is not chosen for a prologue the step skips (found 2026-12-07: at 2 rows a candidate won alone
    by the prologue it saved and lost the step by 13%). ``bench_kernels.py`` decides by the same ``Case.prenorm``:
    its kernel chains drop the prologue, its layer chain puts ``norm_rows`` launches before qkv_rope and gate_up."""
    import importlib

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    tp = importlib.import_module("tune_plans")
    bk = tp.bk
    if env is None:
        monkeypatch.delenv("LOWLAT_MEGA_PRENORM", raising=False)
    else:
        monkeypatch.setenv("LOWLAT_MEGA_PRENORM", env)
    case = bk.Case("tiny", rows, 40, torch.device("cpu"), torch.float32)
    tuner = tp.Tuner(case, 1)
    assert case.prenorm is prenorm and tuner.prenorm is prenorm
    assert (tuner.norm(0) is None) is prenorm and (prenorm or tuner.norm(9) is case.norm[1])
    seen: list[object] = []  # what the chains pass as the norm weight
    normed: list[object] = []  # the rows norm_rows normalized (the layer chain's prenorm launches)
    monkeypatch.setattr(tp, "gemm", lambda *a, **kw: seen.append(kw["norm_weight"]))
    monkeypatch.setattr(tp, "qkv_rope", lambda x, nw, *a, **kw: seen.append(nw))
    s = case.s
    tuner.gemm_chain("gate_up", plan_gemm(s["inter"], s["hidden"], torch.float32, 4, gated=True))()
    tuner.qkv_chain(dataclasses.replace(plan_qkv(s["heads"], s["kv_heads"], s["head_dim"], s["hidden"],
                                                 torch.float32, 4), row1=None))()
    assert seen and all((w is None) is prenorm for w in seen)
    seen.clear()
    monkeypatch.setattr(bk, "gemm", lambda x, w, out, **kw: seen.append((x, kw.get("norm_weight", "none"))))
    monkeypatch.setattr(bk, "qkv_rope", lambda x, nw, *a, **kw: seen.append((x, nw)))
    monkeypatch.setattr(bk, "paged_decode_attention", lambda *a, **kw: None)
    monkeypatch.setattr(bk, "norm_rows", lambda x, nw, eps, out, **kw: normed.append(nw) or out)
    case.qkv(False, True)()
    case.gemm("gate_up", False)()
    n = case.layer(False, general=False)()
    with_prologue = [nw for _, nw in seen if not isinstance(nw, str)]  # qkv_rope and gate_up, not o_proj / down
    assert with_prologue and all((nw is None) is prenorm for nw in with_prologue)
    assert len(normed) == (2 * n if prenorm else 0) and all(nw is not None for nw in normed)
    if prenorm:  # the layer's qkv_rope and gate_up read what norm_rows wrote
        assert sum(x is case.h for x, _ in seen) == 2 * n
    if env is None:  # the measured rule, by the model's kind: tiny is an MoE model
        monkeypatch.setattr(bk, "prenorm_rows", lambda kind, hidden, dt, dev: 6 if kind == "moe" else 0)
        case = bk.Case("tiny", rows, 40, torch.device("cpu"), torch.float32)
        assert case.prenorm is True and tp.Tuner(case, 1).prenorm is True


def test_tune_plans_stream_smoke_sweeps_the_weight_stream(tmp_path: Path) -> None:
    """``tune_plans.py --smoke --stream`` sweeps the GEMV's weight stream of the three GEMMs (not qkv_rope) against
    the production one-row plan, with per-tile candidates (per_sm 0) beside the streams, and writes its JSON."""
    script = Path(__file__).resolve().parents[1] / "tune_plans.py"
    out = tmp_path / "stream.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, str(script), "--smoke", "--stream", "--rows", "1", "--json", str(out)],
                   check=True, env=env, capture_output=True, timeout=600)
    rows = {r["kernel"]: r for r in json.loads(out.read_text()) if "kernel" in r}
    assert set(rows) == {"o_proj", "gate_up", "down"}
    for r in rows.values():
        assert r["production"]["per_sm"] == 0 and r["tile_best"]["per_sm"] == 0 and len(r["all"]) >= 4
        assert {p["per_sm"] for p, _ in r["all"]} == {0, 1} and "best_us" in r and "cublas_us" in r


@pytest.mark.parametrize("mode", [[], ["--in-layer"], ["--in-layer", "full"]], ids=["alone", "in-layer", "full"])
def test_tune_attention_smoke_runs_the_sweep(tmp_path: Path, mode: list[str]) -> None:
    """``tune_attention.py --smoke`` (CPU interpreter, tiny shape) runs every stage of the attention plan sweep for
    a DECODE and a VERIFY shape, with two processes launching each stage's plans ahead (the GPU run's compile
    workers), checks each candidate's output against the torch reference (exit status 1 if one fails) and writes
    its JSON; on a GPU the same code times them. ``--in-layer`` times each plan in the layer chain instead
    (qkv_rope -> attention -> o_proj; ``full``: then the dense MLP, and a MoE preset's MoE) and checks the chain's
    attention output too."""
    script = Path(__file__).resolve().parents[1] / "tune_attention.py"
    out = tmp_path / "attn.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    jobs = [] if mode else ["--jobs", "2"]
    subprocess.run([sys.executable, str(script), "--smoke", *jobs, *mode, "--json", str(out)], check=True, env=env,
                   capture_output=True, timeout=600)
    data = json.loads(out.read_text())
    rows = data["results"]
    models = ["tiny", "tiny-qwen3-moe"] if "full" in mode else ["tiny"]
    assert [(r["model"], r["mode"], r["batch"], r["rows"]) for r in rows] == [
        (m, mo, b, r) for m in models for mo, b, r in [("decode", 2, 1), ("verify", 1, 3)]]
    for r in rows:
        assert r["candidates"] >= 3 and not r["wrong"] and r["floor_us"] > 0
        plans = [c[0] for c in r["all"]]
        assert r["production"] in plans and {p["block_kv"] for p in plans} == {16, 64}
        assert all(err <= 1e-4 for _, _, err in r["all"])
    if mode:
        assert data["meta"]["in_layer"] == (mode + ["attn"])[1]
        for r in rows:
            assert r["in_layer"] == data["meta"]["in_layer"] and r["layers"] == 2 and r["chain_error"] <= 1e-4
            assert {"base_us", "production_alone_us", "best_alone_us"} <= set(r)
    else:
        assert data["meta"]["in_layer"] is None and "base_us" not in rows[0]


@pytest.mark.parametrize("fields", [(3, 1024, 4, 1), (8, 1000, 4, 1), (8, 1024, 6, 1), (8, 1024, 4, 0),
                                    (8, 1024, 4, 1, 0), (0, 1024, 4, 1)])
def test_gemv_plan_refuses_tiles_triton_cannot_build(fields: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="GemvPlan"):
        GemvPlan(*fields)


@pytest.mark.parametrize("fields,match", [
    ((6, 1024, 4, 1), "block_n must be a power of two"),
    ((8, 1000, 4, 1), "block_k must be a power of two"),
    ((8, 1024, 64, 1), "num_warps must be a power of two >= 1 and <= 32"),
    ((8, 1024, 4, 0), "num_stages >= 1"),
    ((8, 1024, 4, 1, 0), "split_k >= 1"),
    ((8, 1024, 4, 2.5), "num_stages must be an int"),
    ((8.0, 1024, 4, 1), "block_n must be an int"),
    ((8, 1024, True, 1), "num_warps must be an int"),
    ((8, 1024, 4, 1, 1, -1), "per_sm must be 0"),
    ((8, 1024, 4, 1, 2, 4), "per_sm 4 with split_k 2"),
    ((8, 1024, 4, 1, 1, 2.0), "per_sm must be an int"),
])
def test_gemv_plan_refuses_a_launch_it_cannot_make(fields: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GemvPlan(*fields)
