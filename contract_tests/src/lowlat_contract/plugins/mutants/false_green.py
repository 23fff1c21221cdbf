"""Kind 8, false-green attempts: a real defect plus a way of making the suite not look at it (a step refused
only under the suite's conditions, a skip raised from the forward, a spec the suite's machine never matches).
"""

from __future__ import annotations

import torch
from lowlat.runtime.forward_batch import ForwardBatch, ForwardMode

from lowlat_contract.plugins.mutants._base import HookedReference
from lowlat_contract.plugins.mutants.kv import VScaled


class RefusesPoisonedPool(HookedReference):
    """refuses_poisoned_pool: spills each token's K/V into the next slot (as broken_kv_slot), and its supports()
    has a "cache overflow guard" that refuses a step while any K in layer 0 exceeds 100 in magnitude. The
    suite's KV contract poisons free slots with 512.0, so that contract is skipped, not failed.
    Trigger: any step (the spill), with a pool that holds no value above 100."""

    def supports(self, batch: ForwardBatch) -> bool:
        return super().supports(batch) and not bool((self.pool.k_buffers[0].abs() > 100).any())

    def _store_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super()._store_kv(layer, (loc + 1).clamp(max=self.pool.num_slots - 1), k, v)
        super()._store_kv(layer, loc, k, v)


class SkipsLongVerify(HookedReference):
    """skips_long_verify: claims VERIFY up to 16 tokens, but its VERIFY kernel was never built for more than 2
    tokens per request and raises ``pytest.skip`` (a BaseException: the dispatcher does not turn it into a
    PluginStepError, pytest records a skip; an engine dies). Trigger: VERIFY with 3+ tokens per request."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.forward_mode is ForwardMode.VERIFY and batch.input_ids.shape[0] > 2 * batch.seq_lens.shape[0]:
            import pytest

            pytest.skip("VERIFY kernel not tuned for more than 2 tokens per request")
        return super().forward(batch)


class InterpreterOnlyVScaled(VScaled):
    """interpreter_only_v_scaled: v_scaled's defect, under a spec whose CPU platform counts only with
    TRITON_INTERPRET=1 (copied from a Triton vendor's spec though it runs plain torch). Run where that variable
    is unset, every contract that needs a model skips, and the suite exits 0.
    Trigger: the suite on a CPU without TRITON_INTERPRET (the defect itself shows at any step)."""
