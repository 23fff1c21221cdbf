"""The reference plugin: Llama / Qwen3 / Qwen3-MoE decode in plain torch, written apart from ``lowlat.models``.

It shows what a plugin does with the interface and passes every contract. It builds its own weight layout
from ``binding.params`` at build time (transposed views, ``x @ W_t`` instead of ``F.linear``, with its own
q/k/v, gate/up and expert offsets; views, so the weights are not held twice), reads the KV
pool through ``binding.on_kv_pool_ready``, and runs its own paged attention (one SDPA call over each
request's gathered ``req_to_token`` row, masked by *position*), RoPE with core's tables from
``binding.rope_cos_sin()`` (plugin API 2, so positions rotate bit for bit as on the general path), q/k
RMSNorm and a dense-over-experts
MoE (every expert computed, combined with zero weight for the unselected ones: simple and capturable).
Math: HF ``modeling_llama`` / ``modeling_qwen3`` / ``modeling_qwen3_moe`` (docs/agent-brief.md, "Math").

Tensor parallelism (sizes 1 and 2): the parameters are already this rank's shards; attention and MLP outputs
are summed with ``all_reduce`` and the vocab-parallel logits concatenated with ``all_gather`` over
``binding.tp_group``. Nothing reads host-side values, so DECODE and VERIFY steps are CUDA-graph capturable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lowlat.plugin import Coverage, ModelSpec, PlatformRequirement, Requirements, hookimpl
from lowlat.runtime.forward_batch import ForwardBatch, ForwardMode

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MAX_TOKENS = 16
BUILD = "lowlat_contract.plugins.reference:build"


def reference_specs(build: str = BUILD) -> list[ModelSpec]:
    """One spec per architecture: CPU or CUDA, float32 or bfloat16, TP 1 or 2, DECODE+VERIFY up to 16 tokens."""
    req = Requirements(platforms=(PlatformRequirement("cpu"), PlatformRequirement("cuda")),
                       dtypes=frozenset({"float32", "bfloat16"}), tp_sizes=frozenset({1, 2}))
    cov = Coverage(modes=frozenset({ForwardMode.DECODE, ForwardMode.VERIFY}), max_tokens=MAX_TOKENS)
    return [ModelSpec(architecture=a, requirements=req, coverage=cov, build=build) for a in ARCHITECTURES]


class SpecHooks:
    """A pluggy plugin object whose ``lowlat_model_specs`` hook returns ``specs()``.

    An object (not a module) so that several fixture plugins can share one module: each entry point names its
    own instance (``lowlat_contract.plugins.reference:HOOKS``), and pluggy registers each once.
    """

    def __init__(self, specs: Callable[[], list[ModelSpec]]) -> None:
        self._specs = specs

    @hookimpl
    def lowlat_model_specs(self) -> list[ModelSpec]:
        return self._specs()


HOOKS = SpecHooks(reference_specs)


def build(binding: Any) -> ReferenceForward:
    """The spec's ``build``: a ReferenceForward over this rank's parameters."""
    return ReferenceForward(binding)


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
    """One decoder layer in the reference layout (``_t`` = transposed: [in, out])."""

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
    gate_up_bias: torch.Tensor | None = None  # dense with mlp_bias: [2 * I_l]
    down_bias: torch.Tensor | None = None  # dense with mlp_bias: [H], added once after the TP sum
    router_t: torch.Tensor | None = None  # MoE: [H, E]
    experts_w13_t: torch.Tensor | None = None  # MoE: [E, H, 2 * I_l]
    experts_w2_t: torch.Tensor | None = None  # MoE: [E, I_l, H]


class ReferenceForward:
    """The PluginForward of the reference plugin (DECODE and VERIFY; see the module docstring).

    Raises (at build):
        KeyError: a parameter the architecture needs is missing from ``binding.params``.
        ValueError: an unsupported rope type, or shapes that do not fit the model config.
    """

    def __init__(self, binding: Any) -> None:
        c = binding.model_config
        p = binding.params
        self.config, self.dtype, self.device = c, binding.dtype, binding.device
        self.tp_rank, self.tp_size, self.tp_group = binding.tp_rank, binding.tp_size, binding.tp_group
        self.eps, self.head_dim, self.vocab = c.rms_norm_eps, c.head_dim, c.vocab_size
        self.embed = p["model.embed_tokens.weight"].detach()
        self.vocab_start = self.tp_rank * self.embed.shape[0]
        lm = p.get("lm_head.weight", p["model.embed_tokens.weight"])  # tied: maybe listed as embedding only
        self.lm_head_t = lm.detach().t()
        self.final_norm = p["model.norm.weight"].detach()
        self.layers = [self._layer(p, f"model.layers.{i}.") for i in range(c.num_hidden_layers)]
        self.local_heads = self.layers[0].o_t.shape[0] // self.head_dim
        qkv_heads = self.layers[0].qkv_t.shape[1] // self.head_dim
        self.local_kv_heads = (qkv_heads - self.local_heads) // 2
        if self.local_heads <= 0 or self.local_kv_heads <= 0 or self.local_heads % self.local_kv_heads:
            raise ValueError(f"qkv_proj / o_proj shapes give {self.local_heads} q heads and {self.local_kv_heads} "
                             f"kv heads per rank, which do not fit head_dim={self.head_dim}")
        cos, sin = binding.rope_cos_sin()  # plugin API 2: core's tables, bit for bit the general path's
        self.cos_table, self.sin_table = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        self.pool: Any = None
        binding.on_kv_pool_ready(self._set_pool)

    def _layer(self, p: dict[str, torch.Tensor], pre: str) -> LayerWeights:
        def t(name: str) -> torch.Tensor:
            return p[pre + name].detach().t()

        def opt(name: str) -> torch.Tensor | None:
            return p[pre + name].detach() if pre + name in p else None

        w = LayerWeights(ln_in=opt("input_layernorm.weight"), qkv_t=t("self_attn.qkv_proj.weight"),  # type: ignore
                         qkv_bias=opt("self_attn.qkv_proj.bias"), q_norm=opt("self_attn.q_norm.weight"),
                         k_norm=opt("self_attn.k_norm.weight"), o_t=t("self_attn.o_proj.weight"),
                         o_bias=opt("self_attn.o_proj.bias"), ln_post=opt("post_attention_layernorm.weight"))
        if pre + "mlp.experts.w13_weight" in p:
            w.router_t = t("mlp.gate.weight")
            w.experts_w13_t = p[pre + "mlp.experts.w13_weight"].detach().transpose(1, 2)
            w.experts_w2_t = p[pre + "mlp.experts.w2_weight"].detach().transpose(1, 2)
        else:
            w.gate_up_t, w.down_t = t("mlp.gate_up_proj.weight"), t("mlp.down_proj.weight")
            w.gate_up_bias, w.down_bias = opt("mlp.gate_up_proj.bias"), opt("mlp.down_proj.bias")
        return w

    def _set_pool(self, pool: Any) -> None:
        if (pool.num_kv_heads, pool.head_dim, pool.num_layers) != (self.local_kv_heads, self.head_dim,
                                                                   len(self.layers)):
            raise ValueError(f"KV pool has (kv heads, head_dim, layers) = ({pool.num_kv_heads}, {pool.head_dim}, "
                             f"{pool.num_layers}); the reference plugin needs ({self.local_kv_heads}, "
                             f"{self.head_dim}, {len(self.layers)})")
        self.pool = pool

    # -- PluginForward ---------------------------------------------------------------------------------------

    def supports(self, batch: ForwardBatch) -> bool:
        """DECODE and VERIFY steps (coverage already bounds the token count)."""
        return batch.forward_mode in (ForwardMode.DECODE, ForwardMode.VERIFY)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One DECODE/VERIFY step: float32 logits [T, vocab]; writes every layer's K/V at ``out_cache_loc``.

        Raises:
            ValueError: a PREFILL batch (outside the spec's coverage) or no KV pool yet.
        """
        if batch.forward_mode is ForwardMode.PREFILL:
            raise ValueError("the reference plugin serves DECODE and VERIFY steps, not PREFILL")
        if self.pool is None:
            raise ValueError("the KV pool is not ready; the runtime calls on_kv_pool_ready before any step")
        self._routing: list[torch.Tensor] = []
        x = self._embed(batch.input_ids)
        cos = self.cos_table[batch.positions].to(self.dtype)
        sin = self.sin_table[batch.positions].to(self.dtype)
        for i, w in enumerate(self.layers):
            x = x + self._attention(i, w, rms(x, w.ln_in, self.eps), cos, sin, batch)
            h = rms(x, w.ln_post, self.eps)
            x = x + (self._moe(w, h) if w.router_t is not None else self._dense(w, h))
        local = (rms(x, self.final_norm, self.eps) @ self.lm_head_t).float()
        return self._gather_logits(local)[:, :self.vocab]

    def last_routing(self) -> list[torch.Tensor]:
        """Optional hook the contract suite reads: the latest step's top-k expert ids per MoE layer (int64 [T, k],
        layer order), so that only rows whose routing really differs from the general path's are excused."""
        return list(getattr(self, "_routing", []))

    # -- pieces (broken variants override some) --------------------------------------------------------------

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.embed[ids]
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed.shape[0])
        x = self.embed[torch.where(mine, local, torch.zeros_like(local))] * mine[:, None].to(self.dtype)
        return self._sum_ranks(x)

    def _attention(self, layer: int, w: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   batch: ForwardBatch) -> torch.Tensor:
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
        o = self._paged_attention(layer, q, batch).reshape(t, nq) @ w.o_t
        o = self._sum_ranks(o)
        return o if w.o_bias is None else o + w.o_bias

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
        gate_up = h @ w.gate_up_t  # type: ignore[operator]
        if w.gate_up_bias is not None:
            gate_up = gate_up + w.gate_up_bias
        gate, up = gate_up.chunk(2, dim=-1)
        out = self._sum_ranks((F.silu(gate) * up) @ w.down_t)
        return out if w.down_bias is None else out + w.down_bias

    def _moe(self, w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        c = self.config
        probs = torch.softmax((h @ w.router_t).float(), dim=-1)
        top_w, top_ids = probs.topk(c.num_experts_per_tok, dim=-1)
        self._routing.append(top_ids)
        if c.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        combine = torch.zeros_like(probs, dtype=self.dtype).scatter(1, top_ids, top_w.to(self.dtype))  # [T, E]
        gate, up = torch.matmul(h[None], w.experts_w13_t).chunk(2, dim=-1)  # [E, T, I_l] each
        y = torch.matmul(F.silu(gate) * up, w.experts_w2_t)  # [E, T, H]
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
