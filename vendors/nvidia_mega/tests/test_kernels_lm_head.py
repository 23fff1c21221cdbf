"""lm_head_logits / lm_head_sample against torch references, under TRITON_INTERPRET=1 on CPU (H 64, V 512).

Sampling is checked two ways: token for token against a torch re-implementation of the documented semantics fed
the same Philox noise (drawn by a tiny Triton kernel with ``tl.rand``), and statistically (chi-square with fixed
seeds, so the outcome is deterministic) on a tiny vocabulary.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from lowlat_nvidia_mega.kernels.lm_head import LMHeadConfig, lm_head_logits, lm_head_sample  # noqa: E402
from lowlat_nvidia_mega.kernels.sampling import LMHeadWorkspace  # noqa: E402

H, V = 64, 512
EPS = 1e-6
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"
CFG = LMHeadConfig(block_v=64, block_k=64)
CAND = 8
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # chi-square quantiles at p = 0.999


@triton.jit
def _uniform_kernel(seed_ptr, offset_ptr, out_ptr, V, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = tl.rand(tl.load(seed_ptr + r), tl.load(offset_ptr + r) + offs.to(tl.int64))
    tl.store(out_ptr + r * V + offs, u, mask=offs < V)


def uniforms(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """[T, vocab] float32: the u the kernel draws for each (row, token)."""
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    _uniform_kernel[(seeds.shape[0], triton.cdiv(vocab, 256))](seeds, offsets, out, vocab, BLOCK=256)
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(x.dtype)


def make(rows: int, dtype: torch.dtype, vocab: int = V, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=g).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(H, generator=g)).to(dtype)
    w = (torch.randn(vocab, H, generator=g) * 0.3).to(dtype)
    return x.to(DEV), norm_w.to(DEV), w.to(DEV)


def reference_logits(x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``lowlat.layers.logits``: F.linear in the model dtype, then float32."""
    return F.linear(rms_norm(x, norm_w), w).float()


def reference_tokens(logits, temp, top_k, top_p, u, cand):  # type: ignore[no-untyped-def]
    """The semantics documented in ``sampling.py``, in torch, given the kernel's uniforms ``u``."""
    out = []
    vocab = logits.shape[1]
    for r in range(logits.shape[0]):
        lg, t, k, p = logits[r], float(temp[r]), int(top_k[r]), float(top_p[r])
        if t <= 0:
            out.append(int(torch.argmax(lg)))
            continue
        score = lg / t - torch.log(-torch.log(u[r]))
        k_on = 0 < k < vocab
        if not (k_on or p < 1.0):
            out.append(int(torch.argmax(score)))
            continue
        order = torch.argsort(-lg, stable=True)[:cand]  # by logit, ties by lower index
        # top-k keeps every candidate tied with the k-th logit (core's ``sub >= kth``)
        ids = order[lg[order] >= lg[order[min(k, cand) - 1]]] if k_on else order
        e = torch.exp((lg[ids] - lg[ids[0]]) / t)
        z = e.sum() if k_on and k <= cand else torch.exp((lg - lg[ids[0]]) / t).sum()
        keep = ids[((torch.cumsum(e, 0) - e) < p * z) | (p >= 1.0)]
        out.append(int(keep[torch.argmax(score[keep])]))
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize(("dtype", "rows"), [(torch.float32, 3), (torch.bfloat16, 1), (torch.bfloat16, 8)])
def test_logits_match_reference(dtype: torch.dtype, rows: int) -> None:
    x, norm_w, w = make(rows, dtype)
    out = torch.full((rows, V), float("nan"), device=DEV)
    lm_head_logits(x, norm_w, w, EPS, out, pdl=False, config=CFG)
    want = reference_logits(x, norm_w, w)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.0, "rtol": 8e-3}  # 1 bf16 step
    torch.testing.assert_close(out, want, **tol)


