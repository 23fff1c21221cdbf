"""moe_forward against a torch reference (HF Qwen3-MoE order of operations), under TRITON_INTERPRET=1 on CPU.

Tiny shapes: H 64, I 32, E 8, top-k 2; rows 1, 3, 8. Outputs and workspaces are poisoned (NaN / garbage) first.
``SHAPES`` adds odd sizes and tiles (H, I <= 160, E <= 16, top-k 1..E, I walked in partial chunks) with NaN-tailed
weights. ``test_nan_row_propagates_and_out_is_written`` fails on the current routing (NaN rows are dropped).
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
import torch.nn.functional as F
import triton

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from lowlat_nvidia_mega.kernels.moe import MoEKernelConfig, MoEWorkspace, moe_forward  # noqa: E402

H, I, E, K = 64, 32, 8, 2  # noqa: E741 (I: the MoE intermediate size)
EPS = 1e-6
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"
# Small tiles keep the interpreter fast but still give 2 programs per slot in the down kernel (2 H tiles).
# row1=False: the tl.dot forms at every row count (the one-row forms have their own config below).
CFG = MoEKernelConfig(gate_up_block_n=32, gate_up_block_k=64, down_block_n=32, route_programs=2, row1=False)


def poisoned_alloc(shape, *, dtype, device):  # type: ignore[no-untyped-def]
    """Like torch.empty but full of NaN (floats) or a large garbage value (ints)."""
    fill = float("nan") if dtype.is_floating_point else 12345
    return torch.full(shape, fill, dtype=dtype, device=device)


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(x.dtype)


def reference(x, residual, norm_w, gate_w, w13, w2, renormalize, top_k=K):  # type: ignore[no-untyped-def]
    """HF Qwen3MoeSparseMoeBlock semantics, one (row, expert) at a time; float32 sum + residual, rounded once.
    Sizes come from the weights (I from w2), so the same reference serves every shape."""
    inter = w2.shape[2]
    h = rms_norm(x, norm_w) if norm_w is not None else x
    probs = torch.softmax(F.linear(h, gate_w), dim=-1, dtype=torch.float32)
    # torch.topk orders exact ties arbitrarily; the kernels take the lower expert index (a stable descending sort)
    weights, ids = (t[..., :top_k] for t in torch.sort(probs, dim=-1, descending=True, stable=True))
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    y = torch.zeros(x.shape, dtype=torch.float32)
    for r in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[r, j])
            act = F.silu(F.linear(h[r], w13[e, :inter])) * F.linear(h[r], w13[e, inter:])
            y[r] += F.linear(act, w2[e]).float() * weights[r, j].float()
    if residual is not None:
        y += residual.float()
    return y.to(x.dtype), ids, weights


def make_weights(dtype: torch.dtype, seed: int = 0, h: int = H, i: int = I, e: int = E):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    gate_w = (torch.randn(e, h, generator=g) * 0.3).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.15).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.15).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(h, generator=g)).to(dtype)
    return norm_w, gate_w, w13, w2


def make_x(rows: int, dtype: torch.dtype, seed: int = 1, h: int = H):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, h, generator=g).to(dtype), torch.randn(rows, h, generator=g).to(dtype)


def dev(t: torch.Tensor | None) -> torch.Tensor | None:
    """Inputs are made (and the torch reference runs) on the CPU; the kernels run on DEV."""
    return None if t is None else t.to(DEV)


# The one-row FMA forms (moe_row1.py, the down kernel's ROW1), with a K chunk that loops (H 64 / 32).
CFG_ROW1 = dataclasses.replace(CFG, row1=True, row1_block_n=8, row1_block_k=32, row1_stages=3)


def run(x, residual, norm_w, gate_w, w13, w2, renormalize, ws=None, cfg=CFG, top_k=K):  # type: ignore[no-untyped-def]
    """moe_forward on DEV (sizes from the weights); returns the output on the CPU and the (DEV) workspace."""
    e, hidden, inter = w2.shape
    ws = ws or MoEWorkspace.allocate(8, hidden, inter, e, top_k, x.dtype, DEV, alloc=poisoned_alloc)
    out = torch.full_like(dev(x), float("nan"))
    moe_forward(dev(x), dev(residual), dev(norm_w), EPS, dev(gate_w), dev(w13), dev(w2), top_k, renormalize, out,
                ws, pdl=False, config=cfg)
    return out.cpu(), ws


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.0625, "rtol": 0.02}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_matches_reference(dtype: torch.dtype, rows: int) -> None:
    norm_w, gate_w, w13, w2 = make_weights(dtype)
    x, residual = make_x(rows, dtype)
    out, ws = run(x, residual, norm_w, gate_w, w13, w2, True)
    want, ids, weights = reference(x, residual, norm_w, gate_w, w13, w2, True)
    assert torch.equal(ws.topk_ids[:rows].long().cpu(), ids)
    w_tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: at most one rounding step apart
    torch.testing.assert_close(ws.topk_weights[:rows].cpu(), weights.float(), atol=w_tol, rtol=w_tol)
    torch.testing.assert_close(out.float(), want.float(), **tol(dtype))
    check_routing_metadata(ws, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_row1_forms_match(dtype: torch.dtype, rows: int) -> None:
    """The one-row FMA forms (``row1``) at one row match the reference and the tl.dot forms (bf16 products are
    exact in fp32: only the summation order differs); at 3 rows they do not apply, so the output is
    bit-identical. The production default is on."""
    assert MoEKernelConfig().row1
    norm_w, gate_w, w13, w2 = make_weights(dtype, seed=3)
    x, residual = make_x(rows, dtype, seed=4)
    out, ws = run(x, residual, norm_w, gate_w, w13, w2, True, cfg=CFG_ROW1)
    base, _ = run(x, residual, norm_w, gate_w, w13, w2, True)
    want, ids, _ = reference(x, residual, norm_w, gate_w, w13, w2, True)
    assert torch.equal(ws.topk_ids[:rows].long().cpu(), ids)
    torch.testing.assert_close(out.float(), want.float(), **tol(dtype))
    if rows > 1:
        assert torch.equal(out, base)
    else:
        torch.testing.assert_close(out.float(), base.float(), atol=0.0 if dtype == torch.float32 else 0.0625,
                                   rtol=1e-5 if dtype == torch.float32 else 0.02)
    check_routing_metadata(ws, rows)


# (rows, config): the one-row forms at one row only; at 3 and 8 rows CFG_ROW1 launches what CFG launches, argument
# for argument (row1 serves one row), so those cases would repeat the tl.dot ones
DOWN_I_CASES = [(1, CFG), (1, CFG_ROW1), (3, CFG), (8, CFG)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cfg", DOWN_I_CASES,
                         ids=[f"{r}-{'row1' if c.row1 else 'tl.dot'}" for r, c in DOWN_I_CASES])
def test_down_in_i_chunks_matches(rows: int, cfg: MoEKernelConfig, dtype: torch.dtype) -> None:
    """down_block_i < I (here 16 of 32: two chunks, the second one inside the K loop) gives the one-chunk result
    up to the fp32 summation order, in both forms."""
    norm_w, gate_w, w13, w2 = make_weights(dtype, seed=12)
    x, residual = make_x(rows, dtype, seed=13)
    base, _ = run(x, residual, norm_w, gate_w, w13, w2, True, cfg=cfg)
    out, _ = run(x, residual, norm_w, gate_w, w13, w2, True, cfg=dataclasses.replace(cfg, down_block_i=16))
    want, _, _ = reference(x, residual, norm_w, gate_w, w13, w2, True)
    torch.testing.assert_close(out.float(), want.float(), **tol(dtype))
    torch.testing.assert_close(out.float(), base.float(), atol=1e-5 if dtype == torch.float32 else 0.0625,
                               rtol=1e-5 if dtype == torch.float32 else 0.02)


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_stages_launch_the_configured_forms(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which kernels and constants MoEStages launches: the routing's selection over next_pow2(T) rows; the one-row
    gate/up and the down kernel's ROW1 exactly at one row with ``row1``; the down kernel's I chunk from
    ``down_block_i`` (capped at I rounded up to a power of two)."""
    from lowlat_nvidia_mega.kernels import moe
    from sm90_launch import LaunchRecorder

    log: list = []
    for name in ("moe_route_kernel", "_moe_gate_up_kernel", "_moe_gate_up_row1_kernel", "_moe_down_kernel"):
        monkeypatch.setattr(moe, name, LaunchRecorder(name, log))
    norm_w, gate_w, w13, w2 = make_weights(torch.float32)
    x, residual = make_x(rows, torch.float32)
    scan = dataclasses.replace(CFG_ROW1, route_gather=False)
    one = dataclasses.replace(CFG_ROW1, route_min_rows=1)  # the default is 4
    for cfg, row1 in ((CFG_ROW1, rows == 1), (CFG, False), (scan, rows == 1), (one, rows == 1)):
        for block_i, want_i in ((16, 16), (1024, 32)):
            log.clear()
            ws = MoEWorkspace.allocate(8, H, I, E, K, torch.float32, DEV)
            moe_forward(dev(x), dev(residual), dev(norm_w), EPS, dev(gate_w), dev(w13), dev(w2), K, True,
                        torch.empty_like(dev(x)), ws, pdl=False, config=dataclasses.replace(cfg, down_block_i=block_i))
            names = [n for n, *_ in log]
            assert names == ["moe_route_kernel", "_moe_gate_up_row1_kernel" if row1 else "_moe_gate_up_kernel",
                             "_moe_down_kernel"]
            route, gate_up, down = ({"grid": grid, **kwargs} for _, grid, _, kwargs in log)
            # the routing's last arriver selects over the step's rows rounded up to a power of two (or
            # route_min_rows if more), not all 8
            assert route["SEL_ROWS"] == max(triton.next_power_of_2(rows), cfg.route_min_rows) and route["ROWS_C"] == 8
            assert route["GATHER"] is cfg.route_gather
            slots = min(E, rows * K)
            assert down["ROW1"] is row1 and down["BLOCK_I"] == want_i and down["grid"] == (H // cfg.down_block_n, slots)
            bn = cfg.row1_block_n if row1 else cfg.gate_up_block_n
            assert gate_up["grid"] == (triton.cdiv(I, bn), slots) and gate_up["BLOCK_N"] == bn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_route_gather_matches(dtype: torch.dtype, rows: int) -> None:
    """``route_gather`` (on by default) builds ``row_slot`` with a ``tl.gather`` of the slot table: the routing
    metadata is consistent and the output is bit-identical to the compare-and-sum's (that the launch passes the
    flag: ``test_stages_launch_the_configured_forms``)."""
    assert MoEKernelConfig().route_gather is True
    norm_w, gate_w, w13, w2 = make_weights(dtype, seed=31)
    x, residual = make_x(rows, dtype, seed=32)
    base, _ = run(x, residual, norm_w, gate_w, w13, w2, True, cfg=dataclasses.replace(CFG_ROW1, route_gather=False))
    out, ws = run(x, residual, norm_w, gate_w, w13, w2, True, cfg=dataclasses.replace(CFG_ROW1, route_gather=True))
    assert torch.equal(out, base)
    check_routing_metadata(ws, rows)


# (route_min_rows, rows): each a different selection tile (max(next_pow2(rows), min_rows) rows: 2, 4 or 8) or a
# different step; min_rows 4 at 3 rows is left out, its tile is min_rows 2's at 3 rows (4 rows), launch for launch
MIN_ROWS_CASES = [(2, 1), (2, 2), (2, 3), (4, 1), (4, 2), (8, 1), (8, 2), (8, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("min_rows,rows", MIN_ROWS_CASES)
def test_route_min_rows_matches(dtype: torch.dtype, rows: int, min_rows: int) -> None:
    """A selection tile of more rows than the step has (``route_min_rows``; rows past T masked) routes the same
    experts with the same weights and slots as the step's own rows (1): the output is bit-identical. 4 by default,
    after its A/B on an H100."""
    assert MoEKernelConfig().route_min_rows == 4
    norm_w, gate_w, w13, w2 = make_weights(dtype, seed=33)
    x, residual = make_x(rows, dtype, seed=34)
    base, ws0 = run(x, residual, norm_w, gate_w, w13, w2, True, cfg=dataclasses.replace(CFG_ROW1, route_min_rows=1))
    cfg = dataclasses.replace(CFG_ROW1, route_min_rows=min_rows)
    out, ws = run(x, residual, norm_w, gate_w, w13, w2, True, cfg=cfg)
    assert torch.equal(out, base) and torch.equal(ws.topk_ids[:rows], ws0.topk_ids[:rows])
    check_routing_metadata(ws, rows)


def check_routing_metadata(ws: MoEWorkspace, rows: int) -> None:
    """Slots, presence bitmap and the (row, k) -> slot map agree with the top-k ids; tickets are reset."""
    ids = ws.topk_ids[:rows].long().cpu()
    experts = sorted(set(ids.flatten().tolist()))
    n = int(ws.num_slots)
    assert n == len(experts)
    assert ws.slot_expert[:n].tolist() == experts  # slots in expert order (prefix population count)
    assert int(ws.bitmap[0]) == sum(1 << e for e in experts)  # E <= 31 in these tests: one word
    for r in range(rows):
        for j in range(ws.top_k):
            s = int(ws.row_slot[r, j])
            assert int(ws.slot_expert[s]) == int(ids[r, j])
            assert float(ws.slot_weight[s, r]) == float(ws.topk_weights[r, j])
    for s in range(n):  # rows that did not pick the slot's expert have weight 0 in its tile
        picked = (ids == int(ws.slot_expert[s])).any(dim=1)
        assert bool((ws.slot_weight[s, :rows].cpu()[~picked] == 0).all())
    assert int(ws.counters.abs().sum()) == 0  # every ticket counter reset for the next launch


def test_experts_with_no_rows_are_skipped() -> None:
    """Only experts 1, 4 and 6 can win (positive h, positive router rows for them, zero rows for the others):
    the other slots of the static grid are padding and must do nothing."""
    norm_w, gate_w, w13, w2 = make_weights(torch.float32)
    g = torch.Generator().manual_seed(11)
    gate_w = torch.zeros_like(gate_w)
    gate_w[[1, 4, 6]] = torch.rand(3, H, generator=g) + 0.2
    norm_w = norm_w.abs()
    x, residual = make_x(8, torch.float32, seed=5)
    x = x.abs() + 0.1
    ws = MoEWorkspace.allocate(8, H, I, E, K, torch.float32, DEV, alloc=poisoned_alloc)
    for renormalize in (True, False):  # two launches on one workspace: tickets reset in between
        out, ws = run(x, residual, norm_w, gate_w, w13, w2, renormalize, ws)
        want, ids, _ = reference(x, residual, norm_w, gate_w, w13, w2, renormalize)
        assert set(ids.flatten().tolist()) <= {1, 4, 6}
        assert int(ws.num_slots) == len(set(ids.flatten().tolist())) < min(E, 8 * K)
        torch.testing.assert_close(out, want, **tol(torch.float32))
        check_routing_metadata(ws, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_renormalize_no_norm_no_residual(dtype: torch.dtype) -> None:
    _, gate_w, w13, w2 = make_weights(dtype)
    x, _ = make_x(3, dtype, seed=7)
    out, _ = run(x, None, None, gate_w, w13, w2, False)
    want, _, _ = reference(x, None, None, gate_w, w13, w2, False)
    torch.testing.assert_close(out.float(), want.float(), **tol(dtype))


def test_in_place_residual() -> None:
    """out may be the residual tensor itself (the residual stream updated in place)."""
    norm_w, gate_w, w13, w2 = make_weights(torch.bfloat16)
    x, residual = make_x(3, torch.bfloat16, seed=9)
    want, _, _ = reference(x, residual, norm_w, gate_w, w13, w2, True)
    ws = MoEWorkspace.allocate(4, H, I, E, K, torch.bfloat16, DEV)
    stream = dev(residual.clone())
    moe_forward(dev(x), stream, dev(norm_w), EPS, dev(gate_w), dev(w13), dev(w2), K, True, stream, ws, pdl=False,
                config=CFG)
    torch.testing.assert_close(stream.float().cpu(), want.float(), **tol(torch.bfloat16))


def test_bad_inputs_raise_clear_errors() -> None:
    norm_w, gate_w, w13, w2 = (dev(t) for t in make_weights(torch.float32))
    x, residual = (dev(t) for t in make_x(3, torch.float32))
    ws = MoEWorkspace.allocate(2, H, I, E, K, torch.float32, DEV)
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match="rows"):
        moe_forward(x, residual, norm_w, EPS, gate_w, w13, w2, K, True, out, ws, pdl=False)
    ws = MoEWorkspace.allocate(8, H, I, E, K, torch.float32, DEV)
    with pytest.raises(ValueError, match="w13"):
        moe_forward(x, residual, norm_w, EPS, gate_w, w13[:, :I], w2, K, True, out, ws, pdl=False)
    with pytest.raises(ValueError, match="top_k"):
        moe_forward(x, residual, norm_w, EPS, gate_w, w13, w2, 3, True, out, ws, pdl=False)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="pdl"):
            moe_forward(x, residual, norm_w, EPS, gate_w, w13, w2, K, True, out, ws, pdl=True)
    with pytest.raises(ValueError, match="max_rows"):
        MoEWorkspace.allocate(9, H, I, E, K, torch.float32, DEV)
    with pytest.raises(ValueError, match="power of two"):
        MoEKernelConfig(down_block_n=24)
    with pytest.raises(ValueError, match="power of two"):
        MoEKernelConfig(row1_block_k=768)
    with pytest.raises(ValueError, match="row1_stages=0 must be in 1..8"):
        MoEKernelConfig(row1_stages=0)
    with pytest.raises(ValueError, match="gate_up_stages=9 must be in 1..8"):
        MoEKernelConfig(gate_up_stages=9)
    with pytest.raises(ValueError, match="route_programs=4097 must be in 1..4096"):
        MoEKernelConfig(route_programs=4097)
    assert MoEKernelConfig(gate_up_stages=3, row1_stages=5).gate_up_stages == 3  # stages: any depth 1..8


def test_workspace_counts_its_bytes() -> None:
    ws = MoEWorkspace.allocate(8, H, I, E, K, torch.bfloat16, DEV)
    slots = min(E, 8 * K)
    assert ws.act.shape == (slots, 8, I) and ws.partial.shape == (slots, 8, H)
    assert ws.nbytes >= ws.act.nbytes + ws.partial.nbytes + ws.h.nbytes


def test_config_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LOWLAT_MEGA_MOE_CONFIG`` replaces fields of the engine's MoE config (a launch given none), so a config
    change can be timed in whole steps; a typo, an unknown field, a repeated one, a non-integer or a value the config
    refuses is named rather than measuring the default twice."""
    from lowlat_nvidia_mega.kernels.moe import CONFIG_ENV, default_config

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert default_config() == MoEKernelConfig()
    monkeypatch.setenv(CONFIG_ENV, " down_block_n=32, down_warps = 4 ")
    assert default_config() == dataclasses.replace(MoEKernelConfig(), down_block_n=32, down_warps=4)
    monkeypatch.setenv(CONFIG_ENV, "row1=0")
    assert default_config().row1 is False
    for bad, match in (("row1", "FIELD=INT"), ("row_1=1", "row_1"), ("down_block_n=6", "down_block_n"),
                       ("row1=yes", "1 \\(on\\) or 0"), ("row1=2", "1 \\(on\\) or 0"), ("down_warps=1.5", "integer"),
                       ("row1=1,,down_warps=4", "empty item"), ("row1=1,", "empty item"),
                       ("row1=1,down_warps=8,row1=0", "row1 twice"), ("down_warps=64", "at most 32 warps"),
                       ("row1=true", "1 \\(on\\) or 0"), ("row1=01", "1 \\(on\\) or 0"),
                       ("down_warps=+4", "integer"), ("down_warps=\u0664", "integer")):
        monkeypatch.setenv(CONFIG_ENV, bad)
        with pytest.raises(ValueError, match=CONFIG_ENV) as err:
            default_config()
        assert re.search(match, str(err.value)), (bad, str(err.value))
