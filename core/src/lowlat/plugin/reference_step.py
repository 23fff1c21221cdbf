"""ReferenceStep: a whole DECODE / VERIFY step in plain torch, cut into stages a plugin overrides one at a time.

A team with one fused kernel subclasses ``ReferenceStep``, overrides the stage its kernel does, and returns
the subclass from its spec's ``build``: every other stage stays the reference's, so the plugin passes the
contract suite from its first line (docs/writing-a-plugin.md, "One kernel"). The step, per layer::

    h        = norm(x, w.ln_in)                      first layer; later ones: x, h = add_norm(x, delta, w.ln_in)
    q        = qkv_rope_store(i, w, h, cos, sin, batch)   QKV GEMM (+bias), q/k norm, RoPE, K/V at out_cache_loc
    o        = attention(i, q, batch)                 paged attention over the request's cache -> [T, Hq D]
    delta    = o_proj(i, w, o)                        GEMM, TP all-reduce, bias
    x, h     = add_norm(x, delta, w.ln_post)
    delta    = moe(i, w, h) or mlp(i, w, h)           sparse MoE block or dense SwiGLU MLP (TP all-reduce)
    logits   = lm_head(x + delta)                     final norm, LM head, vocab all-gather: float32 [T, V]
    ids      = sample(logits, batch.sampling)          only when batch.wants_ids (plugin API 3): int64 [T]

Stage arguments: ``x`` the residual stream [T, H] in the model dtype; ``w`` the layer's ``LayerWeights``
(the reference's transposed views ``*_t`` = [in, out], plus ``w.params``: the same tensors in the general
layout, ``lowlat.plugin.params.LayerParams``); ``cos`` / ``sin`` [T, D] the RoPE rows of the step's positions in
the model dtype; ``batch`` the ForwardBatch; ``self.pool`` the KV pool (set by ``on_kv_pool_ready``).
The math is docs/decoder-math.md's, written apart from ``lowlat.models`` (so it can serve as a second
opinion), with the general path's RoPE tables (``binding.rope_cos_sin()``). It runs on CPU and CUDA, TP 1 and
2, and makes no host sync, so its steps are CUDA-graph capturable. The contract suite's reference plugin is
this class with nothing overridden; the underscored helpers (``_store_kv``, ``_visible``, ...) are the seams
its deliberately broken variants use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lowlat.forward_batch import ForwardBatch, ForwardMode, SamplingInfo
from lowlat.plugin.params import LayerParams, bind_params
from lowlat.plugin.sampling import sample_ids

STAGES = ("norm", "add_norm", "qkv_rope_store", "attention", "o_proj", "mlp", "moe", "lm_head", "sample")
"""The overridable stages of ReferenceStep, in the order one layer runs them."""


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: float32 statistics, cast back to x's dtype, then times ``weight``. x [..., N], weight [N]."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def neox_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] in x's dtype. Neox style: halves (a, b) -> (a*c - b*s, b*c + a*s)."""
    a, b = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-b, a), dim=-1) * sin[:, None]


