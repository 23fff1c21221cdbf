"""The layer chain of ``tune_attention.py --in-layer``: the attention timed between the kernels a step runs around it.

A decode step (``lowlat_nvidia_mega.forward``) runs per layer qkv_rope -> attention -> o_proj -> gate_up -> down
(a MoE layer: ``moe_forward`` instead of the last two), linked by PDL: the attention's pre-wait loads and programs
share the SMs with qkv_rope's tail and o_proj's head. ``LayerChain`` builds that chain for one attention shape
(B requests x R rows at ``ctx`` tokens), with the production plans of the other kernels (``tuned_plans.qkv_plan`` /
``gemm_plan``) and their launches as forward.py makes them (``gemv.gemm``: the one-row GEMV at one row; one
counters slice per call site, as the build allocates), PDL as in production. Mode "attn": qkv_rope -> attention ->
o_proj per layer; "full": then gate_up -> down (or the MoE), so the next layer's qkv_rope follows them as in a step.
Every layer has its own weights and KV pool, enough layers (at least 8, at most the model's) that they exceed 4x the
L2 (``bench_kernels``' rule), so weights and K/V come from HBM. ``chain(None)`` is the same chain without the
attention: the base that ``tune_attention.py`` subtracts for the attention's share of the layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import bench_kernels as bk
import torch
from lowlat.layers.attention import decode_attention_torch
from lowlat_nvidia_mega.kernels.attention import MAX_SPLITS, AttnPlan, paged_decode_attention, partial_numel
from lowlat_nvidia_mega.kernels.gemm_plans import MAX_ROWS, splitk_workspace_numel
from lowlat_nvidia_mega.kernels.gemv import gemm
from lowlat_nvidia_mega.kernels.moe import MoEWorkspace, moe_forward
from lowlat_nvidia_mega.kernels.pdl import pdl_enabled
from lowlat_nvidia_mega.kernels.qk_late import LateQK, late_qk
from lowlat_nvidia_mega.kernels.qkv_rope import qkv_rope, qkv_workspace_numel, rope_cos_sin
from lowlat_nvidia_mega.kernels.tuned_plans import gemm_plan, qkv_plan

MODES = ("attn", "full")
MIN_LAYERS = 8


class LayerChain:
    """Weights, KV pools and workspaces of ``layers`` decoder layers for B = ``b`` requests x R = ``r`` rows, each
    request ``ctx`` tokens long (its K/V contiguous in each layer's pool; qkv_rope writes the last R positions, the
    attention reads all ``ctx``). ``mode``: "attn" or "full" (dense MLP when the shape has ``inter``, else the MoE)."""

    def __init__(self, shape: dict, b: int, r: int, ctx: int, dev: torch.device, dtype: torch.dtype,
                 mode: str = "attn") -> None:
        if mode not in MODES:
            raise ValueError(f"in-layer mode must be one of {MODES}, got {mode!r}")
        s, t = shape, b * r
        h, hq, hkv, d = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"]
        self.s, self.b, self.r, self.t, self.ctx, self.dev, self.dt, self.mode = s, b, r, t, ctx, dev, dtype, mode
        self.dense = mode == "full" and s["inter"] > 0
        self.moe = mode == "full" and not self.dense and s["experts"] > 0
        if mode == "full" and not (self.dense or self.moe):
            raise ValueError("--in-layer full needs a dense MLP (inter) or experts in the shape")
        el = torch.finfo(dtype).bits // 8
        nqkv, inter, mi = (hq + 2 * hkv) * d, s["inter"], s["moe_inter"]
        layer_bytes = (nqkv * h + h * hq * d + 2 * b * ctx * hkv * d) * el
        layer_bytes += 3 * inter * h * el if self.dense else s["top_k"] * 3 * mi * h * el if self.moe else 0
        l2 = bk.L2_BYTES if dev.type == "cuda" else 0
        self.layers = max(2, min(s["layers"], max(MIN_LAYERS, math.ceil(4 * l2 / layer_bytes))))
        self.g = torch.Generator(device=dev).manual_seed(b * 8 + r)
        n = self.layers
        self.wqkv, self.wo = [self.rand(nqkv, h) for _ in range(n)], [self.rand(h, hq * d) for _ in range(n)]
        self.in_norm, self.post_norm = [self.rand(h) for _ in range(n)], [self.rand(h) for _ in range(n)]
        self.qn, self.kn = (self.rand(d), self.rand(d)) if s["qk_norm"] else (None, None)
        slots = b * ctx + 16
        self.kb = [self.rand(slots, hkv, d) for _ in range(n)]
        self.vb = [self.rand(slots, hkv, d) for _ in range(n)]
        self.rtt = (torch.arange(b * ctx, device=dev, dtype=torch.int32) + 16).view(b, ctx)
        self.rpi = torch.arange(b, device=dev)
        self.seq = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        self.pos = (ctx - r + torch.arange(r, device=dev)).repeat(b)
        self.loc = self.rtt[:, ctx - r:].reshape(-1).to(torch.int64)
        self.cos, self.sin = rope_cos_sin(d, 1e4, max(ctx + 8, 64), None, dev)
        self.x, self.q, self.attn = self.rand(t, h), self.rand(t, hq * d), self.rand(t, hq * d)
        self.qplan = qkv_plan(hq, hkv, d, h, dtype, dev, qk_norm=s["qk_norm"])
        self.late = LateQK(self.qn, self.kn, self.cos, self.sin, self.pos, bk.EPS) \
            if late_qk(t, self.qplan, s["qk_norm"]) else None  # as forward.py: q/k finished in the attention
        self.qws = torch.zeros(max(1, qkv_workspace_numel(self.qplan, hq, hkv, d)), device=dev)
        self.plans = {"o_proj": gemm_plan(h, hq * d, dtype, dev)}
        tiles = {"qkv": hq + 2 * hkv, "o_proj": self.plans["o_proj"].n_tiles(h)}
        need = [splitk_workspace_numel(self.plans["o_proj"], h, gated=False)]
        if self.dense:
            self.plans.update(gate_up=gemm_plan(inter, h, dtype, dev, gated=True), down=gemm_plan(h, inter, dtype, dev))
            tiles.update(gate_up=self.plans["gate_up"].n_tiles(inter), down=self.plans["down"].n_tiles(h))
            need += [splitk_workspace_numel(self.plans["gate_up"], inter, gated=True),
                     splitk_workspace_numel(self.plans["down"], h, gated=False)]
            self.wgu, self.wd = [self.rand(2 * inter, h) for _ in range(n)], [self.rand(h, inter) for _ in range(n)]
            self.act = torch.empty(t, inter, dtype=dtype, device=dev)
        if self.moe:
            e = s["experts"]
            self.router = [self.rand(e, h) for _ in range(n)]
            self.w13 = [self.rand(e, 2 * mi, h) for _ in range(n)]
            self.w2 = [self.rand(e, h, mi) for _ in range(n)]
            self.moe_ws = MoEWorkspace.allocate(MAX_ROWS, h, mi, e, s["top_k"], dtype, dev)
        self.gemm_ws = torch.zeros(max(1, *need), device=dev)
        self.counters = {k: torch.zeros(v, dtype=torch.int32, device=dev) for k, v in tiles.items()}
        n_o, n_l = partial_numel(b, hq, hkv, d, r, AttnPlan(num_splits=MAX_SPLITS))
        self.o_p, self.l_p = torch.empty(n_o, device=dev), torch.empty(n_l, device=dev)
        self.pdl = pdl_enabled(dev)

    def rand(self, *shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.g, device=self.dev) * 0.05).to(self.dt)

    def layer(self, i: int, plan: AttnPlan | None) -> None:
        """Layer ``i``'s launches in forward.py's order and arguments (no attention when ``plan`` is None)."""
        s, x, pdl, kw = self.s, self.x, self.pdl, {"workspace": self.gemm_ws}
        qkv_rope(x, self.in_norm[i], self.wqkv[i], num_heads=s["heads"], num_kv_heads=s["kv_heads"], q_norm=self.qn,
                 k_norm=self.kn, cos=self.cos, sin=self.sin, positions=self.pos, out_cache_loc=self.loc,
                 q_out=self.q, k_buffer=self.kb[i], v_buffer=self.vb[i], eps=bk.EPS, plan=self.qplan,
                 workspace=self.qws, counters=self.counters["qkv"], use_pdl=pdl, qk_late=self.late is not None)
        if plan is not None:
            paged_decode_attention(self.q, self.kb[i], self.vb[i], self.rtt, self.rpi, self.seq, self.attn,
                                   rows_per_req=self.r, sm_scale=s["head_dim"] ** -0.5, plan=plan,
                                   o_partial=self.o_p, lse_partial=self.l_p, use_pdl=pdl, late=self.late)
        gemm(self.attn, self.wo[i], x, plan=self.plans["o_proj"], epilogue="residual", residual=x,
             counters=self.counters["o_proj"], use_pdl=pdl, **kw)
        if self.dense:
            gemm(x, self.wgu[i], self.act, plan=self.plans["gate_up"], epilogue="silu_mul",
                 norm_weight=self.post_norm[i], eps=bk.EPS, counters=self.counters["gate_up"], use_pdl=pdl, **kw)
            gemm(self.act, self.wd[i], x, plan=self.plans["down"], epilogue="residual", residual=x,
                 counters=self.counters["down"], use_pdl=pdl, **kw)
        elif self.moe:
            moe_forward(x, x, self.post_norm[i], bk.EPS, self.router[i], self.w13[i], self.w2[i], s["top_k"], True,
                        x, self.moe_ws, pdl=pdl)

    def chain(self, plan: AttnPlan | None) -> Callable[[], int]:
        """Every layer once, for ``bench_kernels.time_chain`` (which then gives seconds per layer); ``plan`` None:
        the base chain without the attention."""
        def run() -> int:
            for i in range(self.layers):
                self.layer(i, plan)
            return self.layers
        return run

    def error(self, plan: AttnPlan) -> float:
        """Runs the chain once and returns the last layer's attention output's largest |out - reference| over the
        largest |reference|, the reference being torch attention of the q and the layer's KV pool that qkv_rope
        left: the attention in the chain reads its layer's pool and the batch's tables as a step does."""
        self.chain(plan)()
        hq, d = self.s["heads"], self.s["head_dim"]
        ref = decode_attention_torch(self.q.view(self.t, hq, d), self.kb[-1], self.vb[-1], self.rtt, self.rpi,
                                     self.seq, self.r, d ** -0.5).float().reshape(self.t, -1)
        return ((self.attn.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
