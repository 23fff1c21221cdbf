"""Kind 6, hygiene: edits the ForwardBatch's tensors in place, keeps growing what it holds, or allocates a
workspace outside the binding's accounted allocator.
"""

from __future__ import annotations

from typing import Any

import torch
from lowlat.forward_batch import ForwardBatch

from lowlat_contract.plugins.mutants._base import HookedReference


class WritesNextTokensIntoInput(HookedReference):
    """writes_next_tokens_into_input: a fused greedy sampler writes each row's argmax into ``batch.input_ids``
    (meant for the next step's static input buffer). The logits are right; the batch is not the caller's any
    more. Trigger: any step (input_ids after the call differ)."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        logits = super().forward(batch)
        batch.input_ids.copy_(logits.argmax(dim=-1))
        return logits


class ExtendLensAsScratch(HookedReference):
    """extend_lens_as_scratch: computes the query offsets (cu_seqlens) in place in ``batch.extend_lens``, which
    the engine's VERIFY acceptance reads after the step; DECODE/VERIFY forwards never read it, so the logits
    and K/V are right. Trigger: any step with B >= 2 (extend_lens after the call differ)."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._query_offsets = batch.extend_lens.cumsum_(0)
        return super().forward(batch)


class KeepsHiddenStates(HookedReference):
    """keeps_hidden_states: a debug hook left on appends every step's final hidden states to a list (memory
    grows by T * H per step, forever). Trigger: N steps; the plugin holds N more tensors."""

    def _gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        self.__dict__.setdefault("_trace", []).append(local)
        return super()._gather_logits(local)


class UnaccountedWorkspace(HookedReference):
    """unaccounted_workspace: the gathered-KV workspace ([max_batch, max_context, Hkv, D] float32 for K and for V)
    is ``torch.empty`` on the device instead of ``binding.alloc_workspace``, so the KV pool is sized as if it
    did not exist. Trigger: after build, plugin-held bytes exceed ``binding.workspace_bytes`` by the buffer."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        e = binding.engine_config
        shape = (e.max_batch_size + 1, e.max_context_len, self.local_kv_heads, self.head_dim)
        self._ws = [torch.empty(shape, dtype=torch.float32, device=self.device) for _ in range(2)]

    def _gather_kv(self, layer: int, slots: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, length = slots.shape
        out = []
        for buf, ws in zip((self.pool.k_buffers[layer], self.pool.v_buffers[layer]), self._ws):
            view = ws[:b, :length]
            view.copy_(buf[slots])
            out.append(view.transpose(1, 2).repeat_interleave(group, dim=1))
        return out[0], out[1]