@dataclass
class LayerWeights:
    """One decoder layer in the reference layout (``_t`` = transposed: [in, out]); ``params``: general layout."""

    ln_in: torch.Tensor
    qkv_t: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_t: torch.Tensor
    o_bias: torch.Tensor | None
    ln_post: torch.Tensor
    gate_up_t: torch.Tensor | None = None  # dense: [H, 2 * I_l]
    down_t: torch.Tensor | None = None  # dense: [I_l, H]
    router_t: torch.Tensor | None = None  # MoE: [H, E]
    experts_w13_t: torch.Tensor | None = None  # MoE: [E, H, 2 * I_l]
    experts_w2_t: torch.Tensor | None = None  # MoE: [E, I_l, H]
    gate_up_bias: torch.Tensor | None = None  # dense, Llama mlp_bias: [2 * I_l]
    down_bias: torch.Tensor | None = None  # dense, Llama mlp_bias: [H], added after the all-reduce
    params: LayerParams | None = None

    @classmethod
    def from_params(cls, lp: LayerParams) -> LayerWeights:
        """Transposed views of ``lp`` (no copy)."""
        w = cls(ln_in=lp.input_norm, qkv_t=lp.qkv.t(), qkv_bias=lp.qkv_bias, q_norm=lp.q_norm, k_norm=lp.k_norm,
                o_t=lp.o_proj.t(), o_bias=lp.o_bias, ln_post=lp.post_norm, params=lp)
        if lp.is_moe:
            w.router_t, w.experts_w13_t, w.experts_w2_t = (lp.router.t(), lp.w13.transpose(1, 2),  # type: ignore[union-attr]
                                                           lp.w2.transpose(1, 2))  # type: ignore[union-attr]
        else:
            w.gate_up_t, w.down_t = lp.gate_up.t(), lp.down.t()  # type: ignore[union-attr]
            w.gate_up_bias, w.down_bias = lp.gate_up_bias, lp.down_bias
        return w


