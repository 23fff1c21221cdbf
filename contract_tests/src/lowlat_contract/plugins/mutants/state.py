"""Kind 3, state across calls: something computed on one call is reused on a later one where it no longer holds.
"""

from __future__ import annotations

from typing import Any

import torch
from lowlat.forward_batch import ForwardBatch

from lowlat_contract.plugins.mutants._base import HookedReference, context_lens


class RopeCachedPerShape(HookedReference):
    """rope_cached_per_shape: the RoPE rows are gathered once per token count T (a "static buffer" meant for
    graph capture) and reused by every later eager step of the same T, with the first step's positions.
    Trigger: two steps of the same T at different positions (any decode loop)."""

    def _cos_sin(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        cache: dict[int, Any] = self.__dict__.setdefault("_rope_rows", {})
        t = batch.input_ids.shape[0]
        if t not in cache:
            cache[t] = super()._cos_sin(batch)
        return cache[t]


_PACKED: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}


class PackedWeightsCachedByName(HookedReference):
    """packed_weights_cached_by_name: packed (contiguous, transposed) o_proj weights are kept in a module-level
    cache keyed by parameter name and shape, so every later build in the process, another engine or a reload
    with other weights, gets the first build's. Trigger: a second engine with other weights in one process."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        for i, w in enumerate(self.layers):
            key = (f"model.layers.{i}.self_attn.o_proj.weight", tuple(w.o_t.shape))
            w.o_t = _PACKED.setdefault(key, w.o_t.contiguous())


class WorkspaceSizedAtFirstCall(HookedReference):
    """workspace_sized_at_first_call: the split-KV partials workspace is sized on the first step from its longest
    context (rounded up to 64 tokens) and never grown; keys past its capacity are silently dropped.
    Trigger: a first step with short contexts, then a context longer than 64 (e.g. 65) on the same plugin."""

    def _visible(self, batch: ForwardBatch, length: int) -> torch.Tensor:
        if getattr(self, "_capacity", None) is None:
            self._capacity = -(-int(batch.seq_lens.max()) // 64) * 64
        return super()._visible(batch, length) & (torch.arange(length, device=self.device)[None, :] < self._capacity)


class TunedAfter16Calls(HookedReference):
    """tuned_after_16_calls: an autotuner times the default split-KV config (exact) for the first 16 calls of
    each token count T, then switches to the winner, whose 32-token chunks use floor(ctx / 32) splits and drop
    the keys of the last partial chunk. Trigger: a 17th step of one T with a context > 32 not a multiple of 32."""

    def _visible(self, batch: ForwardBatch, length: int) -> torch.Tensor:
        vis = super()._visible(batch, length)
        calls: dict[int, int] = self.__dict__.setdefault("_calls", {})
        t = batch.input_ids.shape[0]
        if calls.get(t, 0) < 16 * len(self.layers):  # one _visible per layer and call
            calls[t] = calls.get(t, 0) + 1
            return vis
        ctx = context_lens(batch)
        limit = torch.where(ctx > 32, ctx // 32 * 32, ctx)
        return vis & (torch.arange(length, device=self.device)[None, :] < limit[:, None])


class HostLenFrozenAtCapture(HookedReference):
    """host_len_frozen_at_capture: attention runs over ``max(seq_lens)`` keys, read from ``seq_lens_cpu`` when
    the batch has it (eager) and else taken from ``prepare_for_capture`` (host side, where a sync is legal:
    the capture batch's lengths), which freezes it into the graph. Replays with longer contexts than at
    capture miss their newest keys. Trigger: a graph replay (seq_lens_cpu None) whose context exceeds the
    captured step's; eager is exact."""

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        self._frozen = int(batch.seq_lens.max())

    def _visible(self, batch: ForwardBatch, length: int) -> torch.Tensor:
        limit = max(batch.seq_lens_cpu) if batch.seq_lens_cpu is not None else getattr(self, "_frozen", length)
        return super()._visible(batch, length) & (torch.arange(length, device=self.device)[None, :] < limit)


class PageTableCache(HookedReference):
    """page_table_cache: each request row's page table (``req_to_token[row, ::page_size]``) is cached and
    refreshed only when that row's page count changes. Rows are recycled: a new request in a freed row with
    the same page count reads the previous request's pages.
    Trigger: free a request, give its row to a request whose pages differ (e.g. allocated in another order),
    same number of pages."""

    def _slots(self, batch: ForwardBatch) -> torch.Tensor:
        cache: dict[int, Any] = self.__dict__.setdefault("_tables", {})
        ps, r2t = self.pool.page_size, self.pool.req_to_token
        j = torch.arange(r2t.shape[1], device=self.device)
        out = []
        for row, n in zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist()):
            pages = -(-n // ps)
            if row not in cache or cache[row][0] != pages:
                cache[row] = (pages, r2t[row, ::ps].long().clone())
            out.append(cache[row][1][j // ps] + j % ps)
        return torch.stack(out)