@pytest.mark.parametrize(("dtype", "rows"), [(torch.float32, 2), (torch.bfloat16, 8)])
def test_greedy_matches_torch_argmax(dtype: torch.dtype, rows: int) -> None:
    x, norm_w, w = make(rows, dtype, seed=1)
    ws = LMHeadWorkspace.allocate(8, V, DEV, block_v=64, candidates=CAND, fan_in=4)
    tokens = torch.full((rows,), -1, dtype=torch.int64, device=DEV)
    logits = torch.full((rows, V), float("nan"), device=DEV)
    lm_head_sample(x, norm_w, w, EPS, None, None, None, None, None, tokens, ws, pdl=False, out_logits=logits)
    torch.testing.assert_close(logits, reference_logits(x, norm_w, w), atol=1e-4, rtol=8e-3)
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))
    assert int(ws.counters.abs().sum()) == 0


def test_argmax_ties_pick_the_lowest_index() -> None:
    """Equal maximal logits within a tile (7, 9) and across tiles (300, 450): torch.argmax's choice, 7; also on
    the filtering path, where temperature 0 rows are greedy."""
    x, norm_w, w = make(3, torch.bfloat16, seed=2)
    best = int(torch.argmax(reference_logits(x, norm_w, w)[0]))
    for tok in (450, 300, 9, 7):
        w[tok] = w[best] * 1.5
    ws = LMHeadWorkspace.allocate(8, V, DEV, block_v=64, candidates=CAND, fan_in=2)
    zeros = torch.zeros(3, device=DEV)
    for filtering in (False, True):
        tokens = torch.full((3,), -1, dtype=torch.int64, device=DEV)
        logits = torch.empty(3, V, device=DEV)
        top_k = torch.tensor([5, 0, 2], dtype=torch.int32, device=DEV) if filtering else None
        top_p = torch.tensor([0.9, 0.5, 1.0], device=DEV) if filtering else None
        seeds = torch.arange(3, device=DEV)
        lm_head_sample(x, norm_w, w, EPS, zeros, top_k, top_p, seeds, seeds, tokens, ws, pdl=False,
                       out_logits=logits)
        assert float(logits[0, 7]) == float(logits[0, 450]) == float(logits[0].max())
        assert int(tokens[0]) == 7
        assert torch.equal(tokens, torch.argmax(logits, dim=-1))


@pytest.mark.parametrize(("vocab", "seed", "rows"), [(V, 3, slice(0, 8)), (320, 4, slice(0, 8)), (V, 5, slice(4, 5))])
def test_sampling_matches_reference_with_same_noise(vocab: int, seed: int, rows: slice) -> None:
    """Greedy, pure temperature, top-k, top-p (a nucleus larger than the candidate list too), both, top-k above
    the candidate count. Temperatures are high enough that the noise decides most rows. 320 = 5 tiles (a partial
    group in the fan-in-4 merge tree); the last case runs one row (top-k 4 + top-p 0.6)."""
    temp = torch.tensor([0.0, 3.0, 2.0, 1.0, 1.5, 2.0, 2.5, 1.2], device=DEV)[rows]
    top_k = torch.tensor([0, 0, 5, 0, 4, 8, 100, 0], dtype=torch.int32, device=DEV)[rows]
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.6, 0.8, 1.0, 0.3], device=DEV)[rows]
    t = temp.numel()
    x, norm_w, w = make(t, torch.float32, vocab=vocab, seed=seed)
    seeds = torch.arange(100, 100 + t, device=DEV) * (seed + 1)
    offsets = torch.arange(t, device=DEV) * 7919
    ws = LMHeadWorkspace.allocate(8, vocab, DEV, block_v=64, candidates=CAND, fan_in=4)
    tokens = torch.full((t,), -1, dtype=torch.int64, device=DEV)
    logits = torch.empty(t, vocab, device=DEV)
    lm_head_sample(x, norm_w, w, EPS, temp, top_k, top_p, seeds, offsets, tokens, ws, pdl=False, out_logits=logits)
    want = reference_tokens(logits.cpu(), temp, top_k, top_p, uniforms(seeds, offsets, vocab).cpu(), CAND)
    assert tokens.cpu().tolist() == want.tolist()
    assert int(ws.counters.abs().sum()) == 0