class ReferenceStep:
    """A PluginForward for DECODE and VERIFY steps whose stages a subclass overrides (module docstring).

    Args:
        binding: the PluginBinding handed to the spec's build.
    Raises (at build):
        PluginBuildError: a parameter the architecture needs is missing or misshapen.
        ValueError: q/k/v/o shapes that do not fit head_dim; the KV pool does not fit the model (when ready).
    """

    def __init__(self, binding) -> None:  # type: ignore[no-untyped-def]
        c = binding.model_config
        mp = bind_params(binding)
        self.config, self.dtype, self.device = c, binding.dtype, binding.device
        self.tp_rank, self.tp_size, self.tp_group = binding.tp_rank, binding.tp_size, binding.tp_group
        self.eps, self.head_dim, self.vocab = c.rms_norm_eps, c.head_dim, c.vocab_size
        self.params = mp
        self.embed, self.vocab_start = mp.embed, mp.vocab_start
        self.lm_head_t, self.final_norm = mp.lm_head.t(), mp.final_norm
        self.layers = [LayerWeights.from_params(lp) for lp in mp.layers]
        self.local_heads = self.layers[0].o_t.shape[0] // self.head_dim
        qkv_heads = self.layers[0].qkv_t.shape[1] // self.head_dim
        self.local_kv_heads = (qkv_heads - self.local_heads) // 2
        if self.local_heads <= 0 or self.local_kv_heads <= 0 or self.local_heads % self.local_kv_heads:
            raise ValueError(f"qkv_proj / o_proj shapes give {self.local_heads} q heads and {self.local_kv_heads} "
                             f"kv heads per rank, which do not fit head_dim={self.head_dim}")
        cos, sin = binding.rope_cos_sin()  # core's tables, bit for bit the general path's
        self.cos_table, self.sin_table = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        self.pool: Any = None  # lowlat's KVPool (duck-typed here: the plugin layer imports no runtime type)
        self._routing: list[torch.Tensor] = []
        binding.on_kv_pool_ready(self._set_pool)

    def _set_pool(self, pool) -> None:  # type: ignore[no-untyped-def]
        if (pool.num_kv_heads, pool.head_dim, pool.num_layers) != (self.local_kv_heads, self.head_dim,
                                                                   len(self.layers)):
            raise ValueError(f"KV pool has (kv heads, head_dim, layers) = ({pool.num_kv_heads}, {pool.head_dim}, "
                             f"{pool.num_layers}); {type(self).__name__} needs ({self.local_kv_heads}, "
                             f"{self.head_dim}, {len(self.layers)})")
        self.pool = pool

    # -- PluginForward ---------------------------------------------------------------------------------------

    def supports(self, batch: ForwardBatch) -> bool:
        """DECODE and VERIFY steps (the spec's coverage already bounds the token count)."""
        return batch.forward_mode in (ForwardMode.DECODE, ForwardMode.VERIFY)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One DECODE/VERIFY step: float32 logits [T, vocab] (int64 ids [T] when ``batch.wants_ids``: the
        ``sample`` stage); writes every layer's K/V at ``out_cache_loc``.

        Raises:
            ValueError: a PREFILL batch (outside the spec's coverage) or no KV pool yet.
        """
        if batch.forward_mode is ForwardMode.PREFILL:
            raise ValueError(f"{type(self).__name__} serves DECODE and VERIFY steps, not PREFILL")
        if self.pool is None:
            raise ValueError("the KV pool is not ready; the runtime calls on_kv_pool_ready before any step")
        self._routing = []
        x = self._embed(batch.input_ids)
        cos = self.cos_table[batch.positions].to(self.dtype)
        sin = self.sin_table[batch.positions].to(self.dtype)
        delta = None
        for i, w in enumerate(self.layers):
            if delta is None:
                h = self.norm(x, w.ln_in)
            else:
                x, h = self.add_norm(x, delta, w.ln_in)
            delta = self._attention(i, w, h, cos, sin, batch)
            x, h = self.add_norm(x, delta, w.ln_post)
            delta = self.moe(i, w, h) if w.router_t is not None else self.mlp(i, w, h)
        logits = self.lm_head(x + delta)  # type: ignore[operator]  # delta is a tensor after the first layer
        return self.sample(logits, batch.sampling) if batch.wants_ids else logits  # type: ignore[arg-type]

    def last_routing(self) -> list[torch.Tensor]:
        """The latest step's top-k expert ids per MoE layer (int64 [T, k], layer order), which the contract
        suite reads so that only rows whose routing really differs from the general path's are excused."""
        return list(self._routing)

    # -- stages (override any one) ---------------------------------------------------------------------------

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x [T, H] (2-D) with ``weight`` [H], in x's dtype (decoder-math.md's rounding order)."""
        return rms(x, weight, self.eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta rounded to the model dtype, its RMSNorm): the new residual and the normalised input."""
        x = x + delta
        return x, self.norm(x, weight)

    def qkv_rope_store(self, layer: int, w: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       batch: ForwardBatch) -> torch.Tensor:
        """QKV GEMM (+bias), q/k RMSNorm (Qwen3), RoPE; stores K/V at ``batch.out_cache_loc``; returns q [T, Hq, D]."""
        t, d = h.shape[0], self.head_dim
        qkv = h @ w.qkv_t
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        nq, nkv = self.local_heads * d, self.local_kv_heads * d
        q = qkv[:, :nq].reshape(t, self.local_heads, d)
        k = qkv[:, nq:nq + nkv].reshape(t, self.local_kv_heads, d)
        v = qkv[:, nq + nkv:].reshape(t, self.local_kv_heads, d)
        if w.q_norm is not None and w.k_norm is not None:
            q, k = rms(q, w.q_norm, self.eps), rms(k, w.k_norm, self.eps)
        q, k = neox_rotate(q, cos, sin), neox_rotate(k, cos, sin)
        self._store_kv(layer, batch.out_cache_loc, k, v)
        return q

    def attention(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Paged attention of q [T, Hq, D] over each request's cached K/V (causal by position) -> [T, Hq D]."""
        return self._paged_attention(layer, q, batch).reshape(q.shape[0], -1)

    def o_proj(self, layer: int, w: LayerWeights, o: torch.Tensor) -> torch.Tensor:
        """o [T, Hq D] @ o_proj^T, summed over TP ranks, plus the bias: the attention block's output [T, H]."""
        out = self._sum_ranks(o @ w.o_t)
        return out if w.o_bias is None else out + w.o_bias

    def mlp(self, layer: int, w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """Dense SwiGLU MLP of h [T, H] (+ Llama's mlp biases; summed over TP ranks)."""
        return self._dense(w, h)

    def moe(self, layer: int, w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """Sparse MoE block of h [T, H]: softmax router, top-k, experts, weighted sum (summed over TP ranks)."""
        return self._moe(w, h)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and LM head of the residual x [T, H]: float32 logits [T, V], full vocab on every rank."""
        local = (self.norm(x, self.final_norm) @ self.lm_head_t).float()
        return self._gather_logits(local)[:, :self.vocab]

    def sample(self, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        """The step's sampled ids from its logits [T, V]: int64 [T], -1 for a non-finite row
        (``lowlat.plugin.sampling.sample_ids``; only for specs whose coverage declares ``sampling``)."""
        return sample_ids(logits, info)

    # -- helpers of the default stages -----------------------------------------------------------------------

    def _attention(self, layer: int, w: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   batch: ForwardBatch) -> torch.Tensor:
        """The attention block: qkv_rope_store -> attention -> o_proj."""
        q = self.qkv_rope_store(layer, w, h, cos, sin, batch)
        return self.o_proj(layer, w, self.attention(layer, q, batch))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.embed[ids]
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed.shape[0])
        x = self.embed[torch.where(mine, local, torch.zeros_like(local))] * mine[:, None].to(self.dtype)
        return self._sum_ranks(x)

    def _store_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [T, Hkv_l, D] at slots ``loc`` [T] of layer ``layer``."""
        self.pool.k_buffers[layer][loc] = k.to(self.pool.dtype)
        self.pool.v_buffers[layer][loc] = v.to(self.pool.dtype)

    def _visible(self, batch: ForwardBatch, length: int) -> torch.Tensor:
        """[T, length] bool: key position j is visible to new token t iff j <= positions[t] (causal)."""
        return torch.arange(length, device=self.device)[None, :] <= batch.positions[:, None]

    def _paged_attention(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq_l, D] -> [T, Hq_l, D]: SDPA (float32) over each request's gathered cache row."""
        t, hq, d = q.shape
        b = batch.req_pool_indices.shape[0]
        n = t // b
        slots = self.pool.req_to_token[batch.req_pool_indices].long()  # [B, L]
        length = slots.shape[1]
        group = hq // self.local_kv_heads
        keys = self.pool.k_buffers[layer][slots].float().transpose(1, 2).repeat_interleave(group, dim=1)
        vals = self.pool.v_buffers[layer][slots].float().transpose(1, 2).repeat_interleave(group, dim=1)
        queries = q.float().reshape(b, n, hq, d).transpose(1, 2)  # [B, Hq, n, D]
        mask = self._visible(batch, length).reshape(b, 1, n, length)
        o = F.scaled_dot_product_attention(queries, keys, vals, attn_mask=mask, scale=d ** -0.5)
        return o.transpose(1, 2).reshape(t, hq, d).to(q.dtype)

    def _dense(self, w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        gu = h @ w.gate_up_t  # type: ignore[operator]
        if w.gate_up_bias is not None:
            gu = gu + w.gate_up_bias
        gate, up = gu.chunk(2, dim=-1)
        out = self._sum_ranks((F.silu(gate) * up) @ w.down_t)  # type: ignore[operator]
        return out if w.down_bias is None else out + w.down_bias

    def _moe(self, w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        c = self.config
        probs = torch.softmax((h @ w.router_t).float(), dim=-1)  # type: ignore[operator]
        top_w, top_ids = probs.topk(c.num_experts_per_tok, dim=-1)
        self._routing.append(top_ids)
        if c.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        combine = torch.zeros_like(probs, dtype=self.dtype).scatter(1, top_ids, top_w.to(self.dtype))  # [T, E]
        gate, up = torch.matmul(h[None], w.experts_w13_t).chunk(2, dim=-1)  # type: ignore[arg-type]  # [E, T, I_l]
        y = torch.matmul(F.silu(gate) * up, w.experts_w2_t)  # type: ignore[arg-type]  # [E, T, H]
        return self._sum_ranks((y * combine.t()[:, :, None]).sum(dim=0))

    def _sum_ranks(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[R, V_l] float32 -> [R, tp * V_l], rank-major along the vocab."""
        if self.tp_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)
