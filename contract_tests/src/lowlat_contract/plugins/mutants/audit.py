"""Kinds 10-15, from the outside audit of suite 0.3 (issue 14: "more will be tried against the suite from
outside"): defects of kinds the first campaign did not try. Each is the reference plus a few lines.

- kind 10, model dimensions the tiny presets never take: a third layer, a vocabulary or an intermediate size
  that is not a multiple of a kernel tile;
- kind 11, value range: right for the tiny presets' small activations, wrong for large attention scores;
- kind 12, side effects the oracle cannot see by comparing the two paths: a shared parameter edited in place,
  a workspace or a leak that the forward object does not reach;
- kind 13, a defect on TP rank 1 only, outside out_cache_loc;
- kind 14, request rows and pages as serving hands them out: rows past coverage's batch, unsorted rows,
  recycled pages that are not zero, contexts at an exact page multiple at batch > 1;
- kind 15, state that surfaces only after ~200 calls of one plugin instance.
"""

from __future__ import annotations

from typing import Any

import torch
from lowlat.forward_batch import ForwardBatch

from lowlat_contract.plugins.mutants._base import HookedReference, context_lens
from lowlat_contract.plugins.reference import MAX_TOKENS


class Layer2ReadsLayer0OProj(HookedReference):
    """layer2_reads_layer0_o_proj: the per-layer weight descriptors are a ring of two (double-buffered
    prefetch) indexed ``i % 2``, so layer 2 (and 4, ...) runs layer i-2's o_proj. Every 2-layer model is exact.
    Trigger: a model with 3 or more layers."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        for i, w in enumerate(self.layers):
            if i >= 2:
                w.o_t = self.layers[i % 2].o_t


class VocabTailTileDropped(HookedReference):
    """vocab_tail_tile_dropped: the LM-head kernel's grid is ``vocab // 128`` column tiles (floor), so the
    logits of the last partial tile stay at their zero initialisation. Exact when the (per-rank) vocabulary
    is a multiple of 128 (the tiny presets' 512). Trigger: a vocabulary of 500."""

    TILE = 128

    def _gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        full = local.shape[1] // self.TILE * self.TILE
        if full != local.shape[1]:
            local = local.clone()
            local[:, full:] = 0.0
        return super()._gather_logits(local)


class MlpKTailDropped(HookedReference):
    """mlp_k_tail_dropped: the down projection's K loop runs ``I // 64`` chunks of 64 (floor), so the last
    ``I % 64`` intermediate channels never reach the output. Exact when the intermediate size is a multiple of
    64 (the tiny presets' 128). Trigger: an intermediate size of 80."""

    CHUNK = 64

    def _dense(self, w: Any, h: torch.Tensor) -> torch.Tensor:
        gu = h @ w.gate_up_t
        if w.gate_up_bias is not None:
            gu = gu + w.gate_up_bias
        gate, up = gu.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        k = act.shape[1] // self.CHUNK * self.CHUNK or act.shape[1]
        out = self._sum_ranks(act[:, :k] @ w.down_t[:k])
        return out if w.down_bias is None else out + w.down_bias


class SoftmaxWithoutMax(HookedReference):
    """softmax_without_max: attention computes ``exp(s) / sum(exp(s))`` without subtracting the row maximum, which
    is exact until a score passes ~88 (float32 exp overflows: inf / inf = NaN). The tiny presets' scores stay
    below 10. Trigger: attention scores scaled up (q/k weights x 16: scores x 256)."""

    def _attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                mask: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s = (queries @ keys.transpose(-1, -2)) * self.head_dim ** -0.5
        p = torch.exp(s.masked_fill(~mask, float("-inf")))
        return (p @ vals) / p.sum(dim=-1, keepdim=True)


class SoftmaxWithoutMaxBf16(SoftmaxWithoutMax):
    """softmax_without_max_bf16: softmax_without_max in a bfloat16 engine. There the large-score check's bound
    is widened by the step's measured conditioning (``conditioning.py``: two correct bfloat16 answers differ by
    several units of a logit at such scores), so this proves the widening keeps the check's teeth: exp
    overflows past 88 in bfloat16 as in float32 (inf / inf = NaN). Trigger: scaled attention scores, bfloat16."""


class DriftsFinalNorm(HookedReference):
    """drifts_final_norm: the fused residual + final-norm kernel is handed the final norm's weight as its
    in/out scale buffer and rescales it in place on every call (x (1 + 2^-20), below any tolerance per step).
    The weight is the general model's own tensor, so both paths drift together and every comparison between
    them agrees; the engine's model is damaged a little more each step (1% after ~10^4 steps).
    Trigger: any step (a parameter differs after the call)."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        out = super().forward(batch)
        self.final_norm.mul_(1.0 + 2.0 ** -20)
        return out


class Rank1SpillsNextSlot(HookedReference):
    """rank1_spills_next_slot: on TP rank 1 only, the K/V store's tail loop runs one row too far: each request's
    last new token is also written into the slot after it (free: the next step overwrites it); rank 0 and TP 1
    are exact, and no step's logits change. Trigger: tp_size 2, K/V slots written outside out_cache_loc on
    rank 1."""

    def _store_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super()._store_kv(layer, loc, k, v)
        if self.tp_rank == 1:
            nxt = loc + 1
            tail = ~torch.isin(nxt, loc) & (nxt < self.pool.num_slots)  # a request's last token: no own slot after
            super()._store_kv(layer, nxt[tail], k[tail], v[tail])


class TunedAfter200Calls(HookedReference):
    """tuned_after_200_calls: a global warm-up of 200 calls (an autotuner timing candidates on live steps, exact
    while it measures), then the winner: split-KV in 32-token chunks with floor(ctx / 32) splits, dropping the
    keys of the last partial chunk. Trigger: a 201st call with a context > 32 not a multiple of 32."""

    WARMUP = 200

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._calls = getattr(self, "_calls", 0) + 1
        return super().forward(batch)

    def _visible(self, batch: ForwardBatch, length: int) -> torch.Tensor:
        vis = super()._visible(batch, length)
        if getattr(self, "_calls", 0) <= self.WARMUP:
            return vis
        ctx = context_lens(batch)
        limit = torch.where(ctx > 32, ctx // 32 * 32, ctx)
        return vis & (torch.arange(length, device=self.device)[None, :] < limit[:, None])


class RowsAboveCoverageAlias(HookedReference):
    """rows_above_coverage_alias: a per-row page-table cache has a fixed 32 rows (twice coverage's batch, thought
    ample), not the engine's max_batch_size, and is indexed ``row % 32``: a request in row 32 or above reads
    the page table of row - 32. Every step whose rows are all below 32 is exact. Trigger: a request in row
    >= 32 (serving: more than 32 requests admitted, some of them waiting or prefilling)."""

    ROWS = 2 * MAX_TOKENS

    def _slots(self, batch: ForwardBatch) -> torch.Tensor:
        return self.pool.req_to_token[batch.req_pool_indices % self.ROWS].long()


class LengthFromLastRow(HookedReference):
    """length_from_last_row: the kernel's key loop runs to the last request's length, as if the scheduler sorted
    rows by ascending length; a longer request before a shorter one loses its newest keys. Trigger: a step
    whose last request is not the longest (rows not sorted by length)."""

    def _visible(self, batch: ForwardBatch, length: int) -> torch.Tensor:
        last = batch.seq_lens[-1].long()
        return super()._visible(batch, length) & (torch.arange(length, device=self.device)[None, :] < last)


class LastPageLenModulo(HookedReference):
    """last_page_len_modulo: the batched kernel (B > 1; B == 1 has a kernel of its own) computes the last page's
    fill as ``seq_len % page_size``, 0 instead of page_size at an exact multiple, and drops that whole page.
    Trigger: B >= 2 with a request whose length after the step is a multiple of the page size."""

    def _visible(self, batch: ForwardBatch, length: int) -> torch.Tensor:
        vis = super()._visible(batch, length)
        if batch.seq_lens.shape[0] < 2:
            return vis
        ps = self.pool.page_size
        ctx = context_lens(batch)
        pages = (ctx + ps - 1) // ps
        limit = (pages - 1) * ps + ctx % ps
        return vis & (torch.arange(length, device=self.device)[None, :] < limit[:, None])


class StaleTailOfReusedPage(HookedReference):
    """stale_tail_of_reused_page: the kernel reads whole pages and treats a slot past the context as empty when
    its K row is all zero (true of a freshly zeroed pool); a page freed by one request and handed to another
    still holds the old K there, which the new request then attends to. Trigger: a page reused after a longer
    request freed it."""

    def _attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                mask: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        b, _, n, length = mask.shape
        ps = self.pool.page_size
        ctx = batch.seq_lens.long()
        j = torch.arange(length, device=self.device)
        in_pages = (j[None, :] >= ctx[:, None]) & (j[None, :] < (ctx[:, None] + ps - 1) // ps * ps)  # [B, L]
        written = keys[:, 0].abs().sum(dim=-1) != 0  # [B, L] (kv heads share a slot)
        stale = (in_pages & written)[:, None, None, :]
        return super()._attend(layer, queries, keys, vals, mask | stale, batch)


_SCRATCH: dict[tuple[str, tuple[int, ...]], list[torch.Tensor]] = {}


class GlobalScratchWorkspace(HookedReference):
    """global_scratch_workspace: the gathered-KV workspace ([max_batch + 1, max_context, Hkv, D] float32, K and V)
    comes from ``torch.empty`` into a module-level cache shared by every instance, not from
    ``binding.alloc_workspace``: the KV pool is sized as if it did not exist, and the forward object holds no
    reference to it. Trigger: live device memory after build exceeds ``binding.workspace_bytes``."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        e = binding.engine_config
        shape = (e.max_batch_size + 1, e.max_context_len, self.local_kv_heads, self.head_dim)
        self._key = (str(self.device), shape)
        _SCRATCH[self._key] = [torch.empty(shape, dtype=torch.float32, device=self.device) for _ in range(2)]

    def _gather_kv(self, layer: int, slots: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, length = slots.shape
        out = []
        for buf, ws in zip((self.pool.k_buffers[layer], self.pool.v_buffers[layer]), _SCRATCH[self._key]):
            view = ws[:b, :length]
            view.copy_(buf[slots])
            out.append(view.transpose(1, 2).repeat_interleave(group, dim=1))
        return out[0], out[1]


class LeaksIntoClassTrace(HookedReference):
    """leaks_into_class_trace: a debug trace left on appends every step's final hidden states to a list that is
    a class attribute (shared by instances), so nothing reachable from the forward object grows, yet the
    process's live tensors do, forever. Trigger: N steps; N more live tensors."""

    _trace: list[torch.Tensor] = []

    def _gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        type(self)._trace.append(local)
        return super()._gather_logits(local)