def test_sampled_distribution_chi_square() -> None:
    """Empirical token frequencies match the restricted softmax (chi-square, fixed seeds: deterministic)."""
    vocab, hd = 64, 16
    x = torch.zeros(8, hd, device=DEV)
    x[:, 0] = 1.0
    norm_w = torch.full((hd,), 0.25, device=DEV)  # h = e_0 (RMS of a one-hot is 1/4), so logits = w[:, 0]
    w = torch.full((vocab, hd), 0.0, device=DEV)
    w[:, 0] = -30.0
    w[[0, 1, 2, 3, 40], 0] = torch.tensor([2.0, 1.5, 1.0, 0.0, 1.8], device=DEV)
    temp = torch.tensor([1.0] * 3 + [1.0] * 3 + [0.8] * 2, device=DEV)
    top_k = torch.tensor([4] * 3 + [0] * 3 + [0] * 2, dtype=torch.int32, device=DEV)
    top_p = torch.tensor([1.0] * 3 + [0.6] * 3 + [1.0] * 2, device=DEV)
    groups = {"top-k 4": range(0, 3), "top-p 0.6": range(3, 6), "temperature 0.8": range(6, 8)}
    ws = LMHeadWorkspace.allocate(8, vocab, DEV, block_v=64, candidates=CAND, fan_in=2)
    tokens = torch.empty(8, dtype=torch.int64, device=DEV)
    logits = torch.empty(8, vocab, device=DEV)
    draws = []
    seeds = torch.arange(8, device=DEV) + 1234
    for step in range(30):
        offsets = torch.full((8,), step * vocab, dtype=torch.int64, device=DEV)
        lm_head_sample(x, norm_w, w, EPS, temp, top_k, top_p, seeds, offsets, tokens, ws, pdl=False,
                       out_logits=logits)
        draws.append(tokens.cpu().clone())
    samples = torch.stack(draws)  # [steps, 8]
    lg = logits[0].cpu().double()
    for name, rows in groups.items():
        r = rows[0]
        t, k, p = float(temp[r]), int(top_k[r]), float(top_p[r])
        probs = torch.softmax(lg / t, 0)
        order = torch.argsort(-lg, stable=True)
        allowed = order[:k] if k > 0 else order
        if p < 1.0:
            q = probs[allowed] / probs[allowed].sum()
            allowed = allowed[(torch.cumsum(q, 0) - q) < p]
        expect = torch.zeros(vocab, dtype=torch.float64)
        expect[allowed] = probs[allowed] / probs[allowed].sum()
        got = samples[:, list(rows)].flatten()
        n = got.numel()
        assert bool((expect[got] > 0).all()), f"{name}: drew a token outside the allowed set"
        counts = torch.bincount(got, minlength=vocab).double()
        big = expect * n >= 5
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([expect[big] * n, (expect[~big] * n).sum()[None]])
        keep = exp > 0
        chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        df = int(keep.sum()) - 1
        assert 1 <= df <= 5 and chi2 < CHI2_999[df], f"{name}: chi-square {chi2:.1f} with {df} degrees of freedom"


