"""The one-row FMA form of the GEMVs (``kernels/gemv_row1.py``, constexpr ``ROW1``, option ``row1_fma``) on CPU
under the Triton interpreter: its tile functions against a float64 reference with HF's roundings, and whole
one-row steps against the ``tl.dot`` (BM = 16) form and the general path. Run with TRITON_INTERPRET=1."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from lowlat_amd_mono import forward as forward_mod  # noqa: E402
from lowlat_amd_mono.forward import MonoForward  # noqa: E402
from lowlat_amd_mono.kernels import plan as P  # noqa: E402
from lowlat_amd_mono.kernels.gemv_row1 import (  # noqa: E402
    gemv2_rows,
    gemv2_tile,
    gemv_rows,
    gemv_tile,
    rows_rstd,
    w_chunk,
)
from lowlat_amd_mono.kernels.launch import MonoOptions  # noqa: E402
from mono_testutil import (  # noqa: E402
    MAX_CTX,
    bf16_logits_problem,
    clone_pool,
    make_pool,
    make_setup,
    new_requests,
    step_batch,
)


# ----- the tile functions ------------------------------------------------------------------------------------------
@triton.jit
def _tile_probe(x_ptr, w_ptr, w_stride, lnw_ptr, out_ptr, N, k_start, k_end, eps, K: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, NORM: tl.constexpr, FORM: tl.constexpr, ROW1: tl.constexpr, DT: tl.constexpr):
    """Row 0 of one GEMV tile per program into ``out [2, N]`` float32 (row 1: the up tile of a pair). ``FORM``:
    0 ``gemv_tile`` over ``[k_start, k_end)``, 1 ``gemv_rows``, 2 ``gemv2_tile``, 3 ``gemv2_rows`` (pairs: gate
    rows ``[0, N)``, up rows ``[N, 2N)`` of ``w``)."""
    BM: tl.constexpr = 16
    row0 = tl.program_id(0) * BN
    rstd = rows_rstd(x_ptr, K, 1, K, eps, BM, BK, "", ROW1)
    n = row0 + tl.arange(0, BN)
    if FORM == 0:
        w0 = w_chunk(w_ptr, row0, N, w_stride, k_start, K, BN, BK, DT, True, ROW1)
        acc = gemv_tile(w0, x_ptr, K, 1, w_ptr, w_stride, row0, N, k_start, k_end, K, rstd, lnw_ptr, NORM, BM, BN,
                        BK, DT, True, "ieee", "", ROW1)
        up = acc
    elif FORM == 1:
        acc = gemv_rows(x_ptr, K, 1, w_ptr, w_stride, row0, N, K, rstd, lnw_ptr, NORM, BM, BN, BK, DT, True, "ieee",
                        "", ROW1)
        up = acc
    elif FORM == 2:
        wg0 = w_chunk(w_ptr, row0, 2 * N, w_stride, 0, K, BN, BK, DT, True, ROW1)
        wu0 = w_chunk(w_ptr, N + row0, 2 * N, w_stride, 0, K, BN, BK, DT, True, ROW1)
        acc, up = gemv2_tile(wg0, wu0, x_ptr, K, 1, w_ptr, w_stride, row0, N + row0, 2 * N, K, rstd, lnw_ptr, NORM,
                             BM, BN, BK, DT, True, "ieee", "", ROW1)
    else:
        acc, up = gemv2_rows(x_ptr, K, 1, w_ptr, w_stride, row0, N + row0, 2 * N, K, rstd, lnw_ptr, NORM, BM, BN, BK,
                             DT, True, "ieee", "", ROW1)
    r = tl.arange(0, 1 if ROW1 else BM)
    m = (r[:, None] < 1) & (n[None, :] < N)
    tl.store(out_ptr + r[:, None] * 0 + n[None, :], acc, mask=m)
    tl.store(out_ptr + N + r[:, None] * 0 + n[None, :], up, mask=m)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def _reference(x, w, lnw, n, k_start, k_end, eps, norm, pair):
    """float64 of HF's math on bf16 values: ``weight * (x * rstd).to(bf16)``, rounded, then the product."""
    xd = x.double()
    h = xd
    if norm:  # rstd and x * rstd in float32, as the kernels compute them
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).sum() / xf.numel() + eps)
        h = _bf16(lnw.double() * _bf16(xf * rstd))
    sl = slice(k_start, k_end)
    g = w[:n, sl].double() @ h[sl]
    u = w[n:2 * n, sl].double() @ h[sl] if pair else g
    return torch.stack([g, u])


