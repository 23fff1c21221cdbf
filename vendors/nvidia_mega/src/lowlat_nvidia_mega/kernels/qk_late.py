"""qkv_rope's one-row plans (``check_row1_rows``: a head per program, or the row-pair form), and Qwen3's q/k RMSNorm
and RoPE finished by the attention kernel ("late q/k"), so that qkv_rope can take the row-pair form with q/k norm.

The per-head q/k norm needs a whole head's sum of squares, which a program of qkv_rope's row-pair form (rows ``j``
and ``j + D/2`` of a head, ``check_row1_rows``) does not hold. With late q/k, qkv_rope stores q and k as the
projection left them (rounded to the model dtype; v is final anyway), and the attention's split kernel applies

    q, k = rmsnorm_head(q) * q_norm, rmsnorm_head(k) * k_norm      (over D, HF order)
    q, k = q * cos + rotate_half(q) * sin, ...                      (neox / HF ``rotate_half``)

when it loads q, and to the new position's k row in the program whose KV chunk holds it, which also writes the
finished row back to the KV cache (later steps read it from there). Given a row's sum of squares every step is
elementwise, so a row loaded twice, as it is and with its halves swapped (``rotate_half`` reads column
``(d + D/2) mod D``), gives the same values, in the same roundings, as qkv_rope's own epilogue: cos/sin cast to the
model dtype, each product and the sum rounded, as ``lowlat.layers.rotary`` does in torch. Only at one row per
request (DECODE): ``late_qk`` says when a step runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lowlat_nvidia_mega.kernels.gemm_plans import GemmPlan, GemvPlan
from lowlat_nvidia_mega.kernels.rounding import rnd, to_act


@dataclass(frozen=True)
class LateQK:
    """What the attention kernel needs to finish raw q and k (``paged_decode_attention(..., late=...)``).

    Fields:
        q_norm, k_norm: [D] per-head RMSNorm weights, the model dtype.
        cos, sin: [max_pos, D / 2] fp32 RoPE tables (``qkv_rope.rope_cos_sin``).
        positions: [T] integer positions of the step's rows (row t = request t: one row per request).
        eps: the RMSNorm epsilon.
    """

    q_norm: torch.Tensor
    k_norm: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    eps: float

    def check(self, t: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Raises ValueError on a field ``paged_decode_attention`` cannot use: a shape, dtype, device or layout
        (every tensor contiguous: the kernel indexes them densely), an empty RoPE table, or an eps that is not a
        finite number >= 0. ``device`` may omit its index ("cuda": the current device's)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        for name in ("q_norm", "k_norm", "cos", "sin", "positions"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise ValueError(f"late {name} must be a torch.Tensor, got {type(getattr(self, name)).__name__}")
        for name, w in (("q_norm", self.q_norm), ("k_norm", self.k_norm)):
            if w.shape != (head_dim,) or w.dtype != dtype or w.device != device or not w.is_contiguous():
                raise ValueError(f"late {name} must be a contiguous [{head_dim}] {dtype} tensor on {device}, got "
                                 f"{tuple(w.shape)} {w.dtype} on {w.device} with strides {w.stride()}")
        for name, tab in (("cos", self.cos), ("sin", self.sin)):
            if tab.dim() != 2 or tab.shape[0] < 1 or tab.shape[1] != head_dim // 2 or tab.dtype != torch.float32 \
                    or not tab.is_contiguous() or tab.device != device:
                raise ValueError(f"late {name} must be a contiguous fp32 [max_pos >= 1, {head_dim // 2}] tensor on "
                                 f"{device}, got {tuple(tab.shape)} {tab.dtype} on {tab.device}")
        if self.cos.shape != self.sin.shape:
            raise ValueError("late cos and sin must have the same shape")
        p = self.positions
        if p.shape != (t,) or p.dtype not in (torch.int32, torch.int64) or p.device != device or not p.is_contiguous():
            raise ValueError(f"late positions must be a contiguous int32/int64 [{t}] tensor on {device}, got "
                             f"{tuple(p.shape)} {p.dtype} on {p.device} with strides {p.stride()}")
        if not isinstance(self.eps, (int, float)) or not math.isfinite(self.eps) or self.eps < 0:
            raise ValueError(f"late eps must be a finite number >= 0, got {self.eps!r}")


def check_row1_rows(row1: GemvPlan, head_dim: int, qk_norm: bool, qk_late: bool = False) -> int:
    """Rotary pairs per program of qkv_rope's one-row loop under ``row1``: ``head_dim / 2`` when ``row1.block_n``
    is the head dim (one program per head and K split), else ``row1.block_n / 2`` (the row-pair form: each program
    owns rows ``j`` and ``j + D/2`` of its head for ``block_n / 2`` values of ``j``, all of K, no ticket).

    Raises:
        ValueError: a head_dim that is not a power of two; ``block_n`` neither the head dim nor an even number
            below it; the row-pair form with split-K, or for a model with q/k norm unless ``qk_late`` (the
            per-head norm needs the whole head in one program, so the attention kernel must finish q and k:
            ``late_qk``); ``qk_late`` without q/k norm or without the row-pair form; ``per_sm`` set (the weight
            stream is the GEMV's only).
    """
    if row1.per_sm:
        raise ValueError(f"qkv_rope's one-row loop has no weight-stream form: its plan must have per_sm 0, got "
                         f"{row1.per_sm}")
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"qkv_rope's head_dim must be a power of two, got {head_dim}")
    bn = row1.block_n
    if qk_late and not (qk_norm and 2 <= bn < head_dim):
        raise ValueError(f"qk_late serves a model with q/k norm in the row-pair form (block_n below the head dim "
                         f"{head_dim}); got q/k norm {qk_norm}, block_n {bn}")
    if bn == head_dim:
        return head_dim // 2
    if not 2 <= bn < head_dim:
        raise ValueError(f"qkv_rope's one-row plan has block_n {bn}: the head dim {head_dim} (a head per program) "
                         f"or a power of two in [2, {head_dim}) (row pairs per program)")
    if row1.split_k != 1:
        raise ValueError(f"the row-pair form (block_n {bn} < head dim {head_dim}) reads all of K: split_k must be 1, "
                         f"got {row1.split_k}")
    if qk_norm and not qk_late:
        raise ValueError(f"the row-pair form (block_n {bn} < head dim {head_dim}) serves a model with q/k norm only "
                         "with qk_late=True (the per-head RMSNorm needs the whole head, so the attention kernel "
                         "finishes q and k); else use block_n = head dim")
    return bn // 2


def late_qk(rows: int, plan: GemmPlan, qk_norm: bool) -> bool:
    """Whether a step of ``rows`` rows finishes q and k in the attention: a model with q/k norm whose qkv ``plan``
    (``tuned_plans.qkv_plan``: ``block_n`` the head dim) has a one-row plan of the row-pair form, at one row."""
    return qk_norm and rows == 1 and plan.row1 is not None and plan.row1.block_n < plan.block_n


@triton.jit
def norm_rope_rows(row_ptrs, row_mask, pos, nw_ptr, cos_ptr, sin_ptr, max_pos, eps,
                   D: tl.constexpr, DT: tl.constexpr):
    """[M, D] finished rows: the raw rows at ``row_ptrs[:, None] + d`` (masked by ``row_mask``), RMS-normalized over D,
    scaled by ``nw`` and rotated at positions ``pos`` [M], in the model dtype ``DT`` (see the module docstring)."""
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, D)
    swap = (offs_d + HALF) % D
    x = tl.load(row_ptrs[:, None] + offs_d[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    xs = tl.load(row_ptrs[:, None] + swap[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(nw_ptr + offs_d).to(tl.float32)
    ws = tl.load(nw_ptr + swap).to(tl.float32)
    n = rnd(w[None, :] * rnd(x * r[:, None], DT), DT)
    ns = rnd(ws[None, :] * rnd(xs * r[:, None], DT), DT)
    p = tl.minimum(tl.maximum(pos.to(tl.int64), 0), max_pos - 1)  # memory safety; the engine keeps pos < max_pos
    half = offs_d % HALF
    c = rnd(tl.load(cos_ptr + p[:, None] * HALF + half[None, :]), DT)
    s = rnd(tl.load(sin_ptr + p[:, None] * HALF + half[None, :]), DT)
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    return to_act(rnd(n * c, DT) + rnd(sign[None, :] * ns * s, DT), DT)


def late_args(late: LateQK | None, placeholder: torch.Tensor) -> dict:
    """The split kernel's late-q/k arguments (``placeholder`` stands in for every tensor without ``late``; unread)."""
    if late is None:
        return dict(qn_ptr=placeholder, kn_ptr=placeholder, cos_ptr=placeholder, sin_ptr=placeholder,
                    pos_ptr=placeholder, max_pos=1, eps=0.0)
    return dict(qn_ptr=late.q_norm, kn_ptr=late.k_norm, cos_ptr=late.cos, sin_ptr=late.sin, pos_ptr=late.positions,
                max_pos=late.cos.shape[0], eps=late.eps)

