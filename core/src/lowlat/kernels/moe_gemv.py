"""MoE experts for decode-sized steps: two expert-indexed GEMV kernels (gate/up + SiLU-and-mul, then down + sum).

For T tokens routed to k experts each (``ids`` [T, k], ``weights`` [T, k] in the dtype), with the experts'
``w13`` [E, 2I, H] (gate rows, then up rows) and ``w2`` [E, H, I] (``lowlat.layers.moe.FusedExperts``):

    gate_up[p] = x[t] @ w13[e].T                     (rounded to the dtype, as torch._grouped_mm's output)
    act[p]     = silu(gate).to(dtype) * up           (rounded, as ``FusedExperts``)
    y[t]       = sum_j (act[t k + j] @ w2[e_j].T).to(dtype) * weights[t, j]   (each product rounded; the sum
                 over j in float32, rounded once, as torch's bf16 ``sum(dim=1)``)

Pair ``p = t * k + j`` uses expert ``e = ids[t, j]``. This is what ``FusedExperts._forward_grouped`` computes
without the sort, the offsets, the gathers and the un-sort: at decode sizes those are a dozen launches around
two grouped GEMMs whose M is 1-64 rows. Each program streams a [BLOCK_N, H] slab of one expert's weights once
(a GEMV: memory bound); programs of pairs that share an expert run side by side (pairs are the fastest grid
axis), so the second read of a slab is usually an L2 hit.

Design: the decode branch of vLLM's / SGLang's Triton ``fused_moe`` (expert-indexed weight pointers, SiLU fused
after the first GEMM, the router weight applied in the second) reduced to GEMVs; written from the formulas
above, not from their code. Grids depend on shapes only (CUDA-graph capturable); ids are not range-checked
(no host reads). Launched with ``enable_fp_fusion=False`` (torch's roundings in the element-wise tail).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowlat.kernels._launch import check_cpu_launch, interpreting

__all__ = ["moe_experts_gemv", "MAX_PAIRS"]

MAX_PAIRS = 64  # T * k above this: the grouped-GEMM path reads each expert once and wins
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _moe_gate_up_kernel(x_ptr, ids_ptr, w13_ptr, act_ptr, stride_x, stride_we, stride_wn, stride_a,
                        HIDDEN, INTER, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    dtype = act_ptr.dtype.element_ty
    e = tl.load(ids_ptr + p).to(tl.int64)
    x_row = x_ptr + (p // TOP_K) * stride_x
    w = w13_ptr + e * stride_we
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < HIDDEN
        xv = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)
        m = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(w + n[:, None] * stride_wn + kk[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(w + (n[:, None] + INTER) * stride_wn + kk[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
    g = acc_g.to(dtype).to(tl.float32)
    u = acc_u.to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(act_ptr + p * stride_a + n, (s * u).to(dtype), mask=n_ok)


@triton.jit
def _moe_down_kernel(act_ptr, ids_ptr, wts_ptr, w2_ptr, out_ptr, stride_a, stride_we, stride_wn, stride_o,
                     HIDDEN, INTER, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K):
        p = t * TOP_K + j
        e = tl.load(ids_ptr + p).to(tl.int64)
        wt = tl.load(wts_ptr + p).to(tl.float32)
        w = w2_ptr + e * stride_we
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < INTER
            av = tl.load(act_ptr + p * stride_a + kk, mask=k_ok, other=0.0).to(tl.float32)
            wv = tl.load(w + n[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float32)
            acc += tl.sum(wv * av[None, :], axis=1)
        total += (acc.to(dtype).to(tl.float32) * wt).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_o + n, total.to(dtype), mask=n_ok)


def _check(h, w13, w2, weights, ids) -> None:
    if h.dim() != 2 or h.dtype not in _DTYPES:
        raise ValueError(f"h must be a 2-D bf16/fp16/fp32 [T, H] tensor, got {h.dtype} {tuple(h.shape)}")
    t, hidden = h.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, H={hidden}], got {tuple(w13.shape)}")
    e, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (e, hidden, inter):
        raise ValueError(f"w2 must be [E={e}, H={hidden}, I={inter}], got {tuple(w2.shape)}")
    if ids.dim() != 2 or ids.shape[0] != t or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids must be int64/int32 [T={t}, k], got {ids.dtype} {tuple(ids.shape)}")
    if weights.shape != ids.shape or weights.dtype != h.dtype:
        raise ValueError(f"weights must be {h.dtype} {tuple(ids.shape)}, got {weights.dtype} {tuple(weights.shape)}")
    if w13.dtype != h.dtype or w2.dtype != h.dtype:
        raise ValueError(f"w13 and w2 must be {h.dtype}, got {w13.dtype} and {w2.dtype}")
    for name, x in (("h", h), ("w13", w13), ("w2", w2)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if not (ids.is_contiguous() and weights.is_contiguous()):
        raise ValueError("ids and weights must be contiguous")
    if len({x.device for x in (h, w13, w2, weights, ids)}) != 1:
        raise ValueError("h, w13, w2, weights and ids must be on one device")
    if h.device.type == "cpu":
        check_cpu_launch("moe_experts_gemv", _moe_gate_up_kernel)


def moe_experts_gemv(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
    """This rank's partial MoE output for a few tokens (``FusedExperts.forward``'s contract).

    Args:
        h: [T, H] activations (bf16/fp16/fp32), last dim contiguous.
        w13: [E, 2I, H] gate then up rows; w2: [E, H, I]; both h's dtype, last dim contiguous.
        weights: [T, k] router weights in h's dtype; ids: [T, k] int64/int32 expert ids (< E; not checked).
    Returns:
        a new [T, H] tensor in h's dtype (before the TP all-reduce).
    Raises:
        ValueError: bad shapes, dtypes, strides or devices, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _check(h, w13, w2, weights, ids)
    t, hidden = h.shape
    inter, top_k = w13.shape[1] // 2, ids.shape[1]
    out = torch.empty((t, hidden), dtype=h.dtype, device=h.device)
    if t == 0:
        return out
    act = torch.empty((t * top_k, inter), dtype=h.dtype, device=h.device)
    small = interpreting(_moe_gate_up_kernel)
    block_k = 64 if small else 256
    bn1 = 16 if small else 16
    _moe_gate_up_kernel[(t * top_k, triton.cdiv(inter, bn1))](
        h, ids, w13, act, h.stride(0), w13.stride(0), w13.stride(1), act.stride(0), hidden, inter,
        TOP_K=top_k, BLOCK_N=bn1, BLOCK_K=block_k, num_warps=4, enable_fp_fusion=False)
    bn2 = 16
    _moe_down_kernel[(t, triton.cdiv(hidden, bn2))](
        act, ids, weights, w2, out, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), hidden, inter,
        TOP_K=top_k, BLOCK_N=bn2, BLOCK_K=block_k, num_warps=4, enable_fp_fusion=False)
    return out