FORMS = [  # (form, norm, k range as chunks of BK: None = all of K)
    (0, True, None), (0, False, None), (0, True, (1, 3)), (1, True, None), (2, True, None), (2, False, None),
    (3, True, None)]


@pytest.mark.parametrize("row1", [True, False], ids=["row1", "bm16"])
@pytest.mark.parametrize("form,norm,krange", FORMS, ids=[f"form{f}-norm{int(n)}-k{r}" for f, n, r in FORMS])
def test_gemv_tiles_match_hf_rounding(form: int, norm: bool, krange, row1: bool) -> None:
    """N = 83 (no BN divides it), K = 200 (no BK divides it); NaN past x's K, past every weight row's K, past
    the N (or 2N) weight rows and past the norm weight's K, so a load outside the masks shows."""
    n, k, bn, bk, eps = 83, 200, 16, 64, 1e-6
    pair = form >= 2
    g = torch.Generator().manual_seed(form * 10 + norm)
    x = torch.full((2, 256), float("nan"), dtype=torch.bfloat16)
    x[0, :k] = (torch.randn(k, generator=g) * 3).to(torch.bfloat16)
    rows = 2 * n if pair else n
    w = torch.full((rows + 16, 256), float("nan"), dtype=torch.bfloat16)
    w[:rows, :k] = (torch.randn(rows, k, generator=g) * 0.1).to(torch.bfloat16)
    lnw = torch.full((256,), float("nan"), dtype=torch.bfloat16)
    lnw[:k] = (1 + torch.randn(k, generator=g) * 0.3).to(torch.bfloat16)
    k_start, k_end = (0, k) if krange is None else (krange[0] * bk, min(k, krange[1] * bk))
    out = torch.zeros(2, n, dtype=torch.float32)
    _tile_probe[(triton.cdiv(n, bn),)](x, w, w.stride(0), lnw, out, n, k_start, k_end, eps, K=k, BN=bn, BK=bk,
                                       NORM=norm, FORM=form, ROW1=row1, DT=tl.bfloat16)
    want = _reference(x[0, :k], w[:rows, :k], lnw[:k], n, k_start, k_end, eps, norm, pair)
    assert not out.isnan().any()
    scale = float(want.abs().max())
    # float32 accumulation of exact bf16 products: a few 1e-7 of the scale; a missed rounding is about 1e-3
    torch.testing.assert_close(out.double(), want, atol=2e-6 * scale, rtol=0)


# ----- whole one-row steps --------------------------------------------------------------------------------------
class _Spy:
    """Stands for a jitted kernel; records the ``ROW1`` of every launch and forwards it."""

    def __init__(self, kernel, seen: list) -> None:
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append(kw.get("ROW1"))
            return self.kernel[grid](*args, **kw)
        return launch


def _mono(s, spy: list, monkeypatch, **opts) -> MonoForward:
    opts.setdefault("row1_fma", True)  # off by default (slower on the H200); these tests are about the one-row form
    persistent = opts.pop("persistent", False)
    if persistent:
        options = MonoOptions(staged=False, deadline_ms=1.0, **opts)
    else:
        options = MonoOptions.resolve(s.device, {f"amd_mono_{k}": v for k, v in opts.items()}, interpret=True)
    fwd = MonoForward(model_config=s.cfg, params=s.binding.params, dtype=s.dtype, device=s.device,
                      alloc_workspace=s.binding.alloc_workspace, max_context_len=MAX_CTX, options=options)
    run = fwd.runner.run

    def record(name, kernel, stage_items, args, meta):
        spy.append((name, meta["ROW1"], meta.get("BK_GU", meta.get("BK"))))
        return run(name, kernel, stage_items, args, meta)

    monkeypatch.setattr(fwd.runner, "run", record)
    return fwd


