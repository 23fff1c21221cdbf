"""Device-side sampling for the fused LM head: per-tile candidates and a cross-CTA merge tree, in one launch.

Semantics (those of ``lowlat.runtime.sampling.sample``, HF's order: temperature, top-k, then top-p), per row:

- ``temperature <= 0``: greedy, the lowest index among the maximal logits (``torch.argmax``).
- otherwise a Gumbel-max draw, ``argmax_i (logit_i / T + g_i)`` with ``g_i = -log(-log(u_i))`` and
  ``u_i = tl.rand(seed, offset + i)`` (Philox), over the allowed tokens:
  - without filtering (``top_k`` <= 0 or >= V and ``top_p`` >= 1, or no ``top_k``/``top_p`` tensors): all V
    tokens; exact softmax(logits / T) sampling.
  - with filtering, the allowed set is chosen among the ``C`` (= ``candidates``, 64 by default) most likely tokens,
    ordered by logit, ties by lower index:
    - top-k keeps every candidate whose logit is at least the k-th largest, so every token tied with the k-th
      is kept, as the reference does (``sub >= kth``), as long as the tie fits in the list: when the candidates
      from rank k to rank C are all tied, tied tokens past rank C are dropped;
    - top-p keeps, among those, each token whose more likely tokens' mass (in that order) is below ``top_p``.
      That mass is normalized over the top-k tokens when ``0 < top_k <= C`` (exactly as HF after top-k), and
      over the full vocabulary when top-k is off or ``top_k > C``. ``top_p >= 1`` keeps every top-k token.
  This equals the reference sampler in distribution whenever ``0 < top_k < C`` and fewer than ``C - top_k + 2``
  tokens share the k-th logit, or when top-k is off and the nucleus has at most C tokens; otherwise the nucleus
  is truncated to the C most likely tokens. The plugin therefore declares ``max_top_k = C // 2`` (a loss needs
  more than C/2 tokens tied exactly at the k-th logit) and top-p only with top-k (``specs.SAMPLING``).
- a row with a NaN or inf logit anywhere gets token -1 (plugin API 3's non-finite flag): each tile writes the
  greedy key ``BAD_KEY``, above every real key, for such a row, so the merge's max carries it to the root.

Callers advance ``offset`` by at least V per step so every step draws fresh noise.

How (two phases in one kernel):

1. Every LM-head program, after computing its [BLOCK_V] logits for each row, writes a record: the greedy key,
   the Gumbel winner's key, and with filtering its top-C keys (``tl.topk``) plus ``max`` and
   ``sum(exp((l - max) / T))`` over its tile. A key packs (value, index) into an int64 that orders by value, then
   by lower index, so max() is argmax with torch's tie-break.
2. Records are merged in a tree of fan-in ``F``: the last program to finish in a group of F records (atomic
   ticket per group, reset by that program) merges them into one record of the next level; the program that
   produces the root record picks each row's token. Only ``ceil(log_F(tiles))`` small merges sit on the
   critical path, and no program waits for another (safe for any grid size and under the interpreter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

NEG_KEY = tl.constexpr(-(2**63) + 1)  # below every packed key of a real value
BAD_KEY = tl.constexpr(2**63 - 1)  # above every packed key (index >= 0): the row's tile held NaN or inf


@triton.jit
def pack_key(value, index):
    """float32 ``value`` and int ``index`` (< 2**31) -> int64 key, ordered by value then by lower index."""
    b = value.to(tl.int32, bitcast=True)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)  # order-preserving map of float bits to signed ints
    return (b.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def key_index(key):
    """The index packed in ``key`` (int32)."""
    return 0x7FFFFFFF - key.to(tl.int32)


@triton.jit
def key_value(key):
    """The float32 value packed in ``key``."""
    b = (key >> 32).to(tl.int32)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def top_keys(keys, CAND: tl.constexpr, BITONIC: tl.constexpr):
    """The CAND largest keys of each row of [R, N] ``keys``, descending, as [R, CAND].

    ``BITONIC``: ``tl.topk`` (bitonic top-k, the GPU path). Otherwise CAND rounds of max-and-remove (keys are
    unique but for NEG_KEY), used under the interpreter, where ``tl.topk``'s ``xor_sum`` reductions run a Python
    combine function per element and take seconds.
    """
    if BITONIC:
        return tl.topk(keys, CAND)
    else:
        c = tl.arange(0, CAND)[None, :]
        out = tl.full([keys.shape[0], CAND], NEG_KEY, tl.int64)
        for i in tl.static_range(CAND):
            m = tl.max(keys, axis=1)
            out = tl.where(c == i, m[:, None], out)
            keys = tl.where(keys == m[:, None], NEG_KEY, keys)
        return out


@triton.jit
def gumbel_noise(seed, offset):
    """-log(-log(u)), u = tl.rand(seed, offset) in [0, 1) (u = 0 gives -inf); seed, offset int64, same shape."""
    u = tl.rand(seed, offset)
    return -tl.log(-tl.log(u))


@triton.jit
def tile_record(logits, offs_v, vmask, rows, row_ok, rec, temp_ptr, seed_ptr, offset_ptr,
                greedy_ptr, gumbel_ptr, max_ptr, sum_ptr, key_ptr,
                ROWS_C: tl.constexpr, CAND: tl.constexpr, SAMPLE: tl.constexpr, FILTER: tl.constexpr,
                BITONIC: tl.constexpr):
    """Write record ``rec`` for one tile. logits [BLOCK_V, ROWS_C] float32, offs_v [BLOCK_V] token ids."""
    idx = tl.broadcast_to(offs_v[:, None], logits.shape)
    keys = tl.where(vmask[:, None], pack_key(logits, idx), NEG_KEY)
    bad = vmask[:, None] & ((logits != logits) | (tl.abs(logits) == float("inf")))
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    tl.store(greedy_ptr + rec * ROWS_C + rows, tl.where(n_bad > 0, BAD_KEY, tl.max(keys, axis=0)))
    if SAMPLE == 2:
        t = tl.load(temp_ptr + rows, mask=row_ok, other=1.0)
        t = tl.where(t > 0.0, t, 1.0)
        seed = tl.load(seed_ptr + rows, mask=row_ok, other=0)
        off = tl.load(offset_ptr + rows, mask=row_ok, other=0)
        g = gumbel_noise(tl.broadcast_to(seed[None, :], logits.shape), off[None, :] + idx.to(tl.int64))
        skeys = tl.where(vmask[:, None], pack_key(logits / t[None, :] + g, idx), NEG_KEY)
        tl.store(gumbel_ptr + rec * ROWS_C + rows, tl.max(skeys, axis=0))
        if FILTER:
            lv = tl.where(vmask[:, None], logits, float("-inf"))
            m = tl.max(lv, axis=0)
            s = tl.sum(tl.exp((lv - m[None, :]) / t[None, :]), axis=0)
            tl.store(max_ptr + rec * ROWS_C + rows, m)
            tl.store(sum_ptr + rec * ROWS_C + rows, s)
            top = top_keys(tl.trans(keys), CAND, BITONIC)  # [ROWS_C, CAND], descending
            tl.store(key_ptr + (rec * ROWS_C + rows[:, None]) * CAND + tl.arange(0, CAND)[None, :], top)


@triton.jit
def merge_records(first, cnt, dst, rows, row_ok, temp_ptr, greedy_ptr, gumbel_ptr, max_ptr, sum_ptr, key_ptr,
                  ROWS_C: tl.constexpr, CAND: tl.constexpr, FAN_IN: tl.constexpr, SAMPLE: tl.constexpr,
                  FILTER: tl.constexpr, BITONIC: tl.constexpr):
    """Merge records ``first .. first + cnt - 1`` (written by other programs: loads bypass L1) into ``dst``."""
    j = tl.arange(0, FAN_IN)
    jm = j < cnt
    off = (first + j[:, None]) * ROWS_C + rows[None, :]
    g = tl.load(greedy_ptr + off, mask=jm[:, None], other=NEG_KEY, cache_modifier=".cg")
    tl.store(greedy_ptr + dst * ROWS_C + rows, tl.max(g, axis=0))
    if SAMPLE == 2:
        s = tl.load(gumbel_ptr + off, mask=jm[:, None], other=NEG_KEY, cache_modifier=".cg")
        tl.store(gumbel_ptr + dst * ROWS_C + rows, tl.max(s, axis=0))
        if FILTER:
            t = tl.load(temp_ptr + rows, mask=row_ok, other=1.0)
            t = tl.where(t > 0.0, t, 1.0)
            m = tl.load(max_ptr + off, mask=jm[:, None], other=float("-inf"), cache_modifier=".cg")
            z = tl.load(sum_ptr + off, mask=jm[:, None], other=0.0, cache_modifier=".cg")
            mm = tl.max(m, axis=0)
            z = tl.sum(tl.where(jm[:, None], z * tl.exp((m - mm[None, :]) / t[None, :]), 0.0), axis=0)
            tl.store(max_ptr + dst * ROWS_C + rows, mm)
            tl.store(sum_ptr + dst * ROWS_C + rows, z)
            f = tl.arange(0, FAN_IN * CAND)
            jf = f // CAND
            kptr = key_ptr + ((first + jf[None, :]) * ROWS_C + rows[:, None]) * CAND + (f % CAND)[None, :]
            keys = tl.load(kptr, mask=(jf < cnt)[None, :], other=NEG_KEY, cache_modifier=".cg")
            top = top_keys(keys, CAND, BITONIC)
            tl.store(key_ptr + (dst * ROWS_C + rows[:, None]) * CAND + tl.arange(0, CAND)[None, :], top)


@triton.jit
def pick_tokens(root, rows, row_ok, V, temp_ptr, topk_ptr, topp_ptr, seed_ptr, offset_ptr, tokens_ptr,
                greedy_ptr, gumbel_ptr, max_ptr, sum_ptr, key_ptr,
                ROWS_C: tl.constexpr, CAND: tl.constexpr, SAMPLE: tl.constexpr, FILTER: tl.constexpr):
    """Choose each row's token from the root record and store it (int64) to ``tokens_ptr``."""
    off = root * ROWS_C + rows
    greedy = tl.load(greedy_ptr + off, cache_modifier=".cg")
    tok = key_index(greedy)
    if SAMPLE == 2:
        t_in = tl.load(temp_ptr + rows, mask=row_ok, other=0.0)
        t = tl.where(t_in > 0.0, t_in, 1.0)
        sampled = key_index(tl.load(gumbel_ptr + off, cache_modifier=".cg"))
        if FILTER:
            c = tl.arange(0, CAND)
            keys = tl.load(key_ptr + (root * ROWS_C + rows[:, None]) * CAND + c[None, :], cache_modifier=".cg")
            ok = keys != NEG_KEY
            lv = key_value(keys)
            idx = key_index(keys)
            k = tl.load(topk_ptr + rows, mask=row_ok, other=0)
            p = tl.load(topp_ptr + rows, mask=row_ok, other=1.0)
            k_on = (k > 0) & (k < V)
            lv_ok = tl.where(ok, lv, float("-inf"))
            # the k-th largest logit (the last candidate's for k > C); ties with it are kept, as the reference does
            kth = tl.max(tl.where(c[None, :] == (tl.minimum(tl.maximum(k, 1), CAND) - 1)[:, None], lv_ok,
                                  float("-inf")), axis=1)
            in_k = ok & ((lv >= kth[:, None]) | (~k_on)[:, None])
            top = tl.max(lv_ok, axis=1)
            e = tl.where(in_k, tl.exp((lv - top[:, None]) / t[:, None]), 0.0)
            m_all = tl.load(max_ptr + off, cache_modifier=".cg")
            z_all = tl.load(sum_ptr + off, cache_modifier=".cg") * tl.exp((m_all - top) / t)
            z = tl.where(k_on & (k <= CAND), tl.sum(e, axis=1), z_all)
            keep = in_k & (((tl.cumsum(e, axis=1) - e) < p[:, None] * z[:, None]) | (p >= 1.0)[:, None])
            seed = tl.load(seed_ptr + rows, mask=row_ok, other=0)
            offs = tl.load(offset_ptr + rows, mask=row_ok, other=0)
            g = gumbel_noise(tl.broadcast_to(seed[:, None], keys.shape), offs[:, None] + idx.to(tl.int64))
            skeys = tl.where(keep, pack_key(lv / t[:, None] + g, idx), NEG_KEY)
            filtered = key_index(tl.max(skeys, axis=1))
            sampled = tl.where(k_on | (p < 1.0), filtered, sampled)
        tok = tl.where(t_in > 0.0, sampled, tok)
    tok = tl.where(greedy == BAD_KEY, -1, tok)
    tl.store(tokens_ptr + rows, tok.to(tl.int64), mask=row_ok)


