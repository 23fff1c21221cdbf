"""Small-row GEMM: ``out[T, N] = epilogue(prologue(x)[T, K] @ W[N, K]^T)`` for T <= 8 rows.

Decode at 1 to 8 rows is memory bound: the kernel's job is to stream every weight byte exactly once, with
enough programs to fill the GPU. Design (after the split-K GEMV kernels of FlashInfer / vLLM, written for
Triton):

- Rows are padded to ``BLOCK_M = 16`` (the smallest ``tl.dot`` tile); x is tiny and re-read from L2.
- Each program owns ``BLOCK_N`` output columns and a ``K / SPLIT_K`` slice of K, and loads its weight tile
  ``[BLOCK_N, BLOCK_K]`` row-major, contiguous along K (16-byte vector loads).
- Prologue (optional): RMSNorm of the input rows, ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` in HF's order;
  every program computes the row statistics itself from the whole row, so no separate norm kernel runs.
- Epilogues: ``none``; ``silu_mul`` (W holds gate rows then up rows, out = silu(gate) * up, SwiGLU);
  ``residual`` (out = residual + x @ W^T; ``residual`` may be ``out`` itself for an in-place update).
  Intermediates are rounded to the activation dtype where the unfused torch path rounds them.
- Split-K (when N alone gives too few programs): each program stores its fp32 partial to a workspace, then
  takes a ticket from a per-column-tile counter (``atomic_add``, acq_rel). The program that draws the last
  ticket sums all partials *in split order* and runs the epilogue, then resets the counter to 0. The sum order
  never depends on arrival order, so results are bit-identical run to run (unlike float atomics), and no
  second kernel is launched. Nothing spins, so it also runs under the Triton interpreter.
- PDL: the first ``PRE_K`` columns of the weight tile are loaded before ``gdc_wait``; see ``pdl.py`` for the
  rules.
- Activation prefetch (``PREFETCH_ACT``, with a norm only; off by default, ``prefetch_act_enabled``): the K loop
  loads the next raw x chunk and norm-weight chunk one iteration ahead and normalizes the previous one, the same
  arithmetic on the same values, so results are bit-identical to the plain loop.

Shared device helpers (``load_tile``, ``row_rstd``, ``load_rows``, ``load_x_nw``, ``norm_rows``,
``prefetched_rows``, ``dot_acc``) are reused by ``qkv_rope.py`` (``dot_acc`` by the other kernels too); the
rounding helpers ``to_act`` / ``rnd`` live in ``rounding.py``, which every kernel imports directly. The launch
plans and their planners (``GemmPlan``, ``plan_gemm``, ``splitk_workspace_numel``) are in ``gemm_plans.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowlat_nvidia_mega.kernels.gemm_plans import MAX_ROWS, GemmPlan, splitk_workspace_numel
from lowlat_nvidia_mega.kernels.mem_overlap import overlaps
from lowlat_nvidia_mega.kernels.pdl import (
    env_switch,
    gdc_launch_dependents,
    gdc_wait,
    interpreting,
    launch_kwargs,
    pdl_enabled,
)
from lowlat_nvidia_mega.kernels.rounding import rnd, to_act
from lowlat_nvidia_mega.kernels.tp_epilogue import PeerTarget, check_publish, peer_launch_args, publish_epilogue

BLOCK_M = 16
EPILOGUES = {"none": 0, "silu_mul": 1, "residual": 2, "publish": 3}  # 3: tp_epilogue.py
# Activation prefetch in the K loops that RMS-normalize their input (small GEMM with a norm, qkv_rope, LM head):
# load the next raw x chunk and norm-weight chunk one K chunk ahead into registers, so their round trip and the
# norm arithmetic overlap the current chunk's dot (as amd_mono's gemv loops do). Results are bit-identical either
# way. Off by default until measured on the H200 (bench_kernels.py --prefetch); ``LOWLAT_MEGA_PREFETCH_ACT=1``
# turns it on, read at each launch like ``LOWLAT_MEGA_PDL``; a launcher's ``prefetch_act`` argument wins over both.
PREFETCH_ENV = "LOWLAT_MEGA_PREFETCH_ACT"
PREFETCH_ACT_DEFAULT = False
@triton.jit
def dot_acc(a, b, acc, DOT_F32: tl.constexpr):
    """acc += a @ b. ``DOT_F32``: upcast to fp32 and multiply exactly (fp32 models, and the interpreter,
    whose bf16 ``tl.dot`` is wrong in triton 3.9)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def load_tile(ptrs, row_mask, k_mask, EVEN_K: tl.constexpr):
    """A [rows, BLOCK_K] weight tile. With ``EVEN_K`` the K mask is dropped, so the mask is constant along K
    and the loads stay 16-byte vectors."""
    if EVEN_K:
        return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        return tl.load(ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def row_rstd(x_ptr, stride_xm, offs_m, m_mask, K: tl.constexpr, eps, BLOCK: tl.constexpr):
    """[BLOCK_M] fp32 ``rsqrt(mean(x^2) + eps)`` over the first K columns of each row.

    The loop is unrolled (K is a constexpr), so all loads are in flight at once: this runs right after
    ``gdc_wait``, on the critical path, and a rolled loop would pay one L2 round trip per chunk."""
    ss = tl.zeros([offs_m.shape[0]], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
                    mask=m_mask[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def load_x(x_ptr, stride_xm, offs_m, m_mask, ks, k_mask):
    """x[rows, ks] as stored (input dtype), zeros outside ``m_mask`` x ``k_mask``."""
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=m_mask[:, None] & k_mask[None, :],
                   other=0.0)


@triton.jit
def norm_rows(x, rstd, nw):
    """HF RMSNorm of a raw chunk ``x[rows, ks]`` with its weight chunk ``nw[ks]``: ``nw * (x * rstd).to(dtype)``."""
    h = rnd(x.to(tl.float32) * rstd[:, None], x.dtype)
    return to_act(nw.to(tl.float32)[None, :] * h, x.dtype)


@triton.jit
def load_rows(x_ptr, stride_xm, offs_m, m_mask, ks, k_mask, rstd, nw_ptr, HAS_NORM: tl.constexpr):
    """x[rows, ks] in the input dtype, RMS-normalized and scaled by ``nw[ks]`` when ``HAS_NORM`` (HF order).

    ``norm_rows`` is the same arithmetic; this keeps its own order of loads so the plain loops compile as before."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    if HAS_NORM:
        h = rnd(x.to(tl.float32) * rstd[:, None], x.dtype)
        nw = tl.load(nw_ptr + ks, mask=k_mask, other=0.0)
        x = to_act(nw.to(tl.float32)[None, :] * h, x.dtype)
    return x


@triton.jit
def load_x_nw(x_ptr, stride_xm, offs_m, m_mask, ks, k_mask, nw_ptr):
    """(raw x[rows, ks], nw[ks]): the operands of ``norm_rows``, loaded one K chunk ahead by the prefetch loops."""
    return load_x(x_ptr, stride_xm, offs_m, m_mask, ks, k_mask), tl.load(nw_ptr + ks, mask=k_mask, other=0.0)


@triton.jit
def prefetched_rows(x_nx, nw_nx, rstd, x_ptr, stride_xm, offs_m, m_mask, kl, k_end, nw_ptr, BLOCK_K: tl.constexpr):
    """One step of a prefetch loop at chunk ``kl``: request the next chunk's raw x and norm weights, and
    RMS-normalize the chunk loaded one iteration ago (``x_nx``, ``nw_nx``; same values and arithmetic as
    ``load_rows``) while the next one is in flight; past ``k_end`` the mask is empty and nothing is read.
    Returns (normalized rows of this chunk, the next chunk's x, its weights)."""
    kn = kl + BLOCK_K
    x_next, nw_next = load_x_nw(x_ptr, stride_xm, offs_m, m_mask, kn, kn < k_end, nw_ptr)
    return norm_rows(x_nx, rstd, nw_nx), x_next, nw_next


@triton.jit
def _gemm_epilogue(acc, acc_u, offs_m, offs_n, mask, out_ptr, stride_om, res_ptr, stride_rm, EPILOGUE: tl.constexpr):
    dt = out_ptr.dtype.element_ty
    if EPILOGUE == 1:
        g = rnd(acc, dt)
        u = rnd(acc_u, dt)
        s = rnd(g / (1.0 + tl.exp(-g)), dt)
        y = to_act(s * u, dt)
    elif EPILOGUE == 2:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
        y = to_act(rnd(acc, dt) + r.to(tl.float32), dt)
    else:
        y = to_act(acc, dt)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask)


@triton.jit
def _small_gemm_kernel(
    x_ptr, stride_xm, w_ptr, stride_wn, nw_ptr, res_ptr, stride_rm, out_ptr, stride_om, ws_ptr, cnt_ptr,
    T, N, K, K_PER_SPLIT, eps, data_ptrs, flag_ptrs, tag_ptr, rank, cap, cap_tiles, publish,
    NORM_K: tl.constexpr, RSTD_BLOCK: tl.constexpr, PRE_K: tl.constexpr, HAS_NORM: tl.constexpr,
    EPILOGUE: tl.constexpr, NPART: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_ACT: tl.constexpr, WORLD: tl.constexpr,
):
    GATED: tl.constexpr = EPILOGUE == 1
    PREFETCH: tl.constexpr = PREFETCH_ACT and HAS_NORM
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    ks = k_start + tl.arange(0, PRE_K)
    k_mask = ks < k_end
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    # Weights never depend on the previous kernel: fetch the first PRE_K columns before waiting on it.
    w0 = load_tile(w_rows + ks[None, :], n_mask, k_mask, EVEN_K)
    if GATED:
        w0u = load_tile(w_rows + N * stride_wn + ks[None, :], n_mask, k_mask, EVEN_K)
    gdc_launch_dependents(USE_PDL)
    gdc_wait(USE_PDL)

    rstd = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if HAS_NORM:
        rstd = row_rstd(x_ptr, stride_xm, offs_m, m_mask, NORM_K, eps, RSTD_BLOCK)
    xk = load_rows(x_ptr, stride_xm, offs_m, m_mask, ks, k_mask, rstd, nw_ptr, HAS_NORM)
    if PREFETCH:  # the loop's first activation chunk (raw) and norm weights, in flight during the first dot
        kn = k_start + PRE_K + tl.arange(0, BLOCK_K)
        x_nx, nw_nx = load_x_nw(x_ptr, stride_xm, offs_m, m_mask, kn, kn < k_end, nw_ptr)
    acc = dot_acc(xk, tl.trans(w0), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_F32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_u = dot_acc(xk, tl.trans(w0u), acc_u, DOT_F32)
    for k0 in range(k_start + PRE_K, k_end, BLOCK_K):
        kl = k0 + tl.arange(0, BLOCK_K)
        kl_mask = kl < k_end
        w = load_tile(w_rows + kl[None, :], n_mask, kl_mask, EVEN_K)
        if PREFETCH:
            xl, x_nx, nw_nx = prefetched_rows(x_nx, nw_nx, rstd, x_ptr, stride_xm, offs_m, m_mask, kl, k_end, nw_ptr,
                                              BLOCK_K)
        else:
            xl = load_rows(x_ptr, stride_xm, offs_m, m_mask, kl, kl_mask, rstd, nw_ptr, HAS_NORM)
        acc = dot_acc(xl, tl.trans(w), acc, DOT_F32)
        if GATED:
            wu = load_tile(w_rows + N * stride_wn + kl[None, :], n_mask, kl_mask, EVEN_K)
            acc_u = dot_acc(xl, tl.trans(wu), acc_u, DOT_F32)

    o_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if EPILOGUE == 3:
            publish_epilogue(acc, offs_m, offs_n, o_mask, N, out_ptr.dtype.element_ty, data_ptrs, flag_ptrs, tag_ptr,
                             rank, cap, cap_tiles, pid_n, publish, WORLD)
        else:
            _gemm_epilogue(acc, acc_u, offs_m, offs_n, o_mask, out_ptr, stride_om, res_ptr, stride_rm, EPILOGUE)
    else:
        # Partials: ws[split, part, row, col] fp32, part 0 = acc (gate), part 1 = up (NPART = 2 when GATED).
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * (NPART * T * N) + tile, acc, mask=o_mask)
        if GATED:
            tl.store(ws_ptr + pid_k * (NPART * T * N) + T * N + tile, acc_u, mask=o_mask)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            tl.debug_barrier()
            tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            tot_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, SPLIT_K):
                tot += tl.load(ws_ptr + s * (NPART * T * N) + tile, mask=o_mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    tot_u += tl.load(ws_ptr + s * (NPART * T * N) + T * N + tile, mask=o_mask, other=0.0,
                                     cache_modifier=".cg")
            if EPILOGUE == 3:
                publish_epilogue(tot, offs_m, offs_n, o_mask, N, out_ptr.dtype.element_ty, data_ptrs, flag_ptrs,
                                 tag_ptr, rank, cap, cap_tiles, pid_n, publish, WORLD)
            else:
                _gemm_epilogue(tot, tot_u, offs_m, offs_n, o_mask, out_ptr, stride_om, res_ptr, stride_rm, EPILOGUE)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # re-arm for the next launch (graph replays included)


def small_gemm(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, plan: GemmPlan, epilogue: str = "none",
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None, counters: torch.Tensor | None = None, use_pdl: bool | None = None,
    prefetch_act: bool | None = None, peer: PeerTarget | None = None,
) -> torch.Tensor:
    """Launch the small-row GEMM.

    Args:
        x: [T, K] activations (T in 1..8), unit stride along K, dtype = ``w.dtype``.
        w: [N, K] weight (``[2N, K]``, gate rows then up rows, for ``silu_mul``), contiguous.
        out: [T, N] output, unit stride along N, same dtype; may be ``residual``.
        plan: tiles from ``plan_gemm`` for this (N, K).
        epilogue: "none", "silu_mul", "residual" or "publish" (tp_size > 1: each rounded tile goes to every rank's
            peer buffer, ``tp_epilogue``; ``out`` then only gives the shape and is not written).
        norm_weight: [K] RMSNorm weight: normalizes x's rows in the prologue when given.
        eps: RMSNorm epsilon.
        residual: [T, N] added in the "residual" epilogue.
        workspace: fp32 tensor of >= ``splitk_workspace_numel`` elements (split-K only).
        counters: int32 zeros, >= N / BLOCK_N elements (split-K only; left zero after each launch).
        use_pdl: launch with PDL; default ``pdl_enabled(x.device)``.
        prefetch_act: with ``norm_weight``, load each activation chunk one K chunk ahead (bit-identical results);
            default ``prefetch_act_enabled()``. Ignored without a norm.
        peer: the "publish" epilogue's target (``tp_epilogue.PeerTarget``), None for the others.
    Returns:
        ``out``.
    Raises:
        ValueError: on a shape, stride, dtype or device mismatch, naming the argument.
    """
    t, k, n, gated = check_gemm_args(x, w, out, plan=plan, epilogue=epilogue, norm_weight=norm_weight,
                                     residual=residual, workspace=workspace, counters=counters)
    check_publish(peer, epilogue, out, plan.n_tiles(n))
    use_pdl = pdl_enabled(x.device) if use_pdl is None else use_pdl
    prefetch = prefetch_act_enabled() if prefetch_act is None else prefetch_act
    res = residual if residual is not None else out
    dummy = out
    grid = (plan.n_tiles(n), plan.split_k)
    _small_gemm_kernel[grid](
        x, x.stride(0), w, w.stride(0), norm_weight if norm_weight is not None else dummy, res, res.stride(0),
        out, out.stride(0), workspace if workspace is not None else dummy, counters if counters is not None else dummy,
        t, n, k, plan.k_per_split, eps, **peer_launch_args(peer, dummy),
        NORM_K=k if norm_weight is not None else 0, RSTD_BLOCK=min(triton.next_power_of_2(k), 512),
        PRE_K=plan.pre_k, HAS_NORM=norm_weight is not None, EPILOGUE=EPILOGUES[epilogue], NPART=2 if gated else 1,
        SPLIT_K=plan.split_k,
        EVEN_K=(k % plan.block_k == 0 and plan.k_per_split % plan.block_k == 0),
        BLOCK_M=BLOCK_M, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        DOT_F32=dot_in_f32(x.dtype), USE_PDL=use_pdl, PREFETCH_ACT=bool(prefetch) and norm_weight is not None,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **launch_kwargs(use_pdl),
    )
    return out


def check_gemm_args(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, plan: GemmPlan, epilogue: str,
                    norm_weight: torch.Tensor | None, residual: torch.Tensor | None, workspace: torch.Tensor | None,
                    counters: torch.Tensor | None, split_k: bool = True) -> tuple[int, int, int, bool]:
    """The checks of ``small_gemm``'s arguments (shared with ``gemv.gemm``); returns (T, K, N, gated).
    ``split_k=False``: the kernel does not split K (the one-row GEMV), so no workspace or counters are asked for.

    Raises:
        ValueError: on a shape, stride, dtype or device mismatch, naming the argument.
    """
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {sorted(EPILOGUES)}, got {epilogue!r}")
    gated = epilogue == "silu_mul"
    _check_2d("x", x, unit_last=True)
    _check_2d("w", w, unit_last=True)
    _check_2d("out", out, unit_last=True)
    t, k = x.shape
    n = out.shape[1]
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if k < 1 or n < 1:
        raise ValueError(f"small_gemm needs K >= 1 and N >= 1, got x {tuple(x.shape)} and out {tuple(out.shape)}")
    if not 1 <= t <= MAX_ROWS:
        raise ValueError(f"small_gemm serves 1..{MAX_ROWS} rows, got x with {t}; use a general GEMM for more")
    if w.shape != (2 * n if gated else n, k):
        raise ValueError(f"w must be [{2 * n if gated else n}, {k}] for out {tuple(out.shape)} and x "
                         f"{tuple(x.shape)} with epilogue {epilogue!r}, got {tuple(w.shape)}")
    if out.shape[0] != t:
        raise ValueError(f"out has {out.shape[0]} rows, x has {t}")
    for name, tns in (("w", w), ("out", out)):
        if tns.dtype != x.dtype or tns.device != x.device:
            raise ValueError(f"{name} is {tns.dtype} on {tns.device}, x is {x.dtype} on {x.device}; they must match")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.dtype != x.dtype
                                    or not norm_weight.is_contiguous() or norm_weight.device != x.device):
        raise ValueError(f"norm_weight must be a contiguous [{k}] {x.dtype} tensor on {x.device}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype} on {norm_weight.device}")
    if overlaps(out, x) or overlaps(out, w):
        raise ValueError("out shares memory with x or w; the kernels read those while they write out (only residual "
                         "may be out)")
    if epilogue == "residual":
        if residual is None or residual.shape != out.shape or residual.dtype != x.dtype or residual.stride(1) != 1 \
                or residual.device != x.device:
            raise ValueError(f"epilogue 'residual' needs residual [{t}, {n}] {x.dtype} on {x.device} with unit column "
                             "stride")
    elif residual is not None:
        raise ValueError(f"residual given but epilogue is {epilogue!r}; pass epilogue='residual'")
    if split_k and plan.split_k > 1:
        need = splitk_workspace_numel(plan, n, gated=gated, rows=t)
        if workspace is None or workspace.dtype != torch.float32 or workspace.numel() < need:
            raise ValueError(f"split-K={plan.split_k} needs an fp32 workspace of >= {need} elements")
        if counters is None or counters.dtype != torch.int32 or counters.numel() < plan.n_tiles(n):
            raise ValueError(f"split-K={plan.split_k} needs int32 zero counters of >= {plan.n_tiles(n)} elements")
    return t, k, n, gated


def prefetch_act_enabled() -> bool:
    """Whether launches prefetch the activation chunk by default: ``LOWLAT_MEGA_PREFETCH_ACT`` (``pdl.env_switch``),
    else ``PREFETCH_ACT_DEFAULT``. Read at each call, so a benchmark can flip it between graphs.

    Raises:
        ValueError: the variable holds anything but an on/off word (a typo would otherwise measure the wrong variant).
    """
    return env_switch(PREFETCH_ENV, PREFETCH_ACT_DEFAULT, "prefetch the activation chunk")


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Whether ``dot_acc`` must upcast: fp32 operands, or any operands under the interpreter."""
    return dtype == torch.float32 or interpreting()


def _check_2d(name: str, t: torch.Tensor, *, unit_last: bool) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if unit_last and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dim, got strides {t.stride()}; "
                         "pass .contiguous()")
