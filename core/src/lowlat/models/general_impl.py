"""How the general forward runs: "reference", "fused" or "compiled" (``EngineConfig.general_impl``).

- ``reference``: the model's own ``forward`` (``lowlat.models.llama``), plain torch: the oracle that the
  differential tests and the contract suite compare with. The default.
- ``fused``: the same layers walked by ``LayeredForward`` with three core Triton kernels replacing the chains
  of element-wise torch ops: ``lowlat.kernels.rms_norm.fused_add_rms_norm`` (residual add + RMSNorm),
  ``lowlat.kernels.rope_kv.qk_norm_rope_kv_write`` (q/k norm + RoPE + KV write after the QKV GEMM) and
  ``lowlat.kernels.silu_mul.silu_and_mul``; MoE steps of at most 64 (token, expert) pairs run the experts as two
  expert-indexed GEMV kernels (``lowlat.kernels.moe_gemv``) after the reference router. GEMMs, the embedding,
  attention, larger MoE steps and the LM head are the ones the reference calls (the modules themselves, so TP
  all-reduces stay where they are).
- ``compiled``: ``LayeredForward`` again, its three pieces being the plain torch functions below compiled with
  ``torch.compile`` (inductor's generated kernels instead of ours), so one ``lowlat bench`` run compares the two
  ways of fusing on the same skeleton.

The skeleton carries the residual stream beside the normed activations (vLLM's ``fused_add_rms_norm``
layering): layer i runs ``h, r = add_norm(mlp_out_{i-1}, r)``, attention, ``h, r = add_norm(attn_out, r)``, the
MLP; the final norm takes the last MLP output and the residual. ``r`` is each time the dtype-rounded sum the
reference computes as ``x + ...``, so with the torch pieces (``TORCH_OPS``) the skeleton equals the reference
bit for bit, which ``core/tests/test_general_impl.py`` checks.

Constraint: everything is CUDA-graph capturable for DECODE/VERIFY (no host reads; static grids); PREFILL reads
the host lengths exactly as the reference does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from lowlat.distributed import all_reduce
from lowlat.forward_batch import ForwardBatch
from lowlat.kv_cache import KVPool
from lowlat.layers.attention import attend_cached, host_lens
from lowlat.layers.logits import compute_logits, logit_rows
from lowlat.layers.moe import route
from lowlat.layers.norm import rms_norm as torch_rms_norm
from lowlat.layers.rotary import apply_rotary

GENERAL_IMPLS = ("reference", "fused", "compiled")
_RECOMPILE_LIMIT = 64  # per piece: first layer (no residual) or not, T = 1 or symbolic, per model shapes
StepFn = Callable[[ForwardBatch, KVPool], torch.Tensor]


# -- the three pieces, in plain torch (the oracle of the kernels, and what "compiled" compiles) ---------------

def torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); with ``residual`` None: (rms_norm(x), x). x, residual [T, H]."""
    if residual is not None:
        x = x + residual
    return torch_rms_norm(x, weight, eps), x