def _one_hot_head(values: dict[int, float], vocab: int = 64, hd: int = 16):  # type: ignore[no-untyped-def]
    """(x, norm_w, w) whose logits are ``values`` at those tokens and -30 elsewhere, for all 8 rows."""
    x = torch.zeros(8, hd, device=DEV)
    x[:, 0] = 1.0
    norm_w = torch.full((hd,), 0.25, device=DEV)  # h = e_0 (RMS of a one-hot is 1/4), so logits = w[:, 0]
    w = torch.zeros(vocab, hd, device=DEV)
    w[:, 0] = -30.0
    for tok, v in values.items():
        w[tok, 0] = v
    return x, norm_w, w


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    """top_k 3 over logits 2, 1.5, 1, 1, 1 (tokens 0, 9, 20, 33, 50; one per 16-token tile): core keeps all five
    (``sub >= kth``), so tokens 33 and 50 must be drawn too, token for token as the reference with the same noise;
    with top_p 0.25 after top-k 3 (row 7) the nucleus is {0} (its probability is 0.28)."""
    vocab = 64
    x, norm_w, w = _one_hot_head({0: 2.0, 9: 1.5, 20: 1.0, 33: 1.0, 50: 1.0}, vocab)
    ws = LMHeadWorkspace.allocate(8, vocab, DEV, block_v=16, candidates=CAND, fan_in=2)
    temp = torch.full((8,), 2.0, device=DEV)
    top_k = torch.tensor([3] * 7 + [3], dtype=torch.int32, device=DEV)
    top_p = torch.tensor([1.0] * 7 + [0.25], device=DEV)
    tokens = torch.empty(8, dtype=torch.int64, device=DEV)
    logits = torch.empty(8, vocab, device=DEV)
    seen: set[int] = set()
    for step in range(8):
        seeds = torch.arange(8, device=DEV) + 77
        offsets = torch.full((8,), step * vocab, dtype=torch.int64, device=DEV)
        lm_head_sample(x, norm_w, w, EPS, temp, top_k, top_p, seeds, offsets, tokens, ws, pdl=False,
                       out_logits=logits)
        u = uniforms(seeds, offsets, vocab).cpu()
        want = reference_tokens(logits.cpu(), temp.cpu(), top_k.cpu(), top_p.cpu(), u, CAND)
        assert tokens.cpu().tolist() == want.tolist()
        assert int(tokens[7]) == 0, "top-p 0.25 after top-k keeps only the most likely token"
        seen |= set(tokens[:7].tolist())
    assert seen <= {0, 9, 20, 33, 50}, f"drew {sorted(seen)}: outside top-k's set"
    assert {33, 50} & seen, f"drew only {sorted(seen)} in 56 draws: the tokens tied with the k-th were dropped"
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("variant", ["greedy", "sample", "filter"])
def test_nonfinite_rows_get_minus_one(variant: str) -> None:
    """A NaN (row 1) or inf (row 4) in a row's hidden state, or NaN logits of one token (rows 5-7 with token 3's
    weight NaN in the second case), gives id -1 exactly for those rows, in every kernel variant."""
    x, norm_w, w = make(8, torch.bfloat16, seed=9)
    x[1, 5] = float("nan")
    x[4, 2] = float("inf")
    ws = LMHeadWorkspace.allocate(8, V, DEV, block_v=64, candidates=CAND, fan_in=4)
    temp = torch.tensor([0.0, 1.0] * 4, device=DEV) if variant != "greedy" else None
    seeds = torch.arange(8, device=DEV) if temp is not None else None
    top_k = torch.full((8,), 4, dtype=torch.int32, device=DEV) if variant == "filter" else None
    top_p = torch.full((8,), 0.9, device=DEV) if variant == "filter" else None
    for nan_token in (None, 300):
        ww = w.clone()
        if nan_token is not None:
            ww[nan_token, 0] = float("nan")
        tokens = torch.full((8,), 7, dtype=torch.int64, device=DEV)
        logits = torch.empty(8, V, device=DEV)
        lm_head_sample(x, norm_w, ww, EPS, temp, top_k, top_p, seeds, seeds, tokens, ws, pdl=False,
                       out_logits=logits)
        bad = ~torch.isfinite(logits).all(dim=-1)
        assert bad.tolist() == ([True] * 8 if nan_token is not None else [i in (1, 4) for i in range(8)])
        assert ((tokens == -1) == bad).all(), f"ids {tokens.tolist()} for non-finite rows {bad.tolist()}"
        ok = ~bad
        if temp is None:
            assert torch.equal(tokens[ok], torch.argmax(logits, dim=-1)[ok])
        assert int(ws.counters.abs().sum()) == 0


def test_bad_inputs_raise_clear_errors() -> None:
    x, norm_w, w = make(3, torch.float32)
    ws = LMHeadWorkspace.allocate(8, V, DEV, block_v=64, candidates=CAND, fan_in=2)
    tokens = torch.empty(3, dtype=torch.int64, device=DEV)
    temp = torch.ones(3, device=DEV)
    with pytest.raises(ValueError, match="seeds is required"):
        lm_head_sample(x, norm_w, w, EPS, temp, None, None, None, None, tokens, ws, pdl=False)
    with pytest.raises(ValueError, match="both top_k and top_p"):
        lm_head_sample(x, norm_w, w, EPS, temp, torch.zeros(3, dtype=torch.int32), None,
                       torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), tokens, ws, pdl=False)
    with pytest.raises(ValueError, match="vocab"):
        lm_head_sample(x, norm_w, w[:100], EPS, None, None, None, None, None, tokens, ws, pdl=False)
    with pytest.raises(ValueError, match="float32"):
        lm_head_logits(x, norm_w, w, EPS, torch.empty(3, V, dtype=torch.bfloat16), pdl=False)
    with pytest.raises(ValueError, match="rows"):
        lm_head_logits(torch.zeros(9, H), norm_w, w, EPS, torch.empty(9, V), pdl=False)
    with pytest.raises(ValueError, match="candidates"):
        LMHeadWorkspace.allocate(8, V, DEV, block_v=64, candidates=128)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="pdl"):
            lm_head_logits(x, norm_w, w, EPS, torch.empty(3, V), pdl=True)