def merge_tree_sizes(n_tiles: int, fan_in: int) -> tuple[int, int]:
    """(records, counters) of a merge tree over ``n_tiles`` leaves with fan-in ``fan_in``."""
    records, counters, n = n_tiles, 0, n_tiles
    while n > 1:
        n = triton.cdiv(n, fan_in)
        records += n
        counters += n
    return records, counters


@dataclass(frozen=True)
class LMHeadWorkspace:
    """Scratch of :func:`lowlat_nvidia_mega.kernels.lm_head.lm_head_sample` (fixed addresses: graph safe).

    ``block_v`` tokens per LM-head program (so ``tiles = ceil(vocab / block_v)``), ``candidates`` = C (a power
    of two <= block_v), ``fan_in`` of the merge tree. Per record (tiles + inner nodes) and row (padded to 8):
    ``greedy``/``gumbel`` int64 keys, ``row_max``/``row_sum`` float32, ``keys`` [records, 8, C] int64;
    ``counters`` int32, zero between launches.
    """

    max_rows: int
    vocab: int
    block_v: int
    candidates: int
    fan_in: int
    greedy: torch.Tensor
    gumbel: torch.Tensor
    row_max: torch.Tensor
    row_sum: torch.Tensor
    keys: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def allocate(cls, max_rows: int, vocab: int, device: torch.device | str, *, block_v: int = 128,
                 candidates: int = 64, fan_in: int = 8,
                 alloc: Callable[..., torch.Tensor] = torch.empty) -> LMHeadWorkspace:
        """Allocate with ``alloc(shape, dtype=..., device=...)`` (``torch.empty`` or an accounted equivalent).

        Raises:
            ValueError: max_rows not in [1, 8]; block_v, candidates or fan_in not a power of two >= 2;
                candidates > block_v.
        """
        if not 1 <= max_rows <= 8:
            raise ValueError(f"max_rows={max_rows} must be in [1, 8]: the LM head kernel serves at most 8 rows")
        for name, v in (("block_v", block_v), ("candidates", candidates), ("fan_in", fan_in)):
            if v < 2 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two >= 2")
        if candidates > block_v:
            raise ValueError(f"candidates={candidates} must be <= block_v={block_v}")
        if vocab < 1:
            raise ValueError(f"vocab={vocab} must be >= 1")
        records, n_counters = merge_tree_sizes(triton.cdiv(vocab, block_v), fan_in)

        def new(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return alloc(shape, dtype=dt, device=device)

        counters = new((max(1, n_counters),), torch.int32)
        counters.zero_()
        return cls(max_rows, vocab, block_v, candidates, fan_in,
                   greedy=new((records, 8), torch.int64), gumbel=new((records, 8), torch.int64),
                   row_max=new((records, 8), torch.float32), row_sum=new((records, 8), torch.float32),
                   keys=new((records, 8, candidates), torch.int64), counters=counters)

    @property
    def nbytes(self) -> int:
        """Bytes held by the workspace tensors."""
        return sum(t.nbytes for t in (self.greedy, self.gumbel, self.row_max, self.row_sum, self.keys,
                                      self.counters))
