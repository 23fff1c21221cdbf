"""Kind 8, false-green attempts: a real defect plus a way of making the suite not look at it (a step refused
only under the suite's conditions, a skip raised from the forward, a spec the suite's machine never matches).
"""

from __future__ import annotations

import torch
from lowlat.forward_batch import ForwardBatch, ForwardMode

from lowlat_contract.plugins.mutants._base import HookedReference
from lowlat_contract.plugins.mutants.kv import VerifySpillsOneSlot, VScaled


class RefusesPoisonedPool(VerifySpillsOneSlot):
    """refuses_poisoned_pool: verify_spills_one_slot's defect, plus a "cache overflow guard" in supports() that
    refuses a step while any K in layer 0 exceeds 100 in magnitude. The KV contract poisons free slots with
    512.0 and leaves them so; its VERIFY step, checked after the DECODE one, is then refused and skipped.
    Trigger: a VERIFY step on a pool that holds no value above 100 (the spill)."""

    def supports(self, batch: ForwardBatch) -> bool:
        return super().supports(batch) and not bool((self.pool.k_buffers[0].abs() > 100).any())


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


class HeadDim64OnlyVScaled(VScaled):
    """head_dim_64_only_v_scaled: v_scaled's defect, under a spec that (as docs/contract.md advises for kernels
    with a head_dim floor) accepts only head_dim 64 or 128. The guard refuses every tiny preset (head_dim 32),
    so without --lowlat-model every contract that needs a model skips, and the suite exits 0.
    Trigger: the suite without --lowlat-model (the defect itself shows at any step of a head_dim-64 model)."""