def torch_rope_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                  out_cache_loc: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, num_q_heads: int,
                  num_kv_heads: int, head_dim: int, q_norm_weight: torch.Tensor | None,
                  k_norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``qk_norm_rope_kv_write``'s contract in the reference's own ops: returns q [T, Hq, D], writes k and v."""
    t, d = qkv.shape[0], head_dim
    q, k, v = qkv.split((num_q_heads * d, num_kv_heads * d, num_kv_heads * d), dim=-1)
    q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
    if q_norm_weight is not None and k_norm_weight is not None:
        q, k = torch_rms_norm(q, q_norm_weight, eps), torch_rms_norm(k, k_norm_weight, eps)
    cos, sin = cos_cache[positions].to(qkv.dtype), sin_cache[positions].to(qkv.dtype)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    # index_put_ (not write_kv's index_copy_, same result): inductor re-inplaces it into the mutated input, as
    # gpt-fast's ``k_cache[:, :, pos] = k`` relies on, instead of copying the whole buffer back.
    k_buffer.index_put_((out_cache_loc,), k.to(k_buffer.dtype))
    v_buffer.index_put_((out_cache_loc,), v.to(v_buffer.dtype))
    return q


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up [T, I], as ``DenseMLP`` computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@dataclass(frozen=True)
class StepOps:
    """The three pieces ``LayeredForward`` calls (signatures of the ``torch_*`` functions above)."""

    name: str
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope_kv: Callable[..., torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    moe_experts: Callable[..., torch.Tensor] | None = None  # (h, w13, w2, weights, ids) -> [T, H]; None: reference
    moe_max_pairs: int = 0  # use moe_experts when tokens * top_k <= this (a static shape, no host read)


TORCH_OPS = StepOps("torch", torch_add_rms_norm, torch_rope_kv, torch_silu_mul)


def triton_ops() -> StepOps:
    """The core Triton kernels behind the StepOps signatures (imports triton)."""
    from lowlat.kernels.moe_gemv import MAX_PAIRS, moe_experts_gemv
    from lowlat.kernels.rms_norm import fused_add_rms_norm, rms_norm
    from lowlat.kernels.rope_kv import qk_norm_rope_kv_write
    from lowlat.kernels.silu_mul import silu_and_mul

    def add_rms_norm(x, residual, weight, eps):  # type: ignore[no-untyped-def]
        if residual is None:
            return rms_norm(x, weight, eps), x
        return fused_add_rms_norm(x, residual, weight, eps)

    def rope_kv(qkv, positions, cos_cache, sin_cache, loc, k_buffer, v_buffer, hq, hkv, d, qn, kn, eps):  # type: ignore
        return qk_norm_rope_kv_write(qkv, positions, cos_cache, sin_cache, loc, k_buffer, v_buffer, num_q_heads=hq,
                                     num_kv_heads=hkv, head_dim=d, q_norm_weight=qn, k_norm_weight=kn, eps=eps)

    return StepOps("triton", add_rms_norm, rope_kv, silu_and_mul, moe_experts_gemv, MAX_PAIRS)


def compiled_ops(backend: str = "inductor") -> StepOps:
    """The torch pieces, each wrapped in ``torch.compile(fullgraph=True)`` with ``backend``.

    Shapes: dynamo's automatic dynamic shapes (the second token count seen recompiles with a symbolic T; a T of
    1 keeps its own specialisation), so the ~60 captured graph shapes cost about two compiles per piece instead
    of one per shape; the hidden sizes stay static. Layers share the compiled code: weights are arguments, not
    module attributes, so dynamo guards on their shapes only. The first call compiles (the graph runner's
    eager warm-up steps, never inside a capture). Raises dynamo's recompile limit (a process-wide setting) to at
    least 64, so a run never falls back to eager pieces without saying so.
    Rejected: compiling ``LlamaForCausalLM.forward`` whole: a graph break inside the layer loop (host lengths,
    the Triton attention launcher's Python checks) makes dynamo run the frame eagerly, and module guards would
    compile each layer separately.
    """
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # past the limit dynamo would run eagerly, silently
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), _RECOMPILE_LIMIT))

    def wrap(fn: Callable[..., object]) -> Callable[..., object]:
        return torch.compile(fn, backend=backend, fullgraph=True)

    return StepOps(f"compiled-{backend}", wrap(torch_add_rms_norm), wrap(torch_rope_kv),  # type: ignore[arg-type]
                   wrap(torch_silu_mul))  # type: ignore[arg-type]


# -- the skeleton --------------------------------------------------------------------------------------------

class LayeredForward:
    """``LlamaForCausalLM.forward`` (and Qwen3 / Qwen3-MoE) over ``ops``; same arguments, result and errors.

    Args:
        model: a built and loaded ``LlamaForCausalLM`` (or subclass); its modules and buffers are used as they are.
        ops: the three pieces (``TORCH_OPS``, ``triton_ops()``, ``compiled_ops()``).
    """

    def __init__(self, model: torch.nn.Module, ops: StepOps) -> None:
        from lowlat.models.llama import DenseMLP

        self.model, self.ops, self._dense = model, ops, DenseMLP

    def __call__(self, batch: ForwardBatch, kv_pool: KVPool) -> torch.Tensor:
        """Run one step: float32 logits [R, vocab] (R = T for DECODE/VERIFY, B for PREFILL); writes K/V."""
        m, ops = cast(torch.nn.Module, self.model), self.ops
        with torch.no_grad():
            m._check_pool(kv_pool)  # type: ignore[operator]
            lens = host_lens(batch)
            rot = m.model.rotary_emb
            if lens is not None and lens[0] and max(lens[0]) > rot.max_positions:
                raise ValueError(f"a sequence of {max(lens[0])} tokens exceeds the model's max_context_len="
                                 f"{rot.max_positions} (RoPE table size); build the model with a larger one")
            x: torch.Tensor = m.model.embed_tokens(batch.input_ids)
            t = x.shape[0]
            residual: torch.Tensor | None = None
            for layer in m.model.layers:
                attn = layer.self_attn
                qkv_proj = attn.qkv_proj
                h, residual = ops.add_rms_norm(x, residual, layer.input_layernorm.weight, layer.input_layernorm.eps)
                qn = attn.q_norm.weight if attn.q_norm is not None else None
                kn = attn.k_norm.weight if attn.k_norm is not None else None
                eps = attn.q_norm.eps if attn.q_norm is not None else 0.0
                i = attn.layer_id
                q = ops.rope_kv(qkv_proj(h), batch.positions, rot.cos_cache, rot.sin_cache, batch.out_cache_loc,
                                kv_pool.k_buffers[i], kv_pool.v_buffers[i], qkv_proj.local_heads,
                                qkv_proj.local_kv_heads, attn.head_dim, qn, kn, eps)
                o = attend_cached(q, layer_id=i, batch=batch, kv_pool=kv_pool, sm_scale=attn.sm_scale,
                                  backend=attn.backend, lens=lens)
                o = attn.o_proj(o.reshape(t, -1))
                post = layer.post_attention_layernorm
                h, residual = ops.add_rms_norm(o, residual, post.weight, post.eps)
                mlp = layer.mlp
                if isinstance(mlp, self._dense):
                    x = mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(h)))
                elif ops.moe_experts is not None and t * mlp.top_k <= ops.moe_max_pairs:  # decode-sized MoE
                    weights, ids = route(mlp.gate(h), mlp.top_k, mlp.norm_topk_prob, h.dtype)
                    ex = mlp.experts
                    x = all_reduce(ops.moe_experts(h, ex.w13_weight, ex.w2_weight, weights, ids), mlp.tp, mlp.site)
                else:  # SparseMoeBlock: router, grouped GEMMs and all-reduce as the reference runs them
                    x = mlp(h)
            norm = m.model.norm
            h, _ = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
            return compute_logits(logit_rows(h, batch), m.lm_head.weight, m.config.vocab_size, m.tp)


def make_general_step(model: torch.nn.Module, impl: str, *, compile_backend: str = "inductor") -> StepFn:
    """The step function ``(batch, kv_pool) -> float32 logits`` of ``impl`` for a loaded general model.

    Args:
        impl: "reference" (``model`` itself), "fused" (core Triton kernels; on CPU only under
            TRITON_INTERPRET=1) or "compiled" (``torch.compile`` of the torch pieces with ``compile_backend``).
    Raises:
        ValueError: an unknown impl, or "fused" on a CPU without TRITON_INTERPRET=1 (set before triton's import).
    """
    if impl == "reference":
        return cast(StepFn, model)
    if impl == "fused":
        ops = triton_ops()
        if next(model.parameters()).device.type == "cpu":
            from lowlat.kernels import rms_norm

            rms_norm.check_cpu_launch("general_impl='fused' on a CPU", rms_norm._rms_norm_kernel)
        return LayeredForward(model, ops)
    if impl == "compiled":
        return LayeredForward(model, compiled_ops(compile_backend))
    raise ValueError(f"general_impl must be one of {', '.join(GENERAL_IMPLS)}, got {impl!r}")
