"""The roofline of a decode step: the bytes it must read over the measured copy bandwidth.

Bytes a step of B requests with t new tokens each (T = B * t) must read at least once, in the model's dtype
(``dtype_bytes`` per element), TP size 1 (docs/benchmarks.md, "Roofline"):

- weights: per decoder layer the two RMSNorm weights, fused QKV ((Hq + 2 Hkv) * D * H), o_proj (H * Hq * D),
  q_norm/k_norm (D each, Qwen3), attention biases when present; a dense MLP's gate, up and down (3 * I * H);
  an MoE layer's router (E * H); and the final norm (H);
- experts: on an MoE layer, the union of experts the step's tokens select, times 3 * I_moe * H each. The union
  is measured from the real routing of the benchmark's inputs (``record_routing``), averaged over the input
  sets;
- kv: B * context * layers * 2 * Hkv * D (the cached K and V each request attends over);
- embed: the T embedding rows the step gathers (T * H);
- lm_head: V * H.

Left out, all under 1 % at the benchmark's shapes: the K/V of the new tokens (written, then read back), the
activations, and the float32 logits written (R * V * 4 bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from lowlat.config import ModelConfig


@dataclass(frozen=True)
class StepBytes:
    """Bytes one step must read, by kind (see the module docstring); ``total`` is their sum."""

    weights: float
    experts: float
    kv: float
    embed: float
    lm_head: float

    @property
    def total(self) -> float:
        return self.weights + self.experts + self.kv + self.embed + self.lm_head

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def layer_weight_elems(cfg: ModelConfig, layer: int) -> int:
    """Elements of decoder layer ``layer``'s weights that every step reads (experts excluded, router included)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    n = 2 * h + (q + 2 * kv) * h + h * q
    if cfg.has_qk_norm:
        n += 2 * d
    if cfg.attention_bias:
        n += q + 2 * kv + h
    if cfg.is_moe_layer(layer):
        n += cfg.num_experts * h
    else:
        n += 3 * cfg.intermediate_size * h
    return n


def expert_elems(cfg: ModelConfig) -> int:
    """Elements of one expert (gate, up and down: 3 * moe_intermediate_size * hidden_size); 0 for dense models."""
    return 3 * cfg.moe_intermediate_size * cfg.hidden_size if cfg.is_moe else 0


def moe_layers(cfg: ModelConfig) -> list[int]:
    """Indices of the decoder layers with a sparse MoE block."""
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


def kv_elems_per_layer(cfg: ModelConfig, batch_size: int, context: int) -> int:
    """Elements of cached K plus V one layer reads: B * context * 2 * kv_heads * head_dim."""
    return batch_size * context * 2 * cfg.num_key_value_heads * cfg.head_dim


def step_bytes(cfg: ModelConfig, *, dtype_bytes: int, batch_size: int, tokens_per_req: int, context: int,
               experts_touched: Sequence[float] | None = None) -> StepBytes:
    """The bytes one step must read (module docstring).

    Args:
        cfg: the model (all ``num_hidden_layers`` layers count).
        dtype_bytes: bytes per element of weights and KV (2 for bfloat16).
        batch_size, tokens_per_req: B and t; T = B * t tokens.
        context: tokens cached per request before the step.
        experts_touched: per MoE layer (in ``moe_layers`` order), the number of distinct experts the step's
            tokens select (may be a mean over input sets). Required for MoE models.

    Raises:
        ValueError: an MoE model without ``experts_touched``, or with one entry per MoE layer missing.
    """
    n_layers = cfg.num_hidden_layers
    weights = sum(layer_weight_elems(cfg, i) for i in range(n_layers)) + cfg.hidden_size
    experts = 0.0
    if cfg.is_moe:
        layers = moe_layers(cfg)
        if experts_touched is None or len(experts_touched) != len(layers):
            got = "none" if experts_touched is None else len(experts_touched)
            raise ValueError(f"{cfg.architecture} has {len(layers)} MoE layers; experts_touched must give the "
                             f"distinct experts of each (got {got}); measure them with record_routing")
        experts = float(sum(experts_touched)) * expert_elems(cfg)
    kv = n_layers * kv_elems_per_layer(cfg, batch_size, context)
    embed = batch_size * tokens_per_req * cfg.hidden_size
    lm_head = cfg.vocab_size * cfg.hidden_size
    return StepBytes(weights=float(weights * dtype_bytes), experts=experts * dtype_bytes, kv=float(kv * dtype_bytes),
                     embed=float(embed * dtype_bytes), lm_head=float(lm_head * dtype_bytes))


def layer_bytes(cfg: ModelConfig, *, dtype_bytes: int, batch_size: int, context: int,
                experts_touched: Sequence[float] | None = None) -> float:
    """Mean bytes one decoder layer must read in a step: its weights, its touched experts and its KV."""
    n_layers = cfg.num_hidden_layers
    per_layer = sum(layer_weight_elems(cfg, i) for i in range(n_layers)) / n_layers
    if cfg.is_moe and experts_touched:
        per_layer += float(sum(experts_touched)) * expert_elems(cfg) / n_layers
    per_layer += kv_elems_per_layer(cfg, batch_size, context)
    return per_layer * dtype_bytes


def roofline_ms(nbytes: float, gb_per_s: float) -> float:
    """Milliseconds to move ``nbytes`` at ``gb_per_s`` (1e9 bytes per second)."""
    if gb_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {gb_per_s} GB/s")
    return nbytes / (gb_per_s * 1e9) * 1e3


# -- measuring the routing --------------------------------------------------------------------------------------


def topk_ids(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, E] router logits -> [T, top_k] selected expert ids (softmax in float32 then top-k, as HF routes)."""
    return torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1).indices


@contextmanager
def record_routing(model: torch.nn.Module, top_k: int) -> Iterator[list[list[int]]]:
    """Hook every lowlat ``SparseMoeBlock`` router of ``model``; yields a list that gets, per forward, the number
    of distinct experts each MoE layer selected (in layer order).

    Run forwards eagerly inside the ``with`` (hooks do not fire in CUDA-graph replays). The hooks are removed
    on exit.
    """
    from lowlat.layers.moe import SparseMoeBlock

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    seen: list[list[int]] = []
    current: list[int] = []

    def hook(_m: torch.nn.Module, _inp: object, out: torch.Tensor) -> None:
        current.append(int(torch.unique(topk_ids(out, top_k)).numel()))
        if len(current) == len(blocks):
            seen.append(list(current))
            current.clear()

    handles = [b.gate.register_forward_hook(hook) for b in blocks]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def mean_union(per_forward: list[list[int]]) -> list[float]:
    """Per-layer mean over forwards of the distinct experts (one list per forward, one entry per MoE layer)."""
    if not per_forward:
        raise ValueError("no routed forward was recorded")
    n = len(per_forward)
    return [sum(f[i] for f in per_forward) / n for i in range(len(per_forward[0]))]


def measure_routing(model: torch.nn.Module, top_k: int, forwards: Sequence[Callable[[], object]]) -> list[float]:
    """Run each of ``forwards`` eagerly with ``model``'s routers hooked; the per-MoE-layer mean union."""
    with record_routing(model, top_k) as seen, torch.inference_mode():
        for fn in forwards:
            fn()
    return mean_union(seen)
