"""MegaForward: one DECODE or VERIFY step of 1 to 8 rows as a chain of PDL-linked Triton kernels.

Per decoder layer (dense)::

    qkv_rope   x -> rmsnorm -> QKV GEMM -> q/k norm (Qwen3) -> RoPE -> q buffer, K/V at out_cache_loc
    attention  split-KV paged attention (packed GQA, causal among the new rows) + merge
    o_proj     x += attn @ Wo^T                       (small GEMM, split-K, residual epilogue, in place)
    gate_up    act = silu(g) * u of rmsnorm(x) @ Wgu^T (small GEMM, norm prologue, SwiGLU epilogue)
    down       x += act @ Wd^T                        (small GEMM, split-K, residual epilogue, in place)

At one row (a batch-1 DECODE step) the three projections run the one-row GEMV (``kernels.gemv``) where the
shape's plan has ``row1``; ``kernels.gemv.gemm`` makes that choice, from the row count alone. On a prenorm step
(2..``prenorm_max_rows`` rows, the measured rule of ``tuned_plans.TUNED_PRENORM``; ``LOWLAT_MEGA_PRENORM=1`` / ``0``
forces every 2-8-row step / none) the input norms of qkv_rope and gate_up run as ``kernels.norm_rows`` launches
into ``Workspaces.h`` and those GEMMs skip their norm prologue.

At tp_size > 1 (``lowlat_nvidia_mega.tp``) o_proj and down (or the MoE's down) publish their tiles to every rank from
their epilogues and ``kernels.tp_reduce.reduce_rows`` sums them in rank order, adds the residual and runs the next
input norm; the embedding and the LM head are vocabulary-parallel.

A Qwen3-MoE layer replaces gate_up/down by ``kernels.moe.moe_forward`` (norm + routing + experts + residual).
The step ends with ``kernels.lm_head.lm_head_logits`` (final norm + LM head, float32 logits), or, when the batch
``wants_ids`` (plugin API 3), with ``kernels.lm_head.lm_head_sample``: the same pass over the LM head fused with
sampling, which returns int64 ids (-1 for a row with non-finite logits) and never writes logits. The embedding is
a torch ``index_select`` into a fixed buffer. Every intermediate lives in a workspace allocated once at build
(sized for 8 rows), so the step is CUDA-graph capturable: it reads only device tensors of the batch and its
shapes, and makes no host sync. Math and parameter layout: docs/agent-brief.md of the lowlat repository.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lowlat.plugin import ForwardBatch, ForwardMode, ModelConfig

from lowlat_nvidia_mega.kernels.attention import AttnPlan, paged_decode_attention
from lowlat_nvidia_mega.kernels.gemm_plans import MAX_ROWS, GemmPlan
from lowlat_nvidia_mega.kernels.gemv import gemm, publish_tile_n
from lowlat_nvidia_mega.kernels.lm_head import LMHeadConfig, lm_head_logits, lm_head_sample
from lowlat_nvidia_mega.kernels.moe import default_config, moe_forward
from lowlat_nvidia_mega.kernels.norm_rows import norm_rows, prenorm_step
from lowlat_nvidia_mega.kernels.pdl import pdl_enabled
from lowlat_nvidia_mega.kernels.qk_late import LateQK, late_qk
from lowlat_nvidia_mega.kernels.qkv_rope import qkv_rope
from lowlat_nvidia_mega.tp import MegaTP, tp_reduce_mode

MODES = (ForwardMode.DECODE, ForwardMode.VERIFY)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's parameters (views of the general model's, per the brief's layout).

    Dense layers set ``gate_up`` [2I, H] and ``down`` [H, I]; MoE layers set ``router`` [E, H],
    ``w13`` [E, 2I, H] and ``w2`` [E, H, I]. ``q_norm`` / ``k_norm`` [D] are Qwen3's, else None.
    """

    input_norm: torch.Tensor
    qkv: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    router: torch.Tensor | None = None
    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None

    @property
    def is_moe(self) -> bool:
        return self.router is not None


