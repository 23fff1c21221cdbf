"""Time every nvidia_mega kernel against its byte floor, with PDL on and off and with each fusion undone.

Run on an sm90 GPU (about a minute, most of it Triton compiling):

    PYTHONPATH=core/src:vendors/nvidia_mega/src python vendors/nvidia_mega/bench_kernels.py [--ctx 512]

Method: each measurement is one CUDA graph holding the kernel (or the unfused torch sequence it replaces)
once per layer, over ``copies`` distinct weight / KV copies, so nothing is served from the 50 MB L2 and
consecutive launches overlap as they do in a real step; the graph is replayed ``--reps`` times and the median
replay time is divided by the number of launches. The floor is the bytes the kernel must move (weights,
K/V, activations) divided by the copy bandwidth measured at the start (device-to-device copy, bytes read plus
written, the roofline method of docs/benchmarks.md). ``--smoke`` runs every variant once at tiny shapes on
whatever device is there (CPU with ``TRITON_INTERPRET=1``) to check the script itself; its times print as nan.

``--prefetch`` times only the kernels whose K loop applies an RMSNorm per chunk (qkv_rope, gate_up, LM head, and a
dense layer) with the activation prefetch off and on, side by side with the ratio, and checks each pair's outputs
are bit-identical (exit status 1 if not); about 3 minutes on an H200 for the three presets at 1 and 8 rows:

    PYTHONPATH=core/src:vendors/nvidia_mega/src python vendors/nvidia_mega/bench_kernels.py --prefetch \
        --models llama-3.2-1b,qwen3-8b,qwen3-30b-a3b --rows 1,8
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from lowlat import fast_interpreter
from lowlat.layers.norm import rms_norm
from lowlat.layers.rotary import apply_rotary
from lowlat.platform import triton_interpreter_enabled
from lowlat_nvidia_mega.kernels.attention import paged_decode_attention, partial_numel
from lowlat_nvidia_mega.kernels.gemm_plans import make_plan, num_sms, splitk_workspace_numel
from lowlat_nvidia_mega.kernels.gemv import gemm
from lowlat_nvidia_mega.kernels.lm_head import lm_head_logits
from lowlat_nvidia_mega.kernels.moe import MoEWorkspace, moe_forward
from lowlat_nvidia_mega.kernels.norm_rows import norm_rows, prenorm_step
from lowlat_nvidia_mega.kernels.qk_late import LateQK, late_qk
from lowlat_nvidia_mega.kernels.qkv_rope import qkv_rope, qkv_workspace_numel, rope_cos_sin
from lowlat_nvidia_mega.kernels.small_gemm import small_gemm
from lowlat_nvidia_mega.kernels.tuned_plans import attn_plan, gemm_plan, prenorm_rows, qkv_plan

if triton_interpreter_enabled():  # --smoke runs of this script and the ones importing it (tune_*, bench_moe_head)
    fast_interpreter.install()

SHAPES = {  # shapes without a lowlat preset; a preset name maps through preset_shape
    "tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=32, inter=128, layers=2, vocab=96, qk_norm=True,
                 experts=8, top_k=2, moe_inter=32),
}
L2_BYTES = 50 * 2**20
EPS = 1e-6


def preset_shape(name: str) -> dict:
    """A ``SHAPES`` entry from lowlat's model preset ``name`` (llama-3.2-1b, qwen3-8b, ...). Raises
    ``lowlat.errors.ConfigError`` (a ValueError) for an unknown name."""
    from lowlat.loader.presets import get_preset

    c = get_preset(name)
    moe = bool(c.num_experts)
    return dict(hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                head_dim=c.head_dim, inter=0 if moe else c.intermediate_size, layers=c.num_hidden_layers,
                vocab=c.vocab_size, qk_norm=c.has_qk_norm, experts=c.num_experts or 0,
                top_k=c.num_experts_per_tok or 0, moe_inter=c.moe_intermediate_size or 0)


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + written), median of 10."""
    a = torch.empty(2**29, dtype=torch.int16, device=dev)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.nbytes / statistics.median(times[2:])


