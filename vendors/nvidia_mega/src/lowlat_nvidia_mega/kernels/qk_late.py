"""Qwen3's q/k RMSNorm and RoPE finished by the attention kernel ("late q/k"), so qkv_rope can take the row-pair form.

The per-head q/k norm needs a whole head's sum of squares, which a program of qkv_rope's row-pair form (rows ``j``
and ``j + D/2`` of a head, ``qkv_rope.check_row1_rows``) does not hold. With late q/k, qkv_rope stores q and k as the
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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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
        """Raises ValueError on a shape, dtype or device that ``paged_decode_attention`` cannot use."""
        for name, w in (("q_norm", self.q_norm), ("k_norm", self.k_norm)):
            if w.shape != (head_dim,) or w.dtype != dtype or w.device != device:
                raise ValueError(f"late {name} must be [{head_dim}] {dtype} on {device}, got {tuple(w.shape)} "
                                 f"{w.dtype} on {w.device}")
        for name, tab in (("cos", self.cos), ("sin", self.sin)):
            if tab.dim() != 2 or tab.shape[1] != head_dim // 2 or tab.dtype != torch.float32 \
                    or not tab.is_contiguous() or tab.device != device:
                raise ValueError(f"late {name} must be contiguous fp32 [max_pos, {head_dim // 2}] on {device}, got "
                                 f"{tuple(tab.shape)} {tab.dtype}")
        if self.cos.shape != self.sin.shape:
            raise ValueError("late cos and sin must have the same shape")
        if self.positions.shape != (t,) or self.positions.dtype not in (torch.int32, torch.int64) \
                or self.positions.device != device:
            raise ValueError(f"late positions must be an int32/int64 [{t}] tensor on {device}, got "
                             f"{tuple(self.positions.shape)} {self.positions.dtype}")


def late_qk(rows: int, row1_block_n: int | None, head_dim: int, qk_norm: bool) -> bool:
    """Whether a step of ``rows`` rows finishes q and k in the attention: a model with q/k norm whose one-row qkv
    plan (``GemmPlan.row1``; its ``block_n``, None without one) takes the row-pair form, at one row."""
    return qk_norm and rows == 1 and row1_block_n is not None and row1_block_n < head_dim


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

