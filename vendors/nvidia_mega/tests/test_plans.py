"""Launch-plan selection: the measured table on its GPU, the heuristic elsewhere (CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lowlat_nvidia_mega.kernels import tuned_plans
from lowlat_nvidia_mega.kernels.qkv_rope import plan_qkv
from lowlat_nvidia_mega.kernels.small_gemm import GemvPlan, plan_gemm


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
    q = tuned_plans.qkv_plan(32, 8, 64, 2048, torch.bfloat16, cpu)
    assert q.block_n == 64 and q != plan_qkv(32, 8, 64, 2048, torch.bfloat16, 132)
