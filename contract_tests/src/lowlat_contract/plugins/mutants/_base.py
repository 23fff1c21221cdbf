"""HookedReference: the reference plugin's forward cut at the seams where real kernels go wrong.

Every mutant is this class plus a few lines in one hook. HookedReference itself computes exactly what
``ReferenceForward`` computes (the same torch ops in the same order; ``tests/test_mutants.py`` checks that its
logits and K/V writes are bit-identical to the reference's and that it passes the suite as the ``control``
mutant), so any difference a mutant shows comes from its own lines.

Hooks (batch = the step's ForwardBatch):

- ``_rope_positions(batch)``: the positions RoPE rotates by (default ``batch.positions``);
- ``_cos_sin(batch)``: the RoPE cos/sin rows [T, D] in the model dtype;
- ``_qk_norm(layer, w, q, k)``: Qwen3's q/k RMSNorm;
- ``_kv_values(layer, k_raw, k, v)``: what is stored (default the rotated k and v);
- ``_store_kv(layer, loc, k, v)`` (the reference's): the K/V store;
- ``_slots(batch)``: [B, L] KV slots of each request's positions (default its ``req_to_token`` row);
- ``_split(q, b, n)`` / ``_merge(o, t)``: request-major query layout [B, Hq, n, D] and back;
- ``_visible(batch, length)`` (the reference's): the [T, L] attention mask;
- ``_attend(layer, queries, keys, vals, mask, batch)``: SDPA;
- ``_attention_out(batch, o)``: the attention output's TP reduction;
- ``_dense`` / ``_moe`` / ``_gather_logits`` (the reference's);
- ``sample(logits, info)`` (the reference's stage, plugin API 3): the sampled ids when ``batch.wants_ids``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.plugin import ModelSpec, Requirements

from lowlat_contract.plugins.reference import LayerWeights, ReferenceForward, neox_rotate, reference_specs, rms


class HookedReference(ReferenceForward):
    """ReferenceForward with its forward, attention and paged attention split into hooks (module docstring)."""

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """As ReferenceForward.forward, with RoPE rows from ``_cos_sin``."""
        if batch.forward_mode is ForwardMode.PREFILL:
            raise ValueError("the reference plugin serves DECODE and VERIFY steps, not PREFILL")
        if self.pool is None:
            raise ValueError("the KV pool is not ready; the runtime calls on_kv_pool_ready before any step")
        self._routing = []  # as ReferenceStep.forward: last_routing() is this step's (it grew with every call)
        x = self._embed(batch.input_ids)
        cos, sin = self._cos_sin(batch)
        for i, w in enumerate(self.layers):
            x = x + self._attention(i, w, rms(x, w.ln_in, self.eps), cos, sin, batch)
            h = rms(x, w.ln_post, self.eps)
            x = x + (self._moe(w, h) if w.router_t is not None else self._dense(w, h))
        local = (rms(x, self.final_norm, self.eps) @ self.lm_head_t).float()
        logits = self._gather_logits(local)[:, :self.vocab]
        return self.sample(logits, batch.sampling) if batch.wants_ids else logits  # type: ignore[arg-type]

    def _rope_positions(self, batch: ForwardBatch) -> torch.Tensor:
        return batch.positions

    def _cos_sin(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self._rope_positions(batch)
        return self.cos_table[pos].to(self.dtype), self.sin_table[pos].to(self.dtype)

    def _qk_norm(self, layer: int, w: LayerWeights, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if w.q_norm is not None and w.k_norm is not None:
            return rms(q, w.q_norm, self.eps), rms(k, w.k_norm, self.eps)
        return q, k

    def _kv_values(self, layer: int, k_raw: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

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
        q, k_raw = self._qk_norm(layer, w, q, k)
        q, k = neox_rotate(q, cos, sin), neox_rotate(k_raw, cos, sin)
        self._store_kv(layer, batch.out_cache_loc, *self._kv_values(layer, k_raw, k, v))
        o = self._paged_attention(layer, q, batch).reshape(t, nq) @ w.o_t
        o = self._attention_out(batch, o)
        return o if w.o_bias is None else o + w.o_bias

    def _attention_out(self, batch: ForwardBatch, o: torch.Tensor) -> torch.Tensor:
        return self._sum_ranks(o)

    def _slots(self, batch: ForwardBatch) -> torch.Tensor:
        return self.pool.req_to_token[batch.req_pool_indices].long()

    def _split(self, q: torch.Tensor, b: int, n: int) -> torch.Tensor:
        t, hq, d = q.shape
        return q.float().reshape(b, n, hq, d).transpose(1, 2)

    def _merge(self, o: torch.Tensor, t: int) -> torch.Tensor:
        return o.transpose(1, 2).reshape(t, o.shape[1], o.shape[3])

    def _attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                mask: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return F.scaled_dot_product_attention(queries, keys, vals, attn_mask=mask, scale=self.head_dim ** -0.5)

    def _gather_kv(self, layer: int, slots: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.pool.k_buffers[layer][slots].float().transpose(1, 2).repeat_interleave(group, dim=1)
        vals = self.pool.v_buffers[layer][slots].float().transpose(1, 2).repeat_interleave(group, dim=1)
        return keys, vals

    def _paged_attention(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, hq, d = q.shape
        b = batch.req_pool_indices.shape[0]
        n = t // b
        slots = self._slots(batch)
        length = slots.shape[1]
        keys, vals = self._gather_kv(layer, slots, hq // self.local_kv_heads)
        mask = self._visible(batch, length).reshape(b, 1, n, length)
        o = self._attend(layer, self._split(q, b, n), keys, vals, mask, batch)
        return self._merge(o, t).to(q.dtype)


def specs(build: str, archs: tuple[str, ...] | None = None, **requirements: Any) -> list[ModelSpec]:
    """The reference's specs with build path ``build``, only ``archs`` (default all), requirements replaced."""
    import dataclasses

    out = []
    for s in reference_specs(build):
        if archs is not None and s.architecture not in archs:
            continue
        req: Requirements = dataclasses.replace(s.requirements, **requirements) if requirements else s.requirements
        out.append(dataclasses.replace(s, requirements=req))
    return out


def context_lens(batch: ForwardBatch) -> torch.Tensor:
    """[T] int64: the context length (seq_lens after the step) of each new token's request."""
    return batch.seq_lens.long().repeat_interleave(batch.input_ids.shape[0] // batch.seq_lens.shape[0])