@pytest.mark.parametrize(("dtype", "rows", "hidden"), [(torch.float32, 3, 64), (torch.bfloat16, 1, 64),
                                                       (torch.bfloat16, 8, 56), (torch.float32, 5, 56)])
def test_prefetch_is_bit_identical(dtype: torch.dtype, rows: int, hidden: int) -> None:
    """Logits and sampled ids with the activation prefetch equal those without, bit for bit: 16-wide K chunks, so
    the loop runs 4 chunks (hidden 56: the last one partial)."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(DEV)
    norm_w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype).to(DEV)
    w = (torch.randn(320, hidden, generator=g) * 0.3).to(dtype).to(DEV)
    cfg = LMHeadConfig(block_v=64, block_k=16)
    ws = LMHeadWorkspace.allocate(8, 320, DEV, block_v=64, candidates=CAND, fan_in=4)
    temp = torch.full((rows,), 1.5, device=DEV)
    top_k = torch.full((rows,), 5, dtype=torch.int32, device=DEV)
    top_p = torch.full((rows,), 0.9, device=DEV)
    seeds = torch.arange(rows, device=DEV) + 5
    got = []
    for prefetch in (False, True):
        logits = torch.full((rows, 320), float("nan"), device=DEV)
        lm_head_logits(x, norm_w, w, EPS, logits, pdl=False, config=cfg, prefetch_act=prefetch)
        tokens = torch.full((rows,), -1, dtype=torch.int64, device=DEV)
        sampled = torch.empty(rows, 320, device=DEV)
        lm_head_sample(x, norm_w, w, EPS, temp, top_k, top_p, seeds, seeds, tokens, ws, pdl=False,
                       out_logits=sampled, config=cfg, prefetch_act=prefetch)
        assert int(ws.counters.abs().sum()) == 0
        got.append((logits, sampled, tokens))
    assert torch.isfinite(got[0][0]).all()
    torch.testing.assert_close(got[0][0], reference_logits(x, norm_w, w),
                               **({"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.0,
                                                                                                  "rtol": 8e-3}))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b), "prefetch on and off must give bit-identical logits and ids"


def test_config_refuses_bad_tiles() -> None:
    for field, bad in (("block_v", 96), ("block_k", 24), ("num_warps", 3), ("num_stages", 0), ("block_v", 8),
                       ("block_k", 8), ("min_rows", 3), ("min_rows", 0), ("min_rows", 16), ("num_warps", 64)):
        # a tile side below 16 cannot be a tl.dot operand; min_rows pads to a power of two of the 8 rows served
        with pytest.raises(ValueError, match=f"LMHeadConfig.{field}={bad}"):
            LMHeadConfig(**{field: bad})
    assert LMHeadConfig().num_stages == 3  # stages need not be a power of two


def test_config_refuses_bools_and_other_types() -> None:
    """bool is an int in Python, and numpy / torch integers are not ints: each is named with its type."""
    for field, bad in (("min_rows", True), ("num_warps", True), ("num_stages", True), ("min_rows", "8"),
                       ("block_v", 128.0)):
        with pytest.raises(ValueError, match=f"LMHeadConfig.{field}=.* must be an integer, not"):
            LMHeadConfig(**{field: bad})
    with pytest.raises(ValueError, match="num_stages=9 must be in 1..8"):
        LMHeadConfig(num_stages=9)


def test_config_refuses_non_integer_stages() -> None:
    """num_stages is no longer checked with ``&`` (which raised TypeError on a float): 2.5 must still be refused, at
    the config rather than inside Triton's compile."""
    with pytest.raises(ValueError, match="LMHeadConfig.num_stages=2.5"):
        LMHeadConfig(num_stages=2.5)  # type: ignore[arg-type]


