"""The general forward of LlamaForCausalLM and Qwen3ForCausalLM (Qwen3 = Llama + per-head q/k RMSNorm).

Math and parameter layout: docs/agent-brief.md ("Parameter names and layouts", "Math"), matching HF
transformers' ``modeling_llama`` / ``modeling_qwen3``. This is the oracle every plugin is compared with, so it
favours plain, checkable torch over speed, while staying CUDA-graph capturable for DECODE and VERIFY.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from lowlat.config import ModelConfig
from lowlat.distributed import SINGLE, TPInfo
from lowlat.forward_batch import ForwardBatch
from lowlat.kv_cache import KVPool
from lowlat.layers.attention import host_lens, paged_attention, resolve_backend
from lowlat.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from lowlat.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from lowlat.layers.logits import compute_logits, logit_rows
from lowlat.layers.norm import RMSNorm
from lowlat.layers.rotary import RotaryEmbedding, apply_rotary
from lowlat.layers.weights import WeightTarget, load_hf_weights


class DenseMLP(nn.Module):
    """SwiGLU MLP: x [T, H] -> down(silu(gate(x)) * up(x)) [T, H]; gate_up column parallel, down row parallel.

    ``bias`` (Llama's ``mlp_bias``): gate, up and down carry biases (down's is added once, after the all-reduce).
    ``site``: down_proj's all-reduce call-site id (``2 * layer + 1``; ``lowlat.distributed.all_reduce``).
    """

    def __init__(self, hidden: int, inter: int, *, tp: TPInfo, dtype: torch.dtype, device: torch.device,
                 bias: bool = False, site: int | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, inter, ("gate_proj", "up_proj"), tp=tp,
                                                       dtype=dtype, device=device, bias=bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias, tp=tp, dtype=dtype, device=device, site=site)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def hf_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {**self.gate_up_proj.hf_targets(prefix), **self.down_proj.hf_targets(prefix + "down_proj.")}


class Attention(nn.Module):
    """Self-attention of one layer: fused QKV, optional q/k RMSNorm (Qwen3), RoPE, paged attention, o_proj."""

    def __init__(self, config: ModelConfig, layer_id: int, *, tp: TPInfo, dtype: torch.dtype,
                 device: torch.device, backend: str) -> None:
        super().__init__()
        c = config
        self.layer_id, self.backend, self.head_dim = layer_id, backend, c.head_dim
        self.sm_scale = c.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                                          bias=c.attention_bias, tp=tp, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias,
                                        tp=tp, dtype=dtype, device=device, site=2 * layer_id)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype, device=device) if c.has_qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype, device=device) if c.has_qk_norm else None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                kv_pool: KVPool, lens: tuple[list[int], list[int]] | None) -> torch.Tensor:
        """h [T, H] (normed) -> [T, H]; writes this layer's K/V at ``batch.out_cache_loc``."""
        t, d = h.shape[0], self.head_dim
        q, k, v = self.qkv_proj(h).split(self.qkv_proj.split_sizes, dim=-1)
        q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = paged_attention(q, k, v, layer_id=self.layer_id, batch=batch, kv_pool=kv_pool, sm_scale=self.sm_scale,
                            backend=self.backend, lens=lens)
        return self.o_proj(o.reshape(t, -1))

    def hf_targets(self, prefix: str) -> dict[str, WeightTarget]:
        out = {**self.qkv_proj.hf_targets(prefix), **self.o_proj.hf_targets(prefix + "o_proj.")}
        if self.q_norm is not None and self.k_norm is not None:
            out[prefix + "q_norm.weight"] = _replicated(self.q_norm.weight)
            out[prefix + "k_norm.weight"] = _replicated(self.k_norm.weight)
        return out


def _replicated(p: torch.Tensor) -> WeightTarget:
    return WeightTarget(tuple(p.shape), p.copy_)


class DecoderLayer(nn.Module):
    """x += attn(rmsnorm(x)); x += mlp(rmsnorm(x)). ``mlp`` is a DenseMLP or a SparseMoeBlock."""

    def __init__(self, config: ModelConfig, layer_id: int, mlp: nn.Module, *, tp: TPInfo, dtype: torch.dtype,
                 device: torch.device, backend: str) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.self_attn = Attention(config, layer_id, tp=tp, dtype=dtype, device=device, backend=backend)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                kv_pool: KVPool, lens: tuple[list[int], list[int]] | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv_pool, lens)
        return x + self.mlp(self.post_attention_layernorm(x))

    def hf_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {
            prefix + "input_layernorm.weight": _replicated(self.input_layernorm.weight),
            prefix + "post_attention_layernorm.weight": _replicated(self.post_attention_layernorm.weight),
            **self.self_attn.hf_targets(prefix + "self_attn."),
            **self.mlp.hf_targets(prefix + "mlp."),  # type: ignore[operator]
        }


class DecoderModel(nn.Module):
    """embed_tokens, layers, norm, and the shared RoPE tables (``rotary_emb``, buffers only)."""

    def __init__(self, config: ModelConfig, layers: list[DecoderLayer], rotary: RotaryEmbedding, *, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp, dtype=dtype,
                                                   device=device)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.rotary_emb = rotary


