"""RMSNorm of 1 to 8 rows into a buffer, for GEMMs that then stream it as a plain operand ("prenorm").

    h[t, k] = (w[k] * (x[t, k] * rsqrt(mean(x[t, :]^2) + eps)).to(dtype)).to(dtype)       (HF order)

The fused kernels (``qkv_rope``, the gate/up small GEMM) normalize their input inside the K loop: every program
recomputes the rows' statistics, then rounds and scales each activation chunk before its ``tl.dot``. At 2-8 rows
that costs: on the H200 the two kernels with that prologue ran 3.6 µs slower than ``F.linear`` alone at
llama-3.2-1b's 8-row shapes, while the two without it (o_proj, down) ran faster than ``F.linear``
(bench/results/2026-12-02-h200-mega-qkv-row1, call 3). With prenorm (``MegaForward``, ``LOWLAT_MEGA_PRENORM=1``)
this kernel writes ``h`` once, and the GEMM reads it with its norm off; the price is one more launch in the PDL
chain. Where it pays is measured per shape: ``tuned_plans.TUNED_PRENORM`` (docs/kernels.md, "Prenorm").

Grid ``(cdiv(K, BLOCK_K),)``: each program computes the statistics of all rows (the same ``row_rstd`` and
``load_rows`` arithmetic as the fused prologue, so ``h`` holds the values the fused kernels multiply) and writes
its ``BLOCK_K`` columns. PDL: nothing is read before ``gdc_wait`` (x is the previous kernel's output); the
dependent GEMM may start at once and fetch its weights before its own wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowlat_nvidia_mega.kernels.gemm_plans import MAX_ROWS
from lowlat_nvidia_mega.kernels.pdl import env_switch, gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled
from lowlat_nvidia_mega.kernels.small_gemm import load_rows, row_rstd

ROWS = tl.constexpr(MAX_ROWS)  # rows of the statistics tile (T <= 8, masked)


@triton.jit
def _norm_rows_kernel(x_ptr, stride_xm, nw_ptr, h_ptr, stride_hm, T, eps, K: tl.constexpr,
                      RSTD_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < T
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = ks < K
    gdc_launch_dependents(USE_PDL)
    gdc_wait(USE_PDL)
    rstd = row_rstd(x_ptr, stride_xm, offs_m, m_mask, K, eps, RSTD_BLOCK)
    h = load_rows(x_ptr, stride_xm, offs_m, m_mask, ks, k_mask, rstd, nw_ptr, True)
    tl.store(h_ptr + offs_m[:, None] * stride_hm + ks[None, :], h, mask=m_mask[:, None] & k_mask[None, :])


def norm_rows(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, out: torch.Tensor, *, block_k: int = 512,
              use_pdl: bool | None = None) -> torch.Tensor:
    """``out = rmsnorm(x) * norm_weight`` in HF's order and rounding (one launch).

    Args:
        x: [T, K] (T in 1..8), unit stride along K; bf16, fp16 or fp32.
        norm_weight: [K] contiguous, x's dtype and device.
        eps: RMSNorm epsilon.
        out: [T, K] in x's dtype, unit stride along K, not overlapping x.
        block_k: columns per program, a power of two >= 16.
        use_pdl: launch with PDL; default ``pdl_enabled(x.device)``.

    Returns:
        ``out``.

    Raises:
        ValueError: on a shape, stride, dtype or device mismatch, T outside 1..8, or a bad ``block_k``.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with unit stride along K, got shape {tuple(x.shape)} strides {x.stride()}")
    t, k = x.shape
    if not 1 <= t <= MAX_ROWS:
        raise ValueError(f"norm_rows serves 1..{MAX_ROWS} rows, got {t}")
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be a contiguous [{k}] tensor, got {tuple(norm_weight.shape)}")
    if out.shape != x.shape or out.stride(1) != 1:
        raise ValueError(f"out must be [{t}, {k}] with unit stride along K, got {tuple(out.shape)}")
    for name, tns in (("norm_weight", norm_weight), ("out", out)):
        if tns.dtype != x.dtype or tns.device != x.device:
            raise ValueError(f"{name} is {tns.dtype} on {tns.device}; x is {x.dtype} on {x.device}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"norm_rows runs bfloat16, float16 or float32 rows, got {x.dtype}")
    if t > 1 and out.stride(0) < k:
        raise ValueError(f"the rows of out overlap (row stride {out.stride(0)} < K={k}): each row needs its own K "
                         "elements")
    (x0, x1), (o0, o1) = _span(x), _span(out)
    if k > 0 and o0 < x1 and x0 < o1:
        raise ValueError("out overlaps x: every program reads all of x, so out must be a separate buffer")
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    use_pdl = pdl_enabled(x.device) if use_pdl is None else use_pdl
    _norm_rows_kernel[(triton.cdiv(k, block_k),)](
        x, x.stride(0), norm_weight, out, out.stride(0), t, float(eps), K=k,
        RSTD_BLOCK=min(triton.next_power_of_2(k), 512), BLOCK_K=block_k, USE_PDL=use_pdl, num_warps=4,
        **launch_kwargs(use_pdl))
    return out


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, end) byte addresses of a [T, K] view with unit stride along K (its row stride may exceed K)."""
    start = t.data_ptr()
    return start, start + ((t.shape[0] - 1) * t.stride(0) + t.shape[1]) * t.element_size()


PRENORM_ENV = "LOWLAT_MEGA_PRENORM"


def prenorm_step(rows: int, max_rows: int) -> bool:
    """Whether a step of ``rows`` rows normalizes its GEMM inputs with ``norm_rows`` first (the GEMMs then have no
    norm prologue): 2-8 rows and ``LOWLAT_MEGA_PRENORM=1``, or, with the variable unset, at most ``max_rows``
    (``tuned_plans.prenorm_rows``: the measured rule); a one-row step never does (its one-row kernels normalize
    without padding). ``MegaForward`` and ``tune_plans.py`` both decide by it.

    Raises:
        ValueError: a bad ``LOWLAT_MEGA_PRENORM`` value (``prenorm_switch``).
    """
    on = prenorm_switch()
    return rows > 1 and (rows <= max_rows if on is None else on)


def prenorm_switch() -> bool | None:
    """``LOWLAT_MEGA_PRENORM``, read now: True (1: every 2-8-row step normalizes its GEMM inputs with ``norm_rows``
    first), False (0: none does), None (unset, empty or "default": the measured rule, ``tuned_plans.prenorm_rows``).
    Read at each step, so a benchmark can flip it between CUDA graphs.

    Raises:
        ValueError: the variable holds anything but an on/off word (a typo would otherwise measure the wrong variant).
    """
    try:
        return env_switch(PRENORM_ENV, None, "normalize 2-8-row GEMM inputs in their own kernel")
    except ValueError as e:  # name the third state too: a user after the default should unset it
        raise ValueError(f"{e}, or unset it (or 'default') for the measured rule (tuned_plans.TUNED_PRENORM)") \
            from None