def test_min_rows_default_is_the_eight_row_kernel() -> None:
    """The default pads a 1-4-row launch to 8 rows: measured faster (bench/results/2026-12-07-h100-mega-route)."""
    assert LMHeadConfig().min_rows == 8


@pytest.mark.parametrize(("dtype", "rows"), [(torch.bfloat16, 1), (torch.float32, 1), (torch.bfloat16, 3)])
def test_min_rows_pads_without_changing_results(dtype: torch.dtype, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``min_rows=8`` runs T rows as 8 (the padded rows masked): the logits match the reference as closely as at
    ``min_rows=1``, the ids are the argmax, the sampled ids equal the unpadded launch's (same noise), and nothing is
    written for the padded rows."""
    from lowlat_nvidia_mega.kernels import lm_head as lm_head_mod

    real, rows_c = lm_head_mod._lm_head_kernel, []

    class Spy:  # records each launch's ROWS_C, then launches
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
                rows_c.append(kwargs["ROWS_C"])
                return real[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(lm_head_mod, "_lm_head_kernel", Spy())
    x, norm_w, w = make(rows, dtype, seed=7)
    ws = LMHeadWorkspace.allocate(8, V, DEV, block_v=64, candidates=CAND, fan_in=4)
    want = reference_logits(x, norm_w, w)
    temp = torch.full((rows,), 1.2, device=DEV)
    top_k = torch.full((rows,), 6, dtype=torch.int32, device=DEV)
    top_p = torch.full((rows,), 0.9, device=DEV)
    seeds = torch.arange(rows, device=DEV) + 11
    got = []
    for min_rows in (1, 8):
        cfg = LMHeadConfig(block_v=64, block_k=64, min_rows=min_rows)
        big = torch.full((8, V), float("nan"), device=DEV)
        lm_head_logits(x, norm_w, w, EPS, big[:rows], pdl=False, config=cfg)
        assert torch.isnan(big[rows:]).all(), "the padded rows must not be written"
        tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.0, "rtol": 8e-3}
        torch.testing.assert_close(big[:rows], want, **tol)
        greedy = torch.full((rows,), -1, dtype=torch.int64, device=DEV)
        lm_head_sample(x, norm_w, w, EPS, None, None, None, None, None, greedy, ws, pdl=False, config=cfg)
        assert torch.equal(greedy, torch.argmax(big[:rows], dim=-1))
        sampled = torch.full((rows,), -1, dtype=torch.int64, device=DEV)
        lm_head_sample(x, norm_w, w, EPS, temp, top_k, top_p, seeds, seeds, sampled, ws, pdl=False, config=cfg)
        assert int(ws.counters.abs().sum()) == 0 and bool((sampled >= 0).all())
        got.append(sampled)
    assert torch.equal(got[0], got[1])
    padded = 4 if rows == 3 else 1
    assert rows_c == [padded] * 3 + [8] * 3, rows_c


def test_config_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LOWLAT_MEGA_LM_HEAD_CONFIG`` replaces fields of the engine's LM head config; a bad item is named."""
    from lowlat_nvidia_mega.kernels.lm_head import CONFIG_ENV, default_lm_head_config

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert default_lm_head_config() == LMHeadConfig()
    monkeypatch.setenv(CONFIG_ENV, "min_rows=8, num_warps=8")
    assert default_lm_head_config() == LMHeadConfig(min_rows=8, num_warps=8)
    for bad, match in (("min_rows=5", "1, 2, 4 or 8"), ("rows=8", "FIELD=INT with a LMHeadConfig field"),
                       ("min_rows=8,", "empty item"), ("min_rows=8,min_rows=4", "min_rows twice"),
                       ("block_v=x", "decimal integer"), ("min_rows=+8", "decimal integer"),
                       ("min_rows=\u0668", "decimal integer"), ("block_v=1_28", "decimal integer"),
                       ("min_rows=0x8", "decimal integer"), ("block_v=" + "1" * 5000, "more than 18 digits"),
                       ("block_v=4096,block_k=4096", "2**20")):
        monkeypatch.setenv(CONFIG_ENV, bad)
        with pytest.raises(ValueError, match=CONFIG_ENV) as err:
            default_lm_head_config()
        assert match in str(err.value) and len(str(err.value)) < 400, (bad, str(err.value))
