"""Kind 1, shape-specific defects: right at most shapes, wrong at one batch size, VERIFY length, context length,
page size, dtype or TP size. Each class names its trigger; ``registry.py`` holds the shape that shows it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lowlat.forward_batch import ForwardBatch, ForwardMode

from lowlat_contract.plugins.mutants._base import HookedReference, context_lens
from lowlat_contract.plugins.reference import MAX_TOKENS, LayerWeights


class Batch5Tail(HookedReference):
    """batch5_tail: requests are processed in tiles of 4; with exactly 5 requests the remainder tile reads the
    previous tile's last page-table row, so request 4 attends over request 3's cache. Trigger: DECODE B == 5."""

    def _slots(self, batch: ForwardBatch) -> torch.Tensor:
        rows = batch.req_pool_indices
        if rows.shape[0] == 5:
            rows = rows[torch.tensor([0, 1, 2, 3, 3], device=rows.device)]
        return self.pool.req_to_token[rows].long()


class FullTileStrictMask(HookedReference):
    """full_tile_strict_mask: the specialised full-tile kernel (T == max_tokens) masks with ``j < pos``, so every
    token misses its own key. Trigger: a step of exactly 16 tokens (DECODE B == 16 or VERIFY 1 x 16)."""

    def _visible(self, batch: ForwardBatch, length: int) -> torch.Tensor:
        vis = super()._visible(batch, length)
        if batch.input_ids.shape[0] == MAX_TOKENS:
            vis = vis & (torch.arange(length, device=self.device)[None, :] != batch.positions[:, None])
        return vis


class VerifyTpr4Layout(HookedReference):
    """verify_tpr4_layout: the k+1 == 4 VERIFY kernel lays queries out token-major ([n, B]) where everything
    else is request-major, so with several requests tokens attend over other requests' caches.
    Trigger: VERIFY with 4 tokens per request and B >= 2."""

    def _split(self, q: torch.Tensor, b: int, n: int) -> torch.Tensor:
        if n != 4 or b < 2:
            return super()._split(q, b, n)
        t, hq, d = q.shape
        return q.float().reshape(n, b, hq, d).permute(1, 2, 0, 3)


class SplitKvDropsTail(HookedReference):
    """splitkv64_drops_tail / splitkv256_drops_tail: past ``CHUNK`` tokens of context the split-KV kernel uses
    ``context // CHUNK`` splits (floor, not ceil), so the keys of the last partial chunk are never reduced.
    Trigger: a context longer than CHUNK that is not a multiple of it (65, 100, 257, ...)."""

    CHUNK = 64

    def _visible(self, batch: ForwardBatch, length: int) -> torch.Tensor:
        ctx = context_lens(batch)
        limit = torch.where(ctx > self.CHUNK, ctx // self.CHUNK * self.CHUNK, ctx)
        return super()._visible(batch, length) & (torch.arange(length, device=self.device)[None, :] < limit[:, None])


class SplitKv256DropsTail(SplitKvDropsTail):
    """splitkv256_drops_tail: as splitkv64_drops_tail with 256-token chunks. Trigger: context > 256."""

    CHUNK = 256


class PageSize16Hardcoded(HookedReference):
    """page16_hardcoded: gathers keys as ``req_to_token[row, 16 * (j // 16)] + j % 16`` (page size 16 baked in:
    the first slot of each page plus the offset). Right for page sizes that are multiples of 16, wrong for the
    page sizes below 16 that the spec accepts (page_sizes=None). Trigger: page_size 8 (or 1, 4), context > 8."""

    def _slots(self, batch: ForwardBatch) -> torch.Tensor:
        rows = self.pool.req_to_token[batch.req_pool_indices].long()
        j = torch.arange(rows.shape[1], device=self.device)
        return rows[:, j // 16 * 16] + j % 16


class ContiguousPages(HookedReference):
    """contiguous_pages: reads a request's keys at ``req_to_token[row, 0] + j``, as if its pages were adjacent.
    Right while a request's pages are contiguous (a prompt prefilled alone is); wrong once decode growth gives
    it a page that is not next to its previous one (requests growing in the same steps interleave pages).
    Trigger: 2 requests at 15 tokens, then 3 DECODE steps (both cross into new pages)."""

    def _slots(self, batch: ForwardBatch) -> torch.Tensor:
        rows = self.pool.req_to_token[batch.req_pool_indices].long()
        return rows[:, :1] + torch.arange(rows.shape[1], device=self.device)


class Float16DoubleScale(HookedReference):
    """fp16_double_scale (the spec also declares float16): the float16 path pre-scales q by 1/sqrt(D) against
    overflow and SDPA scales again. Trigger: --lowlat-dtype float16, any step."""

    def _attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                mask: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.dtype == torch.float16:
            queries = queries * self.head_dim ** -0.5
        return super()._attend(layer, queries, keys, vals, mask, batch)


class Bf16GateUpSwapped(HookedReference):
    """bf16_gate_up_swapped: the bfloat16 MLP kernel reads the packed gate_up weight in the other order
    (silu(up) * gate). Trigger: --lowlat-dtype bfloat16 on a dense model, any step."""

    def _dense(self, w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        if self.dtype != torch.bfloat16:
            return super()._dense(w, h)
        up, gate = (h @ w.gate_up_t).chunk(2, dim=-1)  # type: ignore[operator]
        return self._sum_ranks((F.silu(gate) * up) @ w.down_t)


class Tp2VerifyNoReduce(HookedReference):
    """tp2_verify_no_reduce: the VERIFY attention kernel at TP > 1 fuses o_proj with the residual add and skips
    the all-reduce, so each rank keeps only its own heads' share. Trigger: tp_size 2, VERIFY (any length)."""

    def _attention_out(self, batch: ForwardBatch, o: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1 and batch.forward_mode is ForwardMode.VERIFY:
            return o
        return super()._attention_out(batch, o)


class Tp2MlpDoubleCount(HookedReference):
    """tp2_mlp_double_count: at TP > 1 the dense MLP output is all-reduced twice (once in the down-projection
    epilogue, once after), doubling it. Trigger: tp_size 2, any DECODE or VERIFY step."""

    def _dense(self, w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        out = super()._dense(w, h)
        return self._sum_ranks(out) if self.tp_size > 1 else out

