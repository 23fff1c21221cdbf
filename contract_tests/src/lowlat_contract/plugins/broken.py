"""Deliberately broken plugins: the reference with one realistic bug each, and the contract that catches it.

Each claims the reference's specs (same requirements and coverage) and differs in one method:

=====================  ==========================================================  ===========================
plugin                 the bug                                                     caught by
=====================  ==========================================================  ===========================
broken_kv_slot         its K/V store also writes the slot after each new token's   kv_writes
                       (an off-by-one store bound), clobbering a slot it does not
                       own; its own logits stay right
broken_ignores_weight  never reads the last layer's post_attention_layernorm       weight_binding
                       weight (treats it as ones)
broken_verify          claims VERIFY but masks attention like DECODE: every new    forward_outputs (VERIFY)
                       token sees all of the step's tokens, including later ones
broken_dtype           returns logits in bfloat16 instead of float32               forward_outputs
broken_rank            supports() depends on the TP rank (refuses batches of more  fallback (TP ranks agree)
                       than one request on rank 1), which the dispatcher's
                       agreement absorbs; but its forward is rank-dependent too:
                       ranks other than 0 concatenate the vocab shards with their
                       own first, so the ranks' logits (and sampled tokens) differ
broken_input_edit      advances ``batch.positions`` in place after its step (a      shape_sweeps (inputs)
                       "helpful" update for the next step); its logits stay right
broken_late_state      after 100 calls per engine its workspace "wraps": the K it   long_run
                       stores is scaled by 1.01 (stale state surfacing late)
broken_bias            never adds the q/k/v bias (serves attention_bias=true        variants
                       checkpoints as if it had none)
broken_one_row         in steps of 8 or more tokens the last row's logits are       shape_sweeps (per-row bound)
                       off by 10% of their scale (excused in 0.2 as 1 row in 8)
broken_leak            keeps every step's hidden states in a list (memory that      long_run (memory)
                       grows with each call); its outputs stay right
=====================  ==========================================================  ===========================

None is registered by an installed distribution; ``lowlat_contract.fixtures.install_fixture_plugins``
exposes them (and the reference) as plugins in a site dir.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lowlat.runtime.forward_batch import ForwardBatch

from lowlat_contract.plugins.reference import ReferenceForward, SpecHooks, reference_specs


class KVSlotOffForward(ReferenceForward):
    """broken_kv_slot: stores K/V at ``out_cache_loc + 1`` as well (spill first, so its own slots stay right)."""

    def _store_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        spill = (loc + 1).clamp(max=self.pool.num_slots - 1)
        super()._store_kv(layer, spill, k, v)
        super()._store_kv(layer, loc, k, v)


class IgnoresWeightForward(ReferenceForward):
    """broken_ignores_weight: the last layer's post_attention_layernorm weight is replaced by ones at build."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        last = self.layers[-1]
        last.ln_post = torch.ones_like(last.ln_post)


class VerifyAsDecodeForward(ReferenceForward):
    """broken_verify: each new token sees its request's whole cache after the step (right for DECODE only)."""

    def _visible(self, batch: ForwardBatch, length: int) -> torch.Tensor:
        per_token = batch.seq_lens.repeat_interleave(batch.input_ids.shape[0] // batch.seq_lens.shape[0])
        return torch.arange(length, device=self.device)[None, :] < per_token[:, None]


class Bf16LogitsForward(ReferenceForward):
    """broken_dtype: returns bfloat16 logits."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return super().forward(batch).to(torch.bfloat16)


class RankDependentForward(ReferenceForward):
    """broken_rank: rank-dependent supports() (absorbed by the dispatcher) and rank-dependent logits (not)."""

    def supports(self, batch: ForwardBatch) -> bool:
        return super().supports(batch) and not (self.tp_rank == 1 and batch.seq_lens.shape[0] > 1)

    def _gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        order = [self.tp_rank] + [r for r in range(self.tp_size) if r != self.tp_rank]
        return torch.cat([parts[r] for r in order], dim=-1)


class InputEditForward(ReferenceForward):
    """broken_input_edit: advances positions (and seq_lens) in place after the step."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        out = super().forward(batch)
        batch.positions.add_(batch.tokens_per_req or 1)
        return out


class LateStateForward(ReferenceForward):
    """broken_late_state: from its 101st call on, the K it stores is scaled by 1.01."""

    calls = 0

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.calls += 1
        return super().forward(batch)

    def _store_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super()._store_kv(layer, loc, k * 1.01 if self.calls > 100 else k, v)


class NoBiasForward(ReferenceForward):
    """broken_bias: drops the q/k/v bias at build."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        for w in self.layers:
            w.qkv_bias = None


class OneRowForward(ReferenceForward):
    """broken_one_row: the last logit row of steps of 8+ tokens is off by 10% of its scale."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        out = super().forward(batch)
        if out.shape[0] >= 8:
            out[-1] += 0.1 * out[-1].abs().max().clamp_min(1.0)
        return out


class LeakForward(ReferenceForward):
    """broken_leak: keeps a copy of each step's embeddings forever."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        self.history: list[torch.Tensor] = []

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = super()._embed(ids)
        self.history.append(x.clone())
        return x


def build_leak(binding: Any) -> ReferenceForward:
    return LeakForward(binding)


def build_input_edit(binding: Any) -> ReferenceForward:
    return InputEditForward(binding)


def build_late_state(binding: Any) -> ReferenceForward:
    return LateStateForward(binding)


def build_bias(binding: Any) -> ReferenceForward:
    return NoBiasForward(binding)


def build_one_row(binding: Any) -> ReferenceForward:
    return OneRowForward(binding)


def build_kv_slot(binding: Any) -> ReferenceForward:
    return KVSlotOffForward(binding)


def build_ignores_weight(binding: Any) -> ReferenceForward:
    return IgnoresWeightForward(binding)


def build_verify(binding: Any) -> ReferenceForward:
    return VerifyAsDecodeForward(binding)


def build_dtype(binding: Any) -> ReferenceForward:
    return Bf16LogitsForward(binding)


def build_rank(binding: Any) -> ReferenceForward:
    return RankDependentForward(binding)


def _hooks(build: str) -> SpecHooks:
    return SpecHooks(lambda: reference_specs(f"{__name__}:{build}"))


KV_SLOT_HOOKS = _hooks("build_kv_slot")
IGNORES_WEIGHT_HOOKS = _hooks("build_ignores_weight")
VERIFY_HOOKS = _hooks("build_verify")
DTYPE_HOOKS = _hooks("build_dtype")
RANK_HOOKS = _hooks("build_rank")
INPUT_EDIT_HOOKS = _hooks("build_input_edit")
LATE_STATE_HOOKS = _hooks("build_late_state")
BIAS_HOOKS = _hooks("build_bias")
ONE_ROW_HOOKS = _hooks("build_one_row")
LEAK_HOOKS = _hooks("build_leak")
