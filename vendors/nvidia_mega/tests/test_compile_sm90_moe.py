"""Compile the MoE kernels for sm90 at Qwen3-30B-A3B's shapes, without a GPU (opt-in: LOWLAT_MEGA_COMPILE_CHECK=1,
like ``test_compile_sm90.py``): the routing kernel, gate/up in both forms (``tl.dot`` and the one-row FMA loop of
``moe_row1.py``) and down in its four (``tl.dot``, ``ROW1``, the split-free one-row kernel, the slot loop), each
launch captured from ``MoEStages`` itself, at 1, 2 and 8 rows with PDL. Run without ``TRITON_INTERPRET``:

    LOWLAT_MEGA_COMPILE_CHECK=1 PYTHONPATH=core/src:vendors/nvidia_mega/src \\
        python -m pytest vendors/nvidia_mega/tests/test_compile_sm90_moe.py -q
"""

from __future__ import annotations

import os

import pytest
import torch
from lowlat_nvidia_mega.kernels import pdl

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if pdl.interpreting() or os.environ.get("LOWLAT_MEGA_COMPILE_CHECK") != "1":
    pytest.skip("opt-in sm90 compile check: set LOWLAT_MEGA_COMPILE_CHECK=1, unset TRITON_INTERPRET",
                allow_module_level=True)

from lowlat_nvidia_mega.kernels import moe  # noqa: E402
from sm90_launch import META, capture, compile_ptx  # noqa: E402

H, I, E, K = 2048, 768, 128, 8  # noqa: E741 (I: the MoE intermediate size)
DT = torch.bfloat16
ROW1 = moe.MoEKernelConfig(gate_up_row1=True, down_row1=True)
FUSED = moe.MoEKernelConfig(gate_up_row1=True, down_fused=True)
LOOP = moe.MoEKernelConfig(down_loop=True)
RANK = moe.MoEKernelConfig(route_rank=True)
UNROLL = moe.MoEKernelConfig(route_unroll=True)
NAMES = {"row1": ROW1, "fused": FUSED, "loop": LOOP, "rank": RANK, "unroll": UNROLL}
# stage: (kernel name in moe.py, the MoEStages method that launches it)
KERNELS = {"route": ("moe_route_kernel", "route"), "gate_up": ("_moe_gate_up_kernel", "gate_up"),
           "gate_up_row1": ("_moe_gate_up_row1_kernel", "gate_up"), "down": ("_moe_down_kernel", "down"),
           "down_fused": ("_moe_down_row1_kernel", "down"), "down_loop": ("_moe_down_loop_kernel", "down")}
ORIGINAL = {name: getattr(moe, name) for name, _ in KERNELS.values()}  # before a test swaps one for a recorder


def _stages(rows: int, cfg: moe.MoEKernelConfig) -> moe.MoEStages:
    def t(*shape: int, dtype: torch.dtype = DT) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=META)
    ws = moe.MoEWorkspace.allocate(8, H, I, E, K, DT, META)
    x = t(rows, H)
    return moe.moe_stages(x, x, t(H), 1e-6, t(E, H), t(E, 2 * I, H), t(E, H, I), K, True, t(rows, H), ws, pdl=True,
                          config=cfg)


@pytest.mark.parametrize(("stage", "rows", "cfg"), [
    ("route", 1, None), ("route", 8, None), ("route", 1, RANK), ("route", 8, RANK), ("route", 8, UNROLL),
    ("gate_up", 1, None), ("gate_up", 8, None), ("gate_up_row1", 1, ROW1),
    ("down", 1, None), ("down", 8, None), ("down", 1, ROW1), ("down_fused", 1, FUSED),
    ("down_loop", 8, LOOP), ("down_loop", 2, LOOP)],
    ids=lambda v: next((n for n, c in NAMES.items() if c is v), str(v)))
def test_moe_kernels_compile_for_sm90(stage: str, rows: int, cfg: moe.MoEKernelConfig | None,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    name, method = KERNELS[stage]
    monkeypatch.setattr(moe, "pdl_supported", lambda device=None: True)  # meta tensors stand in for a GPU
    stages = _stages(rows, cfg or moe.MoEKernelConfig())
    bound, options = capture(monkeypatch, moe, name, getattr(stages, method))
    if stage == "down":
        assert bound["ROW1"] is (cfg is ROW1)
    ptx = compile_ptx(ORIGINAL[name], bound, options)
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    if stage in ("gate_up_row1", "down", "down_fused") and cfg in (ROW1, FUSED):
        assert "mma" not in ptx, "the one-row forms run on the FMA units"
    if stage == "down_loop":
        assert "cp.async" in ptx, "the slot loop's weight and act tiles must be software-pipelined"
    if stage != "route":  # expert weights stream as 16-byte loads
        assert any(("ld.global" in ln or "cp.async" in ln) and ("v4" in ln or "0x10" in ln)
                   for ln in ptx.splitlines()), "expert weights must load 16 bytes at a time"