def time_chain(chain: Callable[[], int], dev: torch.device, reps: int) -> float:
    """Seconds per launch of ``chain`` (which issues its launches and returns how many), from CUDA-graph replays."""
    if dev.type != "cuda":
        chain()
        return math.nan
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile and warm up outside the capture
            n = chain()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        n = chain()
    times = []
    for _ in range(reps + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times[3:]) / n


class Case:
    """Weights, KV buffers and workspaces of one (model, rows) configuration, several copies of each.

    ``prenorm``: whether production runs this row count as a prenorm step (``norm_rows.prenorm_step`` with
    ``tuned_plans.prenorm_rows``, as ``MegaForward`` decides): then qkv_rope and gate_up have no norm prologue, so
    their chains here run without it (x standing in for the normalized rows) and the layer chain adds the
    ``norm_rows`` launches, and ``tune_plans.py`` never picks a plan for work the step skips."""

    def __init__(self, name: str, rows: int, ctx: int, dev: torch.device, dtype: torch.dtype) -> None:
        s = SHAPES[name] if name in SHAPES else preset_shape(name)
        self.l2 = L2_BYTES if dev.type == "cuda" else 0  # smoke runs: two copies of everything
        self.s, self.t, self.ctx, self.dev, self.dt = s, rows, ctx, dev, dtype
        self.sms = num_sms(dev)
        h, hq, hkv, d = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"]
        self.nqkv = (hq + 2 * hkv) * d
        self.g = torch.Generator(device=dev).manual_seed(0)
        kv_copy = 2 * rows * ctx * hkv * d * 2
        self.x = self.rand(rows, h)
        self.wqkv = self.copies(self.nqkv, h)
        self.wo = self.copies(h, hq * d)
        self.wgu = self.copies(2 * s["inter"], h) if s["inter"] else []
        self.wd = self.copies(h, s["inter"]) if s["inter"] else []
        self.norm = [self.rand(h) for _ in range(8)]
        self.qn = self.rand(d) if s["qk_norm"] else None
        self.kn = self.rand(d) if s["qk_norm"] else None
        self.cos, self.sin = rope_cos_sin(d, 1e4, max(ctx + 8, 64), None, dev)
        self.q = self.rand(rows, hq * d)
        self.attn = self.rand(rows, hq * d)
        self.act = self.rand(rows, max(s["inter"], 1))
        self.gemm_ws = torch.zeros(4 * 8 * max(h, s["inter"]) * 16, device=dev)
        self.counters = torch.zeros(4096, dtype=torch.int32, device=dev)
        # KV: B = rows requests of ctx tokens laid out contiguously, one pool per copy (beyond the layer count:
        # a short context's K/V would otherwise stay in L2 between replays, which a real step never allows).
        slots = rows * ctx + 16
        n_kv = max(2, min(256, math.ceil(4 * self.l2 / kv_copy)))
        self.kb = [self.rand(slots, hkv, d) for _ in range(n_kv)]
        self.vb = [self.rand(slots, hkv, d) for _ in range(n_kv)]
        self.rtt = (torch.arange(rows * ctx, device=dev, dtype=torch.int32) + 16).view(rows, ctx)
        self.prenorm = prenorm_step(rows, prenorm_rows("moe" if s["experts"] else "dense", h, dtype, dev))
        self.h = self.rand(rows, h)  # a prenorm step's normalized rows (norm_rows' output)

    def prologue_norm(self, i: int) -> torch.Tensor | None:
        """The norm prologue's weight for launch ``i`` of qkv_rope or gate_up; None on a prenorm step."""
        return None if self.prenorm else self.norm[i % 8]

    def copies(self, n: int, k: int) -> list[torch.Tensor]:
        """Distinct [n, k] weights: enough to exceed 4x the L2, at most the model's layer count (at least 2)."""
        count = max(2, min(self.s["layers"], math.ceil(4 * self.l2 / (2 * n * k))))
        return [self.rand(n, k) for _ in range(count)]

    def rand(self, *shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.g, device=self.dev) * 0.05).to(self.dt)

    def decode_batch(self, b: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(req_pool_indices, seq_lens, positions, out_cache_loc) of b requests x r rows at context ``ctx``."""
        rpi = torch.arange(b, device=self.dev)
        seq = torch.full((b,), self.ctx, dtype=torch.int32, device=self.dev)
        pos = (self.ctx - r + torch.arange(r, device=self.dev)).repeat(b)
        loc = self.rtt[:b, self.ctx - r:].reshape(-1).to(torch.int64)
        return rpi, seq, pos, loc

    # ------------------------------------------------------------------ chains (one launch per weight copy)

    def qkv(self, pdl: bool, fused: bool, prefetch: bool | None = None) -> Callable[[], int]:
        s, t = self.s, self.t
        hq, hkv, d = s["heads"], s["kv_heads"], s["head_dim"]
        _, _, pos, loc = self.decode_batch(t, 1)
        plan = qkv_plan(hq, hkv, d, s["hidden"], self.dt, self.dev, qk_norm=s["qk_norm"])
        late = late_qk(t, plan, s["qk_norm"])
        ws = torch.zeros(max(1, qkv_workspace_numel(plan, hq, hkv, d)), device=self.dev)
        gplan = gemm_plan(self.nqkv, s["hidden"], self.dt, self.dev)
        out = torch.empty(t, self.nqkv, dtype=self.dt, device=self.dev)
        cos_full = torch.cat([self.cos, self.cos], -1).to(self.dt)
        sin_full = torch.cat([self.sin, self.sin], -1).to(self.dt)

        def chain() -> int:
            for i, w in enumerate(self.wqkv):
                kb, vb, nw = self.kb[i % len(self.kb)], self.vb[i % len(self.vb)], self.norm[i % 8]
                if fused:
                    qkv_rope(self.x, self.prologue_norm(i), w, num_heads=hq, num_kv_heads=hkv, q_norm=self.qn,
                             k_norm=self.kn, cos=self.cos, sin=self.sin, positions=pos, out_cache_loc=loc,
                             q_out=self.q, k_buffer=kb, v_buffer=vb, eps=EPS, plan=plan,
                             workspace=ws, counters=self.counters, use_pdl=pdl, prefetch_act=prefetch, qk_late=late)
                else:  # what the general path runs: norm, GEMM, q/k norm, RoPE, KV write as separate kernels
                    small_gemm(rms_norm(self.x, nw, EPS), w, out, plan=gplan,
                               workspace=self.gemm_ws, counters=self.counters, use_pdl=pdl)
                    q, k, v = out.split([hq * d, hkv * d, hkv * d], -1)
                    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
                    if self.qn is not None:
                        q, k = rms_norm(q, self.qn, EPS), rms_norm(k, self.kn, EPS)
                    c, sn = cos_full[pos], sin_full[pos]
                    self.q.view(t, hq, d).copy_(apply_rotary(q, c, sn))
                    kb.index_copy_(0, loc, apply_rotary(k, c, sn))
                    vb.index_copy_(0, loc, v)
            return len(self.wqkv)
        return chain

    def attention(self, pdl: bool, b: int, r: int) -> Callable[[], int]:
        s = self.s
        hq, hkv, d = s["heads"], s["kv_heads"], s["head_dim"]
        _, seq, _, _ = self.decode_batch(b, r)
        plan = attn_plan(b, r, hq, hkv, d, self.ctx, self.sms, self.dt, device=self.dev)
        n_o, n_l = partial_numel(b, hq, hkv, d, r, plan)
        o_p, l_p = torch.empty(n_o, device=self.dev), torch.empty(n_l, device=self.dev)
        # Each copy holds self.t requests' K/V; a launch of b < self.t requests (VERIFY: one) reads only b of them,
        # so the launches walk the copies' request groups too: every launch reads K/V no other launch of the chain
        # reads, as sized for self.t (otherwise at 8 rows a VERIFY chain read about 26 MB, inside the 50 MB L2).
        groups = [torch.arange(j * b, (j + 1) * b, device=self.dev) for j in range(max(1, self.t // b))]

        def chain() -> int:
            for kb, vb in zip(self.kb, self.vb):
                for rpi in groups:
                    paged_decode_attention(self.q, kb, vb, self.rtt, rpi, seq, self.attn, rows_per_req=r,
                                           sm_scale=d ** -0.5, plan=plan, o_partial=o_p, lse_partial=l_p,
                                           use_pdl=pdl)
            return len(self.kb) * len(groups)
        return chain

    def gemm(self, which: str, pdl: bool, fused: bool = True, split: bool = True,
             prefetch: bool | None = None) -> Callable[[], int]:
        s, t, h = self.s, self.t, self.s["hidden"]
        ws = {"o_proj": self.wo, "gate_up": self.wgu, "down": self.wd}[which]
        n = s["inter"] if which == "gate_up" else h
        k = ws[0].shape[1]
        gated = which == "gate_up"
        plan = gemm_plan(n, k, self.dt, self.dev, gated=gated)
        if not split:  # the same tiles without split-K
            plan = make_plan(k, block_n=plan.block_n, block_k=plan.block_k, split_k=1, num_warps=plan.num_warps,
                             num_stages=plan.num_stages, weight_rows=(2 if gated else 1) * plan.block_n)
        plan_plain = gemm_plan(ws[0].shape[0], k, self.dt, self.dev)
        assert splitk_workspace_numel(plan, n, gated=gated) <= self.gemm_ws.numel()
        x_in = self.x if gated else (self.attn if which == "o_proj" else self.act)
        resid = torch.zeros(t, h, dtype=self.dt, device=self.dev)  # the residual in and out: never uninitialized
        tmp = torch.empty(t, ws[0].shape[0], dtype=self.dt, device=self.dev)

        def chain() -> int:
            for i in range(len(ws)):
                if gated and fused:
                    gemm(x_in, ws[i], self.act, plan=plan, epilogue="silu_mul", norm_weight=self.prologue_norm(i),
                         eps=EPS, workspace=self.gemm_ws, counters=self.counters, use_pdl=pdl, prefetch_act=prefetch)
                elif gated:
                    small_gemm(rms_norm(x_in, self.norm[i % 8], EPS), ws[i], tmp, plan=plan_plain,
                               workspace=self.gemm_ws, counters=self.counters, use_pdl=pdl)
                    g, u = tmp.chunk(2, -1)
                    self.act.copy_(F.silu(g) * u)
                elif fused:
                    gemm(x_in, ws[i], resid, plan=plan, epilogue="residual", residual=resid, workspace=self.gemm_ws,
                         counters=self.counters, use_pdl=pdl)
                else:
                    small_gemm(x_in, ws[i], tmp, plan=plan, workspace=self.gemm_ws, counters=self.counters,
                               use_pdl=pdl)
                    resid.add_(tmp)
            return len(ws)
        return chain

    def moe(self, pdl: bool) -> tuple[Callable[[], int], MoEWorkspace]:
        s, h = self.s, self.s["hidden"]
        e, inter = s["experts"], s["moe_inter"]
        copies = max(2, min(s["layers"], math.ceil(4 * self.l2 / (s["top_k"] * 6 * inter * h))))
        gate = [self.rand(e, h) for _ in range(copies)]
        w13 = [self.rand(e, 2 * inter, h) for _ in range(copies)]
        w2 = [self.rand(e, h, inter) for _ in range(copies)]
        ws = MoEWorkspace.allocate(8, h, inter, e, s["top_k"], self.dt, self.dev)
        resid = self.rand(self.t, h)

        def chain() -> int:
            for i in range(copies):
                moe_forward(resid, resid, self.norm[i % 8], EPS, gate[i], w13[i], w2[i], s["top_k"],
                            True, resid, ws, pdl=pdl)
            return copies
        return chain, ws

    def layer(self, pdl: bool, general: bool, prefetch: bool | None = None) -> Callable[[], int]:
        """A whole dense decoder layer (DECODE, B = rows): the mega kernel chain, or the general path's ops."""
        s, t, h = self.s, self.t, self.s["hidden"]
        hq, hkv, d = s["heads"], s["kv_heads"], s["head_dim"]
        rpi, seq, pos, loc = self.decode_batch(t, 1)
        qplan = qkv_plan(hq, hkv, d, h, self.dt, self.dev, qk_norm=s["qk_norm"])
        late = LateQK(self.qn, self.kn, self.cos, self.sin, pos, EPS) \
            if late_qk(t, qplan, s["qk_norm"]) else None
        qws = torch.zeros(max(1, qkv_workspace_numel(qplan, hq, hkv, d)), device=self.dev)
        aplan = attn_plan(t, 1, hq, hkv, d, self.ctx, self.sms, self.dt, device=self.dev)
        n_o, n_l = partial_numel(t, hq, hkv, d, 1, aplan)
        o_p, l_p = torch.empty(n_o, device=self.dev), torch.empty(n_l, device=self.dev)
        oplan = gemm_plan(h, hq * d, self.dt, self.dev)
        guplan = gemm_plan(s["inter"], h, self.dt, self.dev, gated=True)
        dplan = gemm_plan(h, s["inter"], self.dt, self.dev)
        x = self.rand(t, h)
        cos_full = torch.cat([self.cos, self.cos], -1).to(self.dt)
        sin_full = torch.cat([self.sin, self.sin], -1).to(self.dt)
        kw = {"workspace": self.gemm_ws, "counters": self.counters, "use_pdl": pdl}
        n_layers = min(len(self.wqkv), len(self.wo), len(self.wgu), len(self.wd), len(self.kb))

        def prologue(i: int) -> tuple[torch.Tensor, torch.Tensor | None]:  # MegaForward._gemm_input
            if not self.prenorm:
                return x, self.norm[i % 8]
            return norm_rows(x, self.norm[i % 8], EPS, self.h, use_pdl=pdl), None

        def mega() -> int:
            for i in range(n_layers):
                qkv_rope(*prologue(i), self.wqkv[i], num_heads=hq, num_kv_heads=hkv, q_norm=self.qn,
                         k_norm=self.kn, cos=self.cos, sin=self.sin, positions=pos, out_cache_loc=loc, q_out=self.q,
                         k_buffer=self.kb[i], v_buffer=self.vb[i], eps=EPS, plan=qplan, workspace=qws,
                         counters=self.counters, use_pdl=pdl, prefetch_act=prefetch, qk_late=late is not None)
                paged_decode_attention(self.q, self.kb[i], self.vb[i], self.rtt, rpi, seq, self.attn, rows_per_req=1,
                                       sm_scale=d ** -0.5, plan=aplan, o_partial=o_p, lse_partial=l_p,
                                       use_pdl=pdl, late=late)
                gemm(self.attn, self.wo[i], x, plan=oplan, epilogue="residual", residual=x, **kw)
                xn, nw = prologue(i)
                gemm(xn, self.wgu[i], self.act, plan=guplan, epilogue="silu_mul", norm_weight=nw, eps=EPS,
                     prefetch_act=prefetch, **kw)
                gemm(self.act, self.wd[i], x, plan=dplan, epilogue="residual", residual=x, **kw)
            return n_layers

        def torch_layer() -> int:
            from lowlat.kernels.decode_attention import decode_attention

            xx = x
            for i in range(n_layers):
                qkv = F.linear(rms_norm(xx, self.norm[i % 8], EPS), self.wqkv[i])
                q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
                q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
                if self.qn is not None:
                    q, k = rms_norm(q, self.qn, EPS), rms_norm(k, self.kn, EPS)
                c, sn = cos_full[pos], sin_full[pos]
                q, k = apply_rotary(q, c, sn), apply_rotary(k, c, sn)
                self.kb[i].index_copy_(0, loc, k)
                self.vb[i].index_copy_(0, loc, v)
                o = decode_attention(q, self.kb[i], self.vb[i], self.rtt, rpi, seq, 1, d ** -0.5)
                xx = xx + F.linear(o.reshape(t, -1), self.wo[i])
                g, u = F.linear(rms_norm(xx, self.norm[i % 8], EPS), self.wgu[i]).chunk(2, -1)
                xx = xx + F.linear(F.silu(g) * u, self.wd[i])
            return n_layers

        return torch_layer if general else mega

    def lm_head(self, pdl: bool, prefetch: bool | None = None) -> Callable[[], int]:
        if not hasattr(self, "lm_w"):  # one weight (larger than the L2 at every preset) and output for all variants
            self.lm_w = self.rand(self.s["vocab"], self.s["hidden"])
            self.logits = torch.empty(self.t, self.s["vocab"], device=self.dev)

        def chain() -> int:
            lm_head_logits(self.x, self.norm[0], self.lm_w, EPS, self.logits, pdl=pdl, prefetch_act=prefetch)
            return 1
        return chain


def run(name: str, rows: int, args: argparse.Namespace, dev: torch.device, bw: float) -> list[tuple]:
    """Measure every variant of one (model, rows); returns table rows."""
    c = Case(name, rows, args.ctx, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    s, el = c.s, 2
    h, hq, hkv, d = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"]
    kv_bytes = lambda b: 2 * b * args.ctx * hkv * d * el  # noqa: E731
    pdl_ok = dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9
    out: list[tuple] = []

    def add(kernel: str, variant: str, chain: Callable[[], int], nbytes: float, pdl: bool) -> None:
        sec = time_chain(chain, dev, args.reps)
        floor = nbytes / bw if bw else math.nan
        out.append((name, rows, kernel, variant, "on" if pdl else "off", sec * 1e6, floor * 1e6))

    pdls = [True, False] if pdl_ok else [False]
    pre = ", no norm (prenorm)" if c.prenorm else ""  # a prenorm step: no norm prologue, the layer has norm_rows
    for pdl in pdls:
        add("qkv_rope", "fused" + pre, c.qkv(pdl, True), c.nqkv * h * el, pdl)
        add("attention", f"decode B={rows}", c.attention(pdl, rows, 1), kv_bytes(rows), pdl)
        if rows > 1:
            add("attention", f"verify R={rows}", c.attention(pdl, 1, rows), kv_bytes(1), pdl)
        add("o_proj", "fused residual", c.gemm("o_proj", pdl), h * hq * d * el, pdl)
        if s["inter"]:
            add("gate_up", "fused silu, no norm (prenorm)" if c.prenorm else "fused norm+silu", c.gemm("gate_up", pdl),
                2 * s["inter"] * h * el, pdl)
            add("down", "fused residual", c.gemm("down", pdl), h * s["inter"] * el, pdl)
        if s["experts"]:
            chain, ws = c.moe(pdl)
            add("moe", "route+experts", chain, 0.0, pdl)
            slots = int(ws.num_slots.item())
            nbytes = slots * 3 * s["moe_inter"] * h * el + s["experts"] * h * el
            out[-1] = out[-1][:-1] + (nbytes / bw * 1e6 if bw else math.nan,)
        add("lm_head", "norm+logits", c.lm_head(pdl), s["vocab"] * h * el, pdl)
    if s["inter"]:
        layer_bytes = (c.nqkv * h + h * hq * d + 3 * s["inter"] * h) * el + kv_bytes(rows)
        for pdl in pdls:
            add("layer", "mega chain" + (" (prenorm step)" if c.prenorm else ""), c.layer(pdl, general=False),
                layer_bytes, pdl)
        if dev.type == "cuda":
            add("layer", "general path ops (torch + core)", c.layer(False, general=True), layer_bytes, False)
    pdl = pdls[0]  # fusion and split-K ablations, with PDL as in production
    add("qkv_rope", "unfused (torch norm/rope/kv)", c.qkv(pdl, False), c.nqkv * h * el, pdl)
    add("o_proj", "unfused residual add", c.gemm("o_proj", pdl, fused=False), h * hq * d * el, pdl)
    add("o_proj", "no split-K", c.gemm("o_proj", pdl, split=False), h * hq * d * el, pdl)
    if s["inter"]:
        add("gate_up", "unfused norm / silu", c.gemm("gate_up", pdl, fused=False), 2 * s["inter"] * h * el, pdl)
        add("down", "no split-K", c.gemm("down", pdl, split=False), h * s["inter"] * el, pdl)
    return out


def run_prefetch(name: str, rows: int, args: argparse.Namespace, dev: torch.device, bw: float) -> list[tuple]:
    """The kernels whose K loop normalizes its input (qkv_rope, gate_up, LM head, and the dense layer holding the
    first two) with the activation prefetch off and on, PDL as in production; each pair's outputs are checked
    bit-identical after the timing. Returns (model, rows, kernel, off us, on us, floor us, identical) rows."""
    c = Case(name, rows, args.ctx, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    c.prenorm = False  # the prologue's prefetch is what this times, at any row count
    s, el = c.s, 2
    h, hq, hkv, d = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"]
    pdl = dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9
    kernels: list[tuple[str, Callable[[bool], Callable[[], int]], float, Callable[[], list[torch.Tensor]]]] = [
        ("qkv_rope", lambda p: c.qkv(pdl, True, prefetch=p), c.nqkv * h * el, lambda: [c.q]),
    ]
    if s["inter"]:
        kernels.append(("gate_up", lambda p: c.gemm("gate_up", pdl, prefetch=p), 2 * s["inter"] * h * el,
                        lambda: [c.act]))
    kernels.append(("lm_head", lambda p: c.lm_head(pdl, prefetch=p), s["vocab"] * h * el, lambda: [c.logits]))
    if s["inter"]:
        layer_bytes = (c.nqkv * h + h * hq * d + 3 * s["inter"] * h) * el + 2 * rows * args.ctx * hkv * d * el
        kernels.append(("layer", lambda p: c.layer(pdl, general=False, prefetch=p), layer_bytes, lambda: []))
    out = []
    for kernel, make, nbytes, outputs in kernels:
        chains = {p: make(p) for p in (False, True)}
        off, on = (time_chain(chains[p], dev, args.reps) for p in (False, True))
        chains[False]()  # one eager run each (compiled by now); the last launch of each wrote the same inputs' output
        ref = [t.clone() for t in outputs()]
        chains[True]()
        same = all(torch.equal(a, b) for a, b in zip(ref, outputs(), strict=True))
        out.append((name, rows, kernel, off * 1e6, on * 1e6, nbytes / bw * 1e6 if bw else math.nan, same))
    return out


def print_prefetch(table: list[tuple]) -> None:
    hdr = (f"{'model':14} {'rows':>4} {'kernel':10} {'off us':>9} {'on us':>9} {'off/on':>7} {'floor us':>9} "
           f"{'bit-identical':>13}")
    print("activation prefetch (LOWLAT_MEGA_PREFETCH_ACT / prefetch_act) off vs on, PDL as in production")
    print(hdr)
    print("-" * len(hdr))
    for model, rows, kernel, off, on, floor, same in table:
        ratio = off / on if on == on and on > 0 else math.nan
        ident = ("yes" if same else "NO") if kernel != "layer" else "-"
        print(f"{model:14} {rows:>4} {kernel:10} {off:9.2f} {on:9.2f} {ratio:7.3f} {floor:9.2f} {ident:>13}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-30b-a3b")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--ctx", type=int, default=512, help="KV tokens per request")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one eager run per variant, no timing")
    ap.add_argument("--prefetch", action="store_true",
                    help="only the kernels with a norm prologue, activation prefetch off vs on (and their ratio)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    models = ["tiny"] if args.smoke else args.models.split(",")
    if args.smoke:
        args.ctx = 40
    bw = copy_bandwidth(dev) if dev.type == "cuda" else 0.0
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device {name}; copy bandwidth {bw / 1e12:.2f} TB/s (read + written); context {args.ctx} tokens")
    table = []
    if args.prefetch:
        for m in models:
            for r in (int(x) for x in args.rows.split(",")):
                table += run_prefetch(m, r, args, dev, bw)
        print_prefetch(table)
        if not all(row[-1] for row in table):
            raise SystemExit("activation prefetch changed a kernel's output (see 'bit-identical')")
        return
    for m in models:
        for r in (int(x) for x in args.rows.split(",")):
            table += run(m, r, args, dev, bw)
    hdr = f"{'model':14} {'rows':>4} {'kernel':10} {'variant':30} {'PDL':>3} {'us':>9} {'floor us':>9} {'% floor':>8}"
    print(hdr)
    print("-" * len(hdr))
    for model, rows, kernel, variant, pdl, us, floor in table:
        pct = 100 * floor / us if us == us and us > 0 else math.nan
        print(f"{model:14} {rows:>4} {kernel:10} {variant:30} {pdl:>3} {us:9.2f} {floor:9.2f} {pct:8.1f}")


if __name__ == "__main__":
    main()
