"""Kind 5, masks and RoPE: the VERIFY causal mask wrong at one length, RoPE positions off at block boundaries."""

from __future__ import annotations

import torch
from lowlat.forward_batch import ForwardBatch, ForwardMode

from lowlat_contract.plugins.mutants._base import HookedReference, context_lens


class VerifyMaskAt3(HookedReference):
    """verify_mask_at_3: the k+1 == 3 VERIFY specialisation masks with ``j <= pos + 1`` (its row offset is one
    off), so each draft token also sees the next one. Trigger: VERIFY with 3 tokens per request."""

    def _visible(self, batch: ForwardBatch, length: int) -> torch.Tensor:
        if batch.forward_mode is not ForwardMode.VERIFY or batch.input_ids.shape[0] != 3 * batch.seq_lens.shape[0]:
            return super()._visible(batch, length)
        j = torch.arange(length, device=self.device)[None, :]
        return (j <= batch.positions[:, None] + 1) & (j < context_lens(batch)[:, None])


class RopePageStart(HookedReference):
    """rope_page_start: the kernel derives a token's RoPE position from (page index, offset) and takes the
    page index of the previous slot, so a token at a page's first position rotates as position p - 1.
    Trigger: a new token at p > 0 with p % page_size == 0."""

    def _rope_positions(self, batch: ForwardBatch) -> torch.Tensor:
        p = batch.positions
        return torch.where((p > 0) & (p % self.pool.page_size == 0), p - 1, p)


class RopeBlock64(HookedReference):
    """rope_block64: RoPE rows are loaded in blocks of 64 positions and the block base is computed from p - 1,
    so a token at a multiple of 64 (64, 128, ...) rotates as p - 64. Trigger: a new token at p = 64."""

    def _rope_positions(self, batch: ForwardBatch) -> torch.Tensor:
        p = batch.positions
        return torch.where((p > 0) & (p % 64 == 0), p - 64, p)