def _step(s, fwd: MonoForward, prefix: list[int], seed: int = 3):
    pool_ref = make_pool(s)
    rows = new_requests(pool_ref, prefix)
    pool = clone_pool(pool_ref)
    fwd.attach_kv_pool(pool)
    ids = torch.randint(0, s.cfg.vocab_size, (len(prefix),), generator=torch.Generator().manual_seed(seed))
    batch = step_batch(pool_ref, rows, 1, ids)
    step_batch(pool, rows, 1, ids)
    return fwd.forward(batch), s.model(batch, pool_ref), pool


def _small_chunks(fwd: MonoForward, ksplit: int) -> None:
    """Every GEMV in 16-column chunks (the tiny presets' K of 64 or 128 is otherwise one chunk or two) and the QKV
    projection's K cut into ``ksplit`` items per column tile (the tiny presets never split), with the partials and
    flags buffers sized for it."""
    pl = fwd.plan
    bk16 = {f: dataclasses.replace(getattr(pl, f), bk=16) for f in ("o", "gu", "down", "router", "eup", "edown")
            if getattr(pl, f) is not None}
    qkv = dataclasses.replace(pl.qkv, bk=16, ksplit=ksplit, kchunk=fwd.dims.hidden // ksplit)
    fwd.plan = dataclasses.replace(pl, qkv=qkv, head_bk=16, **bk16)
    fwd.qkv_part = torch.zeros(ksplit, P.MAX_ROWS, fwd.dims.qkv_rows)
    fwd.flags = torch.zeros(fwd.dims.layers, P.NUM_STAGES, fwd.plan.max_items, dtype=torch.int32)


# (preset, persistent, options, QKV split-K: > 1 also 16-column chunks, ``_small_chunks``)
STEPS = [("tiny-llama", False, {}, 1), ("tiny-qwen3", False, {}, 1), ("tiny-qwen3-moe", False, {}, 1),
         ("tiny-llama", True, {"one_launch": True}, 1), ("tiny-qwen3-moe", True, {"one_launch": True}, 1),
         ("tiny-qwen3-moe", True, {"one_launch": False}, 1), ("tiny-llama", False, {}, 2),
         ("tiny-qwen3-moe", False, {}, 2)]


@pytest.mark.parametrize("preset,persistent,opts,split", STEPS,
                         ids=[f"{p}-{'persistent' if pe else 'staged'}{'-one' if o.get('one_launch') else ''}"
                              f"{'-bk16-split2' if sp > 1 else ''}" for p, pe, o, sp in STEPS])
def test_one_row_step_runs_row1_and_matches_bm16_and_general_path(preset: str, persistent: bool, opts: dict,
                                                                   split: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch-1 decode step through ROW1 (every launch, the LM head's too, gets ``ROW1=True``) against the same
    step with ``row1_fma`` off (``ROW1=False`` everywhere): in bfloat16 the same bits (the float32 sums differ in
    order only, below a bf16 rounding here), in float32 within accumulation-order noise but not equal (so the other
    form really ran); both against the general path; and a second run is bit-identical."""
    seen: list = []
    head: list = []
    monkeypatch.setattr(forward_mod, "head_kernel", _Spy(forward_mod.head_kernel, head))
    for dtype in (torch.bfloat16, torch.float32):
        s = make_setup(preset, dtype, "cpu", layers=2)
        kw = dict(opts, persistent=persistent) if persistent else dict(opts)
        on, off = _mono(s, seen, monkeypatch, **kw), _mono(s, seen, monkeypatch, row1_fma=False, **kw)
        assert on.row1(1) and not on.row1(2) and not off.row1(1)
        if split > 1:
            _small_chunks(on, split)
            _small_chunks(off, split)
        seen.clear()
        head.clear()
        out1, ref, pool1 = _step(s, on, [13])
        assert seen and all(r is True for _, r, _ in seen) and head == [True], (seen, head)
        again, _, _ = _step(s, on, [13])
        seen.clear()
        head.clear()
        out0, _, pool0 = _step(s, off, [13])
        assert seen and all(r is False for _, r, _ in seen) and head == [False], (seen, head)
        assert torch.equal(out1, again)  # run to run
        if dtype == torch.bfloat16:
            assert torch.equal(out1, out0)
            for layer in range(s.cfg.num_hidden_layers):
                assert torch.equal(pool1.k_buffers[layer], pool0.k_buffers[layer])
                assert torch.equal(pool1.v_buffers[layer], pool0.v_buffers[layer])
            assert bf16_logits_problem(out1, ref, {})[0] is None
        else:
            assert not torch.equal(out1, out0)
            torch.testing.assert_close(out1, out0, atol=2e-5, rtol=0)
            torch.testing.assert_close(out1, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe"])
def test_row1_is_chosen_only_at_one_row(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 2 and 3 rows launch ``ROW1=False`` with ``row1_fma`` on, and still match the general path."""
    seen: list = []
    head: list = []
    monkeypatch.setattr(forward_mod, "head_kernel", _Spy(forward_mod.head_kernel, head))
    s = make_setup(preset, torch.float32, "cpu", layers=1)
    fwd = _mono(s, seen, monkeypatch)
    assert fwd.options.row1_fma
    for prefix in ([9, 30], [4, 17, 2]):
        out, ref, _ = _step(s, fwd, prefix)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    assert seen and all(r is False for _, r, _ in seen) and head == [False, False]


def test_row1_fma_option_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert not MonoOptions.resolve(cpu, interpret=True).row1_fma  # off by default: slower on the H200
    monkeypatch.setenv("LOWLAT_MONO_ROW1_FMA", "1")
    assert MonoOptions.resolve(cpu, interpret=True).row1_fma
    assert not MonoOptions.resolve(cpu, {"amd_mono_row1_fma": "0"}, interpret=True).row1_fma  # extra wins
    monkeypatch.setenv("LOWLAT_MONO_ROW1_FMA", "maybe")  # the error names where the value came from and the words
    with pytest.raises(ValueError, match=r"row1_fma='maybe' from LOWLAT_MONO_ROW1_FMA .*use one of 0, 1, false"):
        MonoOptions.resolve(cpu, interpret=True)


def test_row1_tiles_keep_the_register_budget() -> None:
    """``MonoPlan.for_row1``: the production plans fit 4096 float32 per warp at 4 warps as they are (the same
    tiles); a plan with larger chunks gets narrower ``bk`` at ROW1, never a different tiling or item count."""
    from lowlat.loader.presets import get_preset

    for name in ("llama-3.2-1b", "qwen3-8b", "qwen3-30b-a3b"):
        pl = P.MonoPlan.build(P.Dims.from_config(get_preset(name)), 132)
        assert pl.for_row1(4) == pl
        big = P.MonoPlan.build(pl.dims, 132, bk_max=1024, max_tile_elems=65536)
        r1 = big.for_row1(4)
        for t, t1, pair in ((big.qkv, r1.qkv, 1), (big.o, r1.o, 1), (big.gu, r1.gu, 2), (big.down, r1.down, 1),
                            (big.router, r1.router, 1), (big.eup, r1.eup, 2), (big.edown, r1.edown, 1)):
            if t is None:
                continue
            assert (t1.bn, t1.ksplit, t1.kchunk, t1.n_tiles) == (t.bn, t.ksplit, t.kchunk, t.n_tiles)
            assert t1.bn * t1.bk * pair <= 4096 * 4 and t1.kchunk % t1.bk == 0 and t1.bk >= 16
            assert t1.bk == t.bk or t1.bn * t1.bk * 2 * pair > 4096 * 4  # halved only as far as needed
        assert r1.head_bn * r1.head_bk <= 4096 * 4 and r1.max_items == big.max_items
    assert P.Tile(bn=64, bk=256, ksplit=1, kchunk=2048, n_tiles=4).fit_row1(4096 * 4, 2).bk == 128