class LlamaForCausalLM(nn.Module):
    """General forward of Llama and Qwen3 (dense). Parameters are allocated empty on ``device`` and filled once
    by ``load_weights``.

    Args:
        config: the checkpoint's ModelConfig.
        dtype: parameter and activation dtype (the KV pool must use it too).
        device: where parameters live.
        tp: this rank's TPInfo (None = unsharded).
        max_context_len: longest sequence the engine runs (bounds the RoPE tables); None =
            ``config.max_position_embeddings``.
        attention_backend: "auto" (triton on CUDA, torch elsewhere), "torch" or "triton" (DECODE/VERIFY only).

    Attributes:
        local_kv_heads: KV heads per rank (the KV pool's ``num_kv_heads``); 1 when ``tp > num_key_value_heads``.

    Raises:
        ValueError: when the heads, kv heads, intermediate size do not divide by ``tp.size``, or for an
            unsupported rope_scaling type or attention backend.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                 tp: TPInfo | None = None, max_context_len: int | None = None,
                 attention_backend: str = "auto") -> None:
        super().__init__()
        device = torch.device(device)
        self.config, self.dtype, self.device, self.tp = config, dtype, device, tp or SINGLE
        self.attention_backend = resolve_backend(attention_backend, device)
        kw = {"tp": self.tp, "dtype": dtype, "device": device}
        layers = [DecoderLayer(config, i, self.make_mlp(i), backend=self.attention_backend, **kw)  # type: ignore
                  for i in range(config.num_hidden_layers)]
        rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                 max_context_len or config.max_position_embeddings, device=device)
        self.model = DecoderModel(config, layers, rotary, **kw)  # type: ignore[arg-type]
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied_to=tied, **kw)  # type: ignore
        self.local_kv_heads = layers[0].self_attn.qkv_proj.local_kv_heads if layers else 0

    def make_mlp(self, layer_id: int) -> nn.Module:
        """The MLP of decoder layer ``layer_id`` (dense here; Qwen3-MoE overrides it)."""
        c = self.config
        return DenseMLP(c.hidden_size, c.intermediate_size, tp=self.tp, dtype=self.dtype, device=self.device,
                        bias=c.mlp_bias, site=2 * layer_id + 1)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv_pool: KVPool) -> torch.Tensor:
        """Run one step.

        Writes every layer's K/V at ``batch.out_cache_loc`` and attends over each request's cached positions.
        DECODE and VERIFY read no host-side values (CUDA-graph capturable); PREFILL uses the host lengths
        (copied from the device when absent).

        Returns:
            float32 logits [R, vocab_size], full vocab on every rank; R = T for DECODE/VERIFY, B for PREFILL.
        Raises:
            ValueError: when ``kv_pool`` does not match the model (layers, local kv heads, head_dim, device), or a
                PREFILL sequence is longer than ``max_context_len``. DECODE/VERIFY positions are not checked
                (that would need a host sync); the runtime keeps them below ``max_context_len``.
        """
        self._check_pool(kv_pool)
        lens = host_lens(batch)
        if lens is not None and lens[0] and max(lens[0]) > self.model.rotary_emb.max_positions:
            raise ValueError(
                f"a sequence of {max(lens[0])} tokens exceeds the model's max_context_len="
                f"{self.model.rotary_emb.max_positions} (RoPE table size); build the model with a larger one"
            )
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.model.rotary_emb(batch.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch, kv_pool, lens)
        h = self.model.norm(logit_rows(x, batch))
        return compute_logits(h, self.lm_head.weight, self.config.vocab_size, self.tp)

    def _check_pool(self, kv_pool: KVPool) -> None:
        want = (self.config.num_hidden_layers, self.local_kv_heads, self.config.head_dim, self.device.type)
        got = (kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.device.type)
        if want != got:
            raise ValueError(
                f"KV pool has (layers, kv heads, head_dim, device) = {got}, but the model needs {want}; "
                "build it with num_kv_heads=model.local_kv_heads"
            )

    def hf_targets(self) -> dict[str, WeightTarget]:
        """HF checkpoint tensor name -> WeightTarget, for every tensor this rank loads."""
        out: dict[str, WeightTarget] = {**self.model.embed_tokens.hf_targets("model.embed_tokens."),
               "model.norm.weight": _replicated(self.model.norm.weight),
               **self.lm_head.hf_targets("lm_head.")}
        for i, layer in enumerate(self.model.layers):
            out.update(cast(DecoderLayer, layer).hf_targets(f"model.layers.{i}."))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named checkpoint tensors: fuse q/k/v and gate/up, shard for TP, cast to ``self.dtype``.

        Args:
            weights: ``(name, tensor)`` pairs, streamed one at a time (a dict's ``.items()`` works).
        Raises:
            lowlat.layers.weights.WeightLoadError: naming each missing, unexpected or duplicated tensor, or a
                tensor with the wrong shape (expected vs actual) or a non-float dtype.
        """
        load_hf_weights(self.hf_targets(), weights, model_name=self.config.architecture)
