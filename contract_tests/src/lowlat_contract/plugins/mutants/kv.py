"""Kind 2, KV defects: a wrong K or V value, a slot off, a spill into a slot the step does not own, or missing
writes. Some leave the step's own logits right (the damage shows only later, or in another request).
"""

from __future__ import annotations

import torch
from lowlat.forward_batch import ForwardBatch, ForwardMode

from lowlat_contract.plugins.mutants._base import HookedReference


class KBeforeRope(HookedReference):
    """k_before_rope: the fused QKV kernel stores K before the rotation (it rotates only in registers).
    Trigger: any step (the cache holds unrotated keys; logits move too)."""

    def _kv_values(self, layer: int, k_raw: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        return k_raw, v


class VScaled(HookedReference):
    """v_scaled: the softmax scale 1/sqrt(D) is folded into V at the store as well as into the scores.
    Trigger: any step."""

    def _kv_values(self, layer: int, k_raw: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v * self.head_dim ** -0.5


class SlotMinusOne(HookedReference):
    """slot_minus_one: the store indexes ``out_cache_loc - 1`` (a 1-based slot table read as 0-based).
    Trigger: any step."""

    def _store_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super()._store_kv(layer, loc - 1, k, v)


class SpillSingleRequest(HookedReference):
    """spill_single_request: the B == 1 store kernel writes a vector of 2 slots and masks the second lane only
    for B > 1, so a lone request also writes the slot after its new token. Its logits stay right (that slot is
    free and the next step overwrites it). Trigger: DECODE or VERIFY with exactly 1 request."""

    def _store_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._batch_size == 1:
            super()._store_kv(layer, (loc[-1:] + 1).clamp(max=self.pool.num_slots - 1), k[-1:], v[-1:])
        super()._store_kv(layer, loc, k, v)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._batch_size = batch.req_pool_indices.shape[0]
        return super().forward(batch)


class SpillPageEnd(HookedReference):
    """spill_page_end: the store loop's bound check is per page and off by one, so a token stored in the last
    slot of a page also writes the next page's first slot, which may hold another request's position 0.
    Trigger: a new token at position p with p % page_size == page_size - 1."""

    def _store_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        ps = self.pool.page_size
        end = (loc + 1) % ps == 0
        spill = torch.where(end, (loc + 1).clamp(max=self.pool.num_slots - 1), loc)
        super()._store_kv(layer, spill, k, v)  # spill first: where there is none it rewrites loc
        super()._store_kv(layer, loc, k, v)


class VerifySpillsOneSlot(HookedReference):
    """verify_spills_one_slot: the VERIFY store loop runs to ``<= k+1`` and writes each request's last draft
    token's K/V into the slot after it too (free, so the logits stay right). Trigger: any VERIFY step."""

    def _store_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._verify_tokens:
            n = self._verify_tokens
            last = torch.arange(n - 1, loc.shape[0], n, device=loc.device)
            super()._store_kv(layer, (loc[last] + 1).clamp(max=self.pool.num_slots - 1), k[last], v[last])
        super()._store_kv(layer, loc, k, v)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        verify = batch.forward_mode is ForwardMode.VERIFY
        self._verify_tokens = batch.input_ids.shape[0] // batch.seq_lens.shape[0] if verify else 0
        return super().forward(batch)


class VerifyStoreAssumesContiguous(HookedReference):
    """verify_store_assumes_contiguous: the VERIFY store writes each request's k+1 tokens at consecutive slots
    from its first one's, so a step that crosses into a page not adjacent to the previous writes into another
    page (possibly another request's) and leaves its own slot stale.
    Trigger: VERIFY whose tokens cross a page boundary while pages interleave (2 requests at 14, 4 tokens)."""

    def _store_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._verify_tokens:
            n = self._verify_tokens
            first = loc.reshape(-1, n)[:, :1]
            loc = (first + torch.arange(n, device=loc.device)).reshape(-1)
        super()._store_kv(layer, loc, k, v)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        verify = batch.forward_mode is ForwardMode.VERIFY
        self._verify_tokens = batch.input_ids.shape[0] // batch.seq_lens.shape[0] if verify else 0
        return super().forward(batch)


class FirstRequestOnly(HookedReference):
    """first_request_only: the store grid is sized by tokens per request instead of tokens per step, so only
    the first request's K/V are written. Trigger: any step with B >= 2."""

    def _store_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        n = self._tokens_per_req
        super()._store_kv(layer, loc[:n], k[:n], v[:n])

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._tokens_per_req = batch.input_ids.shape[0] // batch.req_pool_indices.shape[0]
        return super().forward(batch)


class KHalvesSwappedAtPageEnd(HookedReference):
    """k_halves_swapped_at_page_end: the vectorised store's last row of a page takes the wrong lane and writes
    the two RoPE halves of K swapped. The step's own logits read the cache, so they move only a little.
    Trigger: a new token at position p with p % page_size == page_size - 1."""

    def _kv_values(self, layer: int, k_raw: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        end = ((self._loc + 1) % self.pool.page_size == 0)[:, None, None]
        a, b = k.chunk(2, dim=-1)
        return torch.where(end, torch.cat((b, a), dim=-1), k), v

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._loc = batch.out_cache_loc
        return super().forward(batch)