@dataclass(frozen=True)
class Workspaces:
    """Buffers allocated once at build (``binding.alloc_workspace``), rows padded to 8.

    x [8, H] residual stream; q [8, Hq*D]; attn [8, Hq*D]; act [8, I] (dense layers); gemm_ws / qkv_ws fp32
    split-K partials; counters int32 per split-K call site (zero between launches); o_partial / lse_partial
    fp32 attention splits; cos / sin fp32 [max_context_len, D/2]; h [8, H]: the normalized rows of a prenorm step
    (``kernels.norm_rows``); moe: the MoE workspace or None; head: the ``LMHeadWorkspace`` of ``lm_head_sample``
    (sampled ids), None when the plugin returns logits only.
    """

    x: torch.Tensor
    q: torch.Tensor
    attn: torch.Tensor
    act: torch.Tensor | None
    gemm_ws: torch.Tensor
    qkv_ws: torch.Tensor
    counters: dict[str, torch.Tensor]
    o_partial: torch.Tensor
    lse_partial: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    h: torch.Tensor
    moe: object | None = None
    head: object | None = None


class MegaForward:
    """The plugin forward built by ``lowlat_nvidia_mega.build.build`` (PluginForward protocol).

    Args:
        config: the model's ModelConfig.
        device, dtype: where and in what dtype the model runs.
        embed: [V, H] embedding; final_norm: [H]; lm_head: [V, H] (may be ``embed``).
        layers: one LayerWeights per decoder layer.
        ws: the Workspaces.
        plans: GemmPlan per call site: "qkv", "o_proj", "gate_up", "down" (the last two absent for MoE-only).
        attn_plans: the attention's AttnPlan per (batch, rows per request), every pair with B * R <= 8
            (``tuned_plans.attn_plan`` at build; the attention workspaces are sized for all of them).
        prenorm_max_rows: steps of 2 to this many rows are prenorm steps when ``LOWLAT_MEGA_PRENORM`` is unset
            (``tuned_plans.prenorm_rows`` at build; 0: none).
        heads: (query heads, KV heads) of this rank (the config's at tp_size 1).
        tp: this rank's MegaTP at tp_size > 1 (dense models), else None.
        head_config: the LM head's launch config (the build's ``default_lm_head_config()``, which also sized
            ``ws.head``'s tiles).
    """

    def __init__(self, *, config: ModelConfig, device: torch.device, dtype: torch.dtype, embed: torch.Tensor,
                 final_norm: torch.Tensor, lm_head: torch.Tensor, layers: list[LayerWeights], ws: Workspaces,
                 plans: dict[str, GemmPlan], attn_plans: dict[tuple[int, int], AttnPlan],
                 head_config: LMHeadConfig, prenorm_max_rows: int = 0, heads: tuple[int, int] | None = None,
                 tp: MegaTP | None = None) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        self.heads = heads or (config.num_attention_heads, config.num_key_value_heads)
        self.tp = tp
        self.embed, self.final_norm, self.lm_head = embed, final_norm, lm_head
        self.layers, self.ws, self.plans = layers, ws, plans
        self.attn_plans, self.prenorm_max_rows = attn_plans, prenorm_max_rows
        self.eps = config.rms_norm_eps
        self.sm_scale = config.head_dim ** -0.5
        self.moe_config = default_config()  # read once, so the MoE's launches and its TP reduce agree on its tiles
        self.head_config = head_config  # the build's, which sized ws.head's tiles from it
        self.k_buffers: list[torch.Tensor] | None = None
        self.v_buffers: list[torch.Tensor] | None = None
        self.req_to_token: torch.Tensor | None = None

    def attach_kv_pool(self, kv_pool) -> None:  # type: ignore[no-untyped-def]
        """``binding.on_kv_pool_ready`` callback: keep the pool's per-layer buffers and ``req_to_token``.

        Raises:
            ValueError: when the pool's layers, KV heads, head_dim, dtype or device do not match the model.
        """
        c = self.config
        want = (c.num_hidden_layers, self.heads[1], c.head_dim, self.dtype, self.device.type)
        got = (kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.dtype, kv_pool.device.type)
        if want != got:
            raise ValueError(f"KV pool has (layers, kv heads, head_dim, dtype, device) = {got}; nvidia_mega was built "
                             f"for {want}")
        self.k_buffers, self.v_buffers = list(kv_pool.k_buffers), list(kv_pool.v_buffers)
        self.req_to_token = kv_pool.req_to_token

    def supports(self, batch: ForwardBatch) -> bool:
        """True for a DECODE/VERIFY step of 1..8 tokens, uniform per request, on this device, once the pool exists.

        Host-side checks of shapes only (no device sync), so the dispatcher may call it every step.
        """
        if self.k_buffers is None or batch.forward_mode not in MODES:
            return False
        t, b = int(batch.input_ids.shape[0]), int(batch.seq_lens.shape[0])
        if not (1 <= t <= MAX_ROWS and b >= 1 and t % b == 0):
            return False
        if batch.forward_mode is ForwardMode.DECODE and t != b:
            return False
        if batch.tokens_per_req is not None and batch.tokens_per_req != t // b:
            return False
        dev = batch.input_ids.device
        return dev.type == self.device.type and (dev.index is None or self.device.index is None
                                                 or dev.index == self.device.index)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the step: float32 logits [T, vocab]; writes every layer's K/V at exactly ``batch.out_cache_loc``.

        When ``batch.wants_ids`` (plugin API 3): int64 ids [T] instead, sampled by ``lm_head_sample`` with the
        kernel variant of ``batch.sampling.variant`` ("greedy": argmax; "sample": temperature; "filter":
        temperature, top-k and top-p), -1 for a row whose logits are not all finite.

        Raises:
            ValueError: for a step ``supports`` refuses (names the mode, token count and the fix), or ids asked of
                a plugin built without a sampling workspace, or a SamplingInfo whose rows differ from T.
        """
        if not self.supports(batch):
            raise ValueError(
                f"nvidia_mega serves DECODE/VERIFY steps of 1..{MAX_ROWS} tokens, uniform per request, on "
                f"{self.device} after the KV pool is attached; got {batch.forward_mode.name} with "
                f"{batch.num_tokens} tokens for {batch.batch_size} requests: route it to the general path"
            )
        assert self.k_buffers is not None and self.v_buffers is not None and self.req_to_token is not None
        ws, use_pdl = self.ws, pdl_enabled(self.device)
        t = int(batch.input_ids.shape[0])
        x = ws.x[:t]
        if self.tp is not None:
            self._layers_tp(batch, x, use_pdl)
            logits = torch.empty(t, self.lm_head.shape[0], dtype=torch.float32, device=self.device)
            return self.tp.gather_logits(lm_head_logits(x, self.final_norm, self.lm_head, self.eps, logits,
                                                        pdl=use_pdl, config=self.head_config))
        h = self._prenorm_rows(t)
        torch.index_select(self.embed, 0, batch.input_ids, out=x)
        for i, lw in enumerate(self.layers):
            qkv_in, qkv_norm = self._gemm_input(x, lw.input_norm, h, use_pdl)
            self._attention(batch, i, lw, qkv_in, qkv_norm, use_pdl)
            gemm(ws.attn[:t], lw.o_proj, x, plan=self.plans["o_proj"], epilogue="residual", residual=x,
                 workspace=ws.gemm_ws, counters=ws.counters["o_proj"], use_pdl=use_pdl)
            if lw.is_moe:
                self._moe(x, lw, use_pdl)
            else:
                gu_in, gu_norm = self._gemm_input(x, lw.post_norm, h, use_pdl)
                self._mlp(lw, gu_in, gu_norm, x, use_pdl, epilogue="residual")
        # A fresh output per step (inside a CUDA graph it comes from the graph's pool), so logits or ids a caller
        # keeps are never overwritten by the next step.
        if batch.wants_ids:
            return self._sample(x, batch, use_pdl)
        logits = torch.empty(t, self.lm_head.shape[0], dtype=torch.float32, device=self.device)
        return lm_head_logits(x, self.final_norm, self.lm_head, self.eps, logits, pdl=use_pdl,
                              config=self.head_config)

    def _attention(self, batch: ForwardBatch, i: int, lw: LayerWeights, qkv_in: torch.Tensor,
                   qkv_norm: torch.Tensor | None, use_pdl: bool) -> None:
        """qkv_rope (this layer's K/V written at ``out_cache_loc``) then paged attention into ``ws.attn``; with late
        q/k (a q/k-norm model's one-row step in the row-pair form, ``qk_late.late_qk``) the attention finishes q/k."""
        ws = self.ws
        t, b = int(batch.input_ids.shape[0]), int(batch.seq_lens.shape[0])
        assert self.k_buffers is not None and self.v_buffers is not None
        plan = self.plans["qkv"]
        late = late_qk(t, plan, lw.q_norm is not None)
        qkv_rope(qkv_in, qkv_norm, lw.qkv, num_heads=self.heads[0], num_kv_heads=self.heads[1], q_norm=lw.q_norm,
                 k_norm=lw.k_norm, cos=ws.cos, sin=ws.sin, positions=batch.positions,
                 out_cache_loc=batch.out_cache_loc, q_out=ws.q[:t], k_buffer=self.k_buffers[i],
                 v_buffer=self.v_buffers[i], eps=self.eps, plan=plan, workspace=ws.qkv_ws,
                 counters=ws.counters["qkv"], use_pdl=use_pdl, qk_late=late)
        paged_decode_attention(ws.q[:t], self.k_buffers[i], self.v_buffers[i], self.req_to_token,
                               batch.req_pool_indices, batch.seq_lens, ws.attn[:t], rows_per_req=t // b,
                               sm_scale=self.sm_scale, plan=self.attn_plans[(b, t // b)], o_partial=ws.o_partial,
                               lse_partial=ws.lse_partial, use_pdl=use_pdl,
                               late=LateQK(lw.q_norm, lw.k_norm, ws.cos, ws.sin, batch.positions, self.eps)
                               if late else None)

    def _mlp(self, lw: LayerWeights, gu_in: torch.Tensor, gu_norm: torch.Tensor | None, x: torch.Tensor,
             use_pdl: bool, epilogue: str) -> None:
        """gate_up (SwiGLU epilogue) into ``ws.act``, then down into ``x`` with ``epilogue`` ("residual": x += act @
        Wd^T in place; "publish": the partial goes to every rank, ``self.tp``; "none": the partial into ``x``, here
        the TP partial buffer)."""
        ws, t = self.ws, x.shape[0]
        assert lw.gate_up is not None and lw.down is not None and ws.act is not None
        act = ws.act[:t]
        gemm(gu_in, lw.gate_up, act, plan=self.plans["gate_up"], epilogue="silu_mul", norm_weight=gu_norm,
             eps=self.eps, workspace=ws.gemm_ws, counters=ws.counters["gate_up"], use_pdl=use_pdl)
        gemm(act, lw.down, x, plan=self.plans["down"], epilogue=epilogue,
             residual=x if epilogue == "residual" else None, workspace=ws.gemm_ws, counters=ws.counters["down"],
             use_pdl=use_pdl, peer=self.tp.target if epilogue == "publish" and self.tp is not None else None)

    def _layers_tp(self, batch: ForwardBatch, x: torch.Tensor, use_pdl: bool) -> None:
        """The decoder layers at tp_size > 1 (``lowlat_nvidia_mega.tp``): x [T, H] ends as the residual stream
        after the last layer, equal on every rank."""
        tp, ws, plans, t = self.tp, self.ws, self.plans, x.shape[0]
        assert tp is not None
        n_layers = len(self.layers)
        tp.embed(self.embed, batch.input_ids, x, site=2 * n_layers)
        h = ws.h[:t]
        part = tp.part[:t] if tp_reduce_mode() == "nccl" and tp.part is not None else None  # else: publish
        out, epi, peer = (x, "publish", tp.target) if part is None else (part, "none", None)
        for i, lw in enumerate(self.layers):
            self._attention(batch, i, lw, x if i == 0 else h, lw.input_norm if i == 0 else None, use_pdl)
            gemm(ws.attn[:t], lw.o_proj, out, plan=plans["o_proj"], epilogue=epi, workspace=ws.gemm_ws,
                 counters=ws.counters["o_proj"], use_pdl=use_pdl, peer=peer)
            post = None if lw.is_moe else lw.post_norm  # the MoE's routing kernel normalizes x itself
            tp.finish(x, part, tile_n=publish_tile_n(plans["o_proj"], t), site=2 * i, norm_weight=post, h=h,
                      eps=self.eps, use_pdl=use_pdl)
            if lw.is_moe:
                self._moe(x, lw, use_pdl, publish=part is None, out=out)
            else:
                self._mlp(lw, h, None, out, use_pdl, epilogue=epi)
            nxt = self.layers[i + 1].input_norm if i + 1 < n_layers else None
            tp.finish(x, part, tile_n=self.moe_config.down_block_n if lw.is_moe else publish_tile_n(plans["down"], t),
                      site=2 * i + 1, norm_weight=nxt, h=h, eps=self.eps, use_pdl=use_pdl)

    def _prenorm_rows(self, t: int) -> torch.Tensor | None:
        """The [t, H] buffer of a prenorm step (each input norm in its own ``norm_rows`` launch, the GEMM after it
        without a norm prologue), else None: ``norm_rows.prenorm_step`` with ``prenorm_max_rows``.

        Raises:
            ValueError: a bad ``LOWLAT_MEGA_PRENORM`` value.
        """
        return self.ws.h[:t] if prenorm_step(t, self.prenorm_max_rows) else None

    def _gemm_input(self, x: torch.Tensor, norm_weight: torch.Tensor, h: torch.Tensor | None,
                    use_pdl: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(input, norm weight) of a GEMM with a norm prologue: (x, weight) for the fused prologue, or, on a
        prenorm step (``h`` given), ``h`` filled by ``norm_rows`` and no weight."""
        if h is None:
            return x, norm_weight
        return norm_rows(x, norm_weight, self.eps, h, use_pdl=use_pdl), None

    def _sample(self, x: torch.Tensor, batch: ForwardBatch, use_pdl: bool) -> torch.Tensor:
        """Final norm + LM head + sampling of ``batch.sampling`` (variant chosen on the host only)."""
        info, t = batch.sampling, x.shape[0]
        assert info is not None
        if self.ws.head is None:
            raise ValueError("nvidia_mega was built without a sampling workspace, so it returns logits only; "
                             "build it through lowlat_nvidia_mega.build:build")
        if info.temperature.shape[0] != t:
            raise ValueError(f"batch.sampling has {info.temperature.shape[0]} rows for {t} tokens: "
                             "attach one SamplingInfo row per new token")
        variant = info.variant
        temp = None if variant == "greedy" else info.temperature
        seeds = None if variant == "greedy" else info.seeds
        offsets = None if variant == "greedy" else info.offsets
        top_k = info.top_k if variant == "filter" else None
        top_p = info.top_p if variant == "filter" else None
        ids = torch.empty(t, dtype=torch.int64, device=self.device)
        return lm_head_sample(x, self.final_norm, self.lm_head, self.eps, temp, top_k, top_p, seeds, offsets, ids,
                              self.ws.head, pdl=use_pdl, config=self.head_config)  # type: ignore[arg-type]

    def _moe(self, x: torch.Tensor, lw: LayerWeights, use_pdl: bool, publish: bool = False,
             out: torch.Tensor | None = None) -> None:
        """x += MoE(post_norm(x)) in place; at TP (``out`` given) this rank's partial MoE(...) instead: published to
        every rank for ``reduce_rows`` (``publish``: tiles of ``self.moe_config.down_block_n`` columns), or
        written to ``out`` ("nccl" mode). ``self.moe_config`` is ``default_config()`` at build."""
        c = self.config
        peer = self.tp.target if publish and self.tp is not None else None
        moe_forward(x, x if out is None else None, lw.post_norm, self.eps, lw.router, lw.w13, lw.w2,
                    c.num_experts_per_tok, c.norm_topk_prob, x if out is None else out, self.ws.moe, pdl=use_pdl,
                    config=self.moe_config, peer=peer)
