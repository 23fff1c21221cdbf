"""The one-row MoE down without the split over slots (``MoEKernelConfig.row1_down_loop``,
``moe_row1._moe_down_row1_kernel``), under TRITON_INTERPRET=1 on CPU (or on a GPU), against the torch reference of
``test_kernels_moe.py`` and the split kernel's ``ROW1`` form it replaces: same roundings, experts summed in k order,
I chunks and experts in one flat loop, residual or none, in place, and which kernel runs when.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from lowlat_nvidia_mega.kernels.moe import MoEKernelConfig, MoEWorkspace, moe_forward  # noqa: E402
from test_kernels_moe import (  # noqa: E402
    CFG_ROW1,
    DEV,
    EPS,
    E,
    H,
    I,
    K,
    check_routing_metadata,
    dev,
    make_weights,
    make_x,
    poisoned_alloc,
    reference,
    run,
    tol,
)

# 16 output columns per program (4 programs over H = 64); I = 32 in two chunks of 16.
LOOP = dataclasses.replace(CFG_ROW1, row1_down_loop=True, row1_down_block_n=16, row1_down_block_i=16)
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def test_off_by_default() -> None:
    """Off until a whole-step A/B on a GPU says it pays (docs/kernels.md)."""
    assert MoEKernelConfig().row1_down_loop is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_i", [16, 32, 64])
def test_matches_reference_and_split_form(dtype: torch.dtype, block_i: int) -> None:
    """At one row: the reference's output, and the split kernel's ROW1 output up to the fp32 summation order. With
    the whole of I in one chunk (32; 64 masked) the two sum the same products in the same order (two experts, k
    order, then the residual), so under the interpreter they agree bit for bit."""
    norm_w, gate_w, w13, w2 = make_weights(dtype, seed=21)
    x, residual = make_x(1, dtype, seed=22)
    cfg = dataclasses.replace(LOOP, row1_down_block_i=block_i)
    out, ws = run(x, residual, norm_w, gate_w, w13, w2, True, cfg=cfg)
    split, _ = run(x, residual, norm_w, gate_w, w13, w2, True, cfg=dataclasses.replace(CFG_ROW1, down_block_i=block_i))
    want, ids, _ = reference(x, residual, norm_w, gate_w, w13, w2, True)
    assert torch.equal(ws.topk_ids[:1].long().cpu(), ids)
    torch.testing.assert_close(out.float(), want.float(), **tol(dtype))
    if INTERPRETING and block_i >= I:
        assert torch.equal(out, split)
    else:
        torch.testing.assert_close(out.float(), split.float(), atol=1e-5 if dtype == torch.float32 else 0.0625,
                                   rtol=1e-5 if dtype == torch.float32 else 0.02)
    check_routing_metadata(ws, 1)


@pytest.mark.parametrize("top_k", [1, 3, 5])
def test_top_k_and_chunks(top_k: int) -> None:
    """Other top-k (the flat loop's expert boundaries at every chunk count): 1 expert (only the final close), 3 and
    5 experts in two I chunks each, against the reference in float32 (tight) and the expert order kept."""
    norm_w, gate_w, w13, w2 = make_weights(torch.float32, seed=23)
    x, residual = make_x(1, torch.float32, seed=24)
    out, ws = run(x, residual, norm_w, gate_w, w13, w2, True, cfg=LOOP, top_k=top_k)
    want, ids, _ = reference(x, residual, norm_w, gate_w, w13, w2, True, top_k=top_k)
    assert torch.equal(ws.topk_ids[:1, :top_k].long().cpu(), ids)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_weights_scale_each_expert() -> None:
    """Each expert's product is scaled by its own routing weight: without renormalization the weights do not sum to
    one, so a kernel that used one expert's weight for all, or none, is off by far more than the tolerance."""
    norm_w, gate_w, w13, w2 = make_weights(torch.float32, seed=25)
    x, residual = make_x(1, torch.float32, seed=26)
    out, _ = run(x, residual, norm_w, gate_w, w13, w2, False, cfg=LOOP, top_k=3)
    want, _, weights = reference(x, residual, norm_w, gate_w, w13, w2, False, top_k=3)
    assert float(weights.sum()) < 0.99
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_residual_and_in_place(dtype: torch.dtype) -> None:
    """No residual (``out = MoE(h)``), and out aliasing the residual (the stream updated in place)."""
    norm_w, gate_w, w13, w2 = make_weights(dtype, seed=27)
    x, residual = make_x(1, dtype, seed=28)
    out, _ = run(x, None, None, gate_w, w13, w2, True, cfg=LOOP)
    want, _, _ = reference(x, None, None, gate_w, w13, w2, True)
    torch.testing.assert_close(out.float(), want.float(), **tol(dtype))
    ws = MoEWorkspace.allocate(1, H, I, E, K, dtype, DEV, alloc=poisoned_alloc)
    stream = dev(residual.clone())
    moe_forward(dev(x), stream, dev(norm_w), EPS, dev(gate_w), dev(w13), dev(w2), K, True, stream, ws, pdl=False,
                config=LOOP)
    want, _, _ = reference(x, residual, norm_w, gate_w, w13, w2, True)
    torch.testing.assert_close(stream.float().cpu(), want.float(), **tol(dtype))


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_launches(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop kernel runs exactly at one row with ``row1`` and ``row1_down_loop``: grid ``(H / block_n,)``, I
    chunk from ``row1_down_block_i`` (capped at I rounded up to a power of two), the row's top-k; otherwise the split
    kernel, as before."""
    from lowlat_nvidia_mega.kernels import moe
    from sm90_launch import LaunchRecorder

    log: list = []
    for name in ("moe_route_kernel", "_moe_gate_up_kernel", "_moe_gate_up_row1_kernel", "_moe_down_kernel",
                 "_moe_down_row1_kernel"):
        monkeypatch.setattr(moe, name, LaunchRecorder(name, log))
    norm_w, gate_w, w13, w2 = make_weights(torch.float32)
    x, residual = make_x(rows, torch.float32)
    for cfg, want_loop in ((LOOP, rows == 1), (dataclasses.replace(LOOP, row1=False), False), (CFG_ROW1, False)):
        for block_i, want_i in ((16, 16), (1024, 32)):
            log.clear()
            ws = MoEWorkspace.allocate(8, H, I, E, K, torch.float32, DEV)
            moe_forward(dev(x), dev(residual), dev(norm_w), EPS, dev(gate_w), dev(w13), dev(w2), K, True,
                        torch.empty_like(dev(x)), ws, pdl=False,
                        config=dataclasses.replace(cfg, row1_down_block_i=block_i))
            name, grid, _, kwargs = log[-1]
            assert len(log) == 3
            if want_loop:
                assert name == "_moe_down_row1_kernel" and grid == (H // cfg.row1_down_block_n,)
                assert (kwargs["BLOCK_I"], kwargs["TOP_K"], kwargs["INTER"]) == (want_i, K, I)
                assert kwargs["num_warps"] == cfg.row1_down_warps
            else:
                assert name == "_moe_down_kernel"


def test_config_fields_checked() -> None:
    """The new fields are checked like the others: a flag is a bool, tiles and warps powers of two, at most 32 warps."""
    with pytest.raises(ValueError, match="row1_down_loop"):
        MoEKernelConfig(row1_down_loop=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="row1_down_block_n=12"):
        MoEKernelConfig(row1_down_block_n=12)
    with pytest.raises(ValueError, match="row1_down_block_i=768"):
        MoEKernelConfig(row1_down_block_i=768)
    with pytest.raises(ValueError, match="row1_down_warps=64"):
        MoEKernelConfig(row1_down_warps=64)


@pytest.mark.parametrize("block_i", [16, 64])
def test_unchosen_experts_never_read(block_i: int) -> None:
    """NaN in every expert the row did not choose leaves the output unchanged: no weight load strays past a chosen
    expert's rows. I = 24 is no power of two, so 16-wide chunks end in a padded one and 64 is capped at a 32-wide
    padded chunk; unmasked, a last row would read the next expert's first."""
    norm_w, gate_w, w13, w2 = make_weights(torch.float32, seed=29, i=24)
    x, residual = make_x(1, torch.float32, seed=30)
    cfg = dataclasses.replace(LOOP, row1_down_block_i=block_i)
    want, ids, _ = reference(x, residual, norm_w, gate_w, w13, w2, True)
    unchosen = [e for e in range(E) if e not in ids.flatten().tolist()]
    w2 = w2.clone()
    w2[unchosen] = float("nan")
    out, _ = run(x, residual, norm_w, gate_w, w13, w2, True, cfg=cfg)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
