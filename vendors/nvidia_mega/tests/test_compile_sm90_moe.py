"""Compile the MoE kernels for sm90 at Qwen3-30B-A3B's shapes, without a GPU (LOWLAT_MEGA_COMPILE_CHECK=1, which
the gpu-tests job and ``nox -s tests -- <this file>`` set,
like ``test_compile_sm90.py``): the routing kernel, gate/up in both forms (``tl.dot`` and the one-row FMA loop of
``moe_row1.py``) and down in both forms (``tl.dot`` and ``ROW1``), each launch captured from ``MoEStages`` itself,
at 1 and 8 rows with PDL. Run without ``TRITON_INTERPRET``:

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
    pytest.skip("sm90 compile check: set LOWLAT_MEGA_COMPILE_CHECK=1, unset TRITON_INTERPRET",
                allow_module_level=True)

from lowlat_nvidia_mega.kernels import moe  # noqa: E402
from sm90_launch import META, capture, compile_ptx  # noqa: E402

H, I, E, K = 2048, 768, 128, 8  # noqa: E741 (I: the MoE intermediate size)
DT = torch.bfloat16
TDOT = moe.MoEKernelConfig(row1=False)  # the tl.dot forms at one row too
ROW1 = moe.MoEKernelConfig()  # production: the one-row FMA forms at one row
CHUNKED = moe.MoEKernelConfig(down_block_n=64, down_block_i=128)  # down's I loop (software-pipelined)
SCAN = moe.MoEKernelConfig(route_gather=False)  # the routing's row_slot as a compare-and-sum
KEYS = moe.MoEKernelConfig(route_keys=True)  # the routing's top-k on int32 keys
MIN1 = moe.MoEKernelConfig(route_min_rows=1)  # a one-row step's selection on its own 1-row tile (default: 4 rows)
# stage: (kernel name in moe.py, the MoEStages method that launches it)
KERNELS = {"route": ("moe_route_kernel", "route"), "gate_up": ("_moe_gate_up_kernel", "gate_up"),
           "gate_up_row1": ("_moe_gate_up_row1_kernel", "gate_up"), "down": ("_moe_down_kernel", "down")}
ORIGINAL = {name: getattr(moe, name) for name, _ in KERNELS.values()}  # before a test swaps one for a recorder


def _stages(rows: int, cfg: moe.MoEKernelConfig, h: int = H, i: int = I, e: int = E,
            k: int = K) -> moe.MoEStages:
    def t(*shape: int, dtype: torch.dtype = DT) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=META)
    ws = moe.MoEWorkspace.allocate(8, h, i, e, k, DT, META)
    x = t(rows, h)
    return moe.moe_stages(x, x, t(h), 1e-6, t(e, h), t(e, 2 * i, h), t(e, h, i), k, True, t(rows, h), ws, pdl=True,
                          config=cfg)


@pytest.mark.parametrize(("stage", "rows", "cfg"), [
    ("route", 1, ROW1), ("route", 8, ROW1), ("gate_up", 1, TDOT), ("gate_up", 8, ROW1), ("gate_up_row1", 1, ROW1),
    ("down", 1, TDOT), ("down", 8, ROW1), ("down", 1, ROW1), ("down", 8, CHUNKED), ("down", 1, CHUNKED),
    ("route", 1, SCAN), ("route", 8, SCAN), ("route", 1, KEYS), ("route", 8, KEYS), ("route", 1, MIN1)],
    ids=lambda v: {id(ROW1): "row1", id(TDOT): "tl.dot", id(CHUNKED): "chunked", id(SCAN): "scan",
                   id(KEYS): "keys", id(MIN1): "min1"}.get(id(v), str(v)))
def test_moe_kernels_compile_for_sm90(stage: str, rows: int, cfg: moe.MoEKernelConfig,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    name, method = KERNELS[stage]
    monkeypatch.setattr(moe, "pdl_supported", lambda device=None: True)  # meta tensors stand in for a GPU
    stages = _stages(rows, cfg)
    bound, options = capture(monkeypatch, moe, name, getattr(stages, method))
    if stage == "down":
        assert bound["ROW1"] is (rows == 1 and cfg.row1)
    ptx = compile_ptx(ORIGINAL[name], bound, options)
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    if stage == "route":  # the key search's picks are integer maxima: one redux.sync per warp
        assert bound["KEYS"] is cfg.route_keys and ("redux.sync.max.s32" in ptx) is cfg.route_keys
        assert bound["SEL_ROWS"] == max(rows, cfg.route_min_rows)
    if stage == "down" and cfg is CHUNKED and rows > 1:
        assert "cp.async" in ptx, "the I loop's weight and act tiles must be software-pipelined"
    if stage in ("gate_up_row1", "down") and rows == 1 and cfg.row1:
        assert "mma" not in ptx, "the one-row forms run on the FMA units"
    if stage != "route":  # expert weights stream as 16-byte loads
        assert any(("ld.global" in ln or "cp.async" in ln) and ("v4" in ln or "0x10" in ln)
                   for ln in ptx.splitlines()), "expert weights must load 16 bytes at a time"


@pytest.mark.parametrize("stage", ["gate_up", "down"])
def test_tiny_sizes_compile(stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """H and I below 16 (a tiny test model): the launcher pads the tl.dot K chunk to 16, which sm90 needs."""
    name, method = KERNELS[stage]
    monkeypatch.setattr(moe, "pdl_supported", lambda device=None: True)
    stages = _stages(8, TDOT, h=8, i=4, e=4, k=2)
    bound, options = capture(monkeypatch, moe, name, getattr(stages, method))
    assert bound["BLOCK_K" if stage == "gate_up" else "BLOCK_I"] == 16
    compile_ptx(ORIGINAL[name], bound, options)
