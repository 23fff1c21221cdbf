"""MoE routing for at most 8 rows in one kernel: post-attention RMSNorm, router GEMV, float32 softmax, top-k,
renormalization, expert presence bitmap and per-expert 8-row tiles.

Routing semantics are HF ``Qwen3MoeSparseMoeBlock`` (and ``lowlat.layers.moe.route``): router logits are computed
in the activation dtype (``F.linear`` output, then rounded), ``softmax`` over all experts in float32, ``topk``,
division by the sum of the k weights when ``renormalize`` (``norm_topk_prob``), and a cast of the weights to the
activation dtype. Among equal probabilities the lower expert index wins (first-occurrence order), except that with
``route_keys`` (the default for 16-bit activations) equal float32 probabilities of different logits rank by logit; a
NaN probability ranks first (as in ``torch.topk``), so a row with a NaN or inf input is routed and comes out NaN.

One launch, grid ``(cdiv(E, E_BLOCK), T)``: program (i, r) serves router rows ``[i * E_BLOCK, (i + 1) * E_BLOCK)``
for the step's row r.

1. Before ``gdc_wait`` (PDL) every program loads its ``E_BLOCK`` router rows ([E_BLOCK, H], weights only).
2. After the wait it normalizes its row (``h = w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``; programs (0, r) also
   store ``h`` for the expert GEMMs) and writes its block of that row's router logits. One program per (block,
   row) rather than a loop over the rows in each program: the loop paid one dependent chain (the row's load, its
   norm, the dot, the store) per row, 13.1 µs at 8 rows against 6.8 at 1 (bench/results/2026-12-02-h200-mega-moe,
   call 4); the router rows are read once per row, from L2 after the first.
3. The last program to arrive (an atomic ticket, the CUDA "threadFenceReduction" pattern; the ticket resets itself
   for the next launch) computes softmax and top-k over all ``E`` logits of the step's rows (a tile of
   ``SEL_ROWS = next_pow2(T)`` rows, or ``MoEKernelConfig.route_min_rows`` if more, not the workspace's 8: at one
   row the selection took 3.8 of the kernel's 7.1 µs alone in a chain on an H100, the 8-row tile 0.8 µs of that;
   bench/results/2026-12-07-h100-mega-route), marks each selected expert in a presence mask, and gives every
   present expert a compact slot = the population count of present experts below it (an exclusive prefix sum; no
   sort). A slot is one tile of all (at most 8) rows:
   ``slot_weight[slot, r]`` is row r's routing weight for that expert, 0 for a row below ``SEL_ROWS`` that did not
   select it (rows from ``SEL_ROWS`` on are not written; every reader masks rows at or past T). It also writes the
   presence bitmap (32 experts per int32 word), ``row_slot[r, k]`` (the slot of row r's k-th expert, used by the
   combine; with ``MoEKernelConfig.route_gather``, the default, a ``tl.gather`` of the slot table, else a
   compare-and-sum over ``[SEL_ROWS, TOPK_PAD, E]``, which took 1.35 µs of the one-row selection on an H100 at the
   8-row tile), the top-k ids and weights, and the number of slots. The top-k is ``TOP_K`` sequential picks over
   the tile: a float max and an int min over the tied indices each (``_top_k_by_scores``), or with
   ``MoEKernelConfig.route_keys`` and 16-bit activations one int32 max of a (logit, index) key
   (``_top_k_by_keys``).

Memory ordering of the ticket: each program's stores, then a CTA barrier, then an ``acq_rel`` atomic (release for
the stores, acquire for the last program's loads, which bypass L1 with ``.cg``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_nvidia_mega.kernels.pdl import gdc_launch_dependents, gdc_wait
from lowlat_nvidia_mega.kernels.rounding import to_act

ROWS = 8  # every MoE kernel is specialized for at most 8 rows


@triton.jit
def moe_route_kernel(
    x_ptr, norm_w_ptr, gate_w_ptr,
    h_ptr, logits_ptr, topk_ids_ptr, topk_w_ptr, row_slot_ptr,
    slot_expert_ptr, slot_weight_ptr, num_slots_ptr, bitmap_ptr, counter_ptr,
    n_rows, H, E, eps, stride_x,
    TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr, E_BLOCK: tl.constexpr, E_PAD: tl.constexpr,
    H_PAD: tl.constexpr, ROWS_C: tl.constexpr, SEL_ROWS: tl.constexpr, BITS: tl.constexpr,
    HAS_NORM: tl.constexpr, RENORM: tl.constexpr, USE_PDL: tl.constexpr, GATHER: tl.constexpr,
    KEYS: tl.constexpr,
):
    pid = tl.program_id(0)
    r = tl.program_id(1)  # the row this program normalizes and routes (grid axis 1: one per row of the step)
    dtype = h_ptr.dtype.element_ty
    offs_h = tl.arange(0, H_PAD)
    mask_h = offs_h < H
    offs_e = pid * E_BLOCK + tl.arange(0, E_BLOCK)
    mask_e = offs_e < E
    # Pre-wait: the router rows are weights, written by no kernel of the step.
    wg = tl.load(gate_w_ptr + offs_e[:, None].to(tl.int64) * H + offs_h[None, :],
                 mask=mask_e[:, None] & mask_h[None, :], other=0.0)
    if HAS_NORM:
        nw = tl.load(norm_w_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    gdc_wait(USE_PDL)
    gdc_launch_dependents(USE_PDL)

    x = tl.load(x_ptr + r * stride_x + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        h = to_act(nw * to_act(x * rstd, dtype).to(tl.float32), dtype)
    else:
        h = to_act(x, dtype)
    if pid == 0:
        tl.store(h_ptr + r * H + offs_h, h, mask=mask_h)
    logit = to_act(tl.sum(wg.to(tl.float32) * h.to(tl.float32)[None, :], axis=1), dtype)
    logit = logit.to(tl.float32)
    tl.store(logits_ptr + r * E + offs_e, logit, mask=mask_e)

    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.atomic_xchg(counter_ptr, 0)
        _select_experts(logits_ptr, topk_ids_ptr, topk_w_ptr, row_slot_ptr, slot_expert_ptr, slot_weight_ptr,
                        num_slots_ptr, bitmap_ptr, n_rows, E, dtype,
                        TOP_K, TOPK_PAD, E_PAD, ROWS_C, SEL_ROWS, BITS, RENORM, GATHER, KEYS)


@triton.jit
def _select_experts(logits_ptr, topk_ids_ptr, topk_w_ptr, row_slot_ptr, slot_expert_ptr, slot_weight_ptr,
                    num_slots_ptr, bitmap_ptr, n_rows, E, dtype: tl.constexpr,
                    TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr, E_PAD: tl.constexpr, ROWS_C: tl.constexpr,
                    SEL_ROWS: tl.constexpr, BITS: tl.constexpr, RENORM: tl.constexpr, GATHER: tl.constexpr,
                    KEYS: tl.constexpr):
    rows = tl.arange(0, SEL_ROWS)  # the step's rows rounded up to a power of two, not the workspace's 8
    ee = tl.arange(0, E_PAD)
    kk = tl.arange(0, TOPK_PAD)
    row_ok = rows < n_rows
    valid = row_ok[:, None] & (ee < E)[None, :]
    lg = tl.load(logits_ptr + rows[:, None] * E + ee[None, :], mask=valid, other=float("-inf"),
                 cache_modifier=".cg")
    if KEYS:
        sel, sel_w, ids, wts = _top_k_by_keys(lg, valid, row_ok, ee, kk, dtype, SEL_ROWS, E_PAD, TOPK_PAD, TOP_K)
    else:
        sel, sel_w, ids, wts = _top_k_by_scores(lg, valid, row_ok, ee, kk, SEL_ROWS, E_PAD, TOPK_PAD, TOP_K)
    if RENORM:
        denom = tl.where(row_ok, tl.sum(wts, axis=1), 1.0)
        wts = wts / denom[:, None]
        sel_w = tl.where(sel > 0, sel_w / denom[:, None], 0.0)  # a NaN row's denominator leaves the others 0
    # HF casts the routing weights to the activation dtype.
    wts = to_act(wts, dtype).to(tl.float32)
    sel_w = tl.where(row_ok[:, None], to_act(sel_w, dtype).to(tl.float32), 0.0)
    sel = tl.where(row_ok[:, None], sel, 0)

    present = tl.max(sel, axis=0)  # [E_PAD] 0/1
    slot_of = tl.cumsum(present, axis=0) - 1  # population count of present experts below e
    num = tl.sum(present, axis=0)
    tl.store(num_slots_ptr, num)
    is_present = present > 0
    tl.store(slot_expert_ptr + slot_of, ee, mask=is_present)
    tl.store(slot_weight_ptr + slot_of[None, :] * ROWS_C + rows[:, None], sel_w, mask=is_present[None, :])
    bits = tl.reshape(present, [E_PAD // BITS, BITS]) << tl.arange(0, BITS)[None, :]
    words = tl.sum(bits, axis=1)  # distinct powers of two: the sum is the bitwise OR
    tl.store(bitmap_ptr + tl.arange(0, E_PAD // BITS), words)

    if GATHER:  # row_slot[r, k] = slot_of[ids[r, k]] as a gather (MoEKernelConfig.route_gather)
        slot_rk = tl.gather(tl.broadcast_to(slot_of[None, :], [SEL_ROWS, E_PAD]), ids, axis=1)
    else:  # the same as a [SEL_ROWS, TOPK_PAD, E_PAD] compare-and-sum
        slot_rk = tl.sum(tl.where(ids[:, :, None] == ee[None, None, :], slot_of[None, None, :], 0), axis=2)
    out_mask = row_ok[:, None] & (kk < TOP_K)[None, :]
    out_offs = rows[:, None] * TOP_K + kk[None, :]
    tl.store(topk_ids_ptr + out_offs, ids, mask=out_mask)
    tl.store(topk_w_ptr + out_offs, wts, mask=out_mask)
    tl.store(row_slot_ptr + out_offs, slot_rk, mask=out_mask)


@triton.jit
def _softmax(lg, valid, row_ok, mx):
    """float32 softmax of each row of ``lg`` [SEL_ROWS, E_PAD] given its max ``mx`` [SEL_ROWS]; 0 where not valid."""
    m = tl.where(row_ok, mx, 0.0)
    p = tl.where(valid, tl.exp(lg - m[:, None]), 0.0)
    return p / tl.where(row_ok, tl.sum(p, axis=1), 1.0)[:, None]


@triton.jit
def _top_k_by_scores(lg, valid, row_ok, ee, kk, SEL_ROWS: tl.constexpr, E_PAD: tl.constexpr,
                     TOPK_PAD: tl.constexpr, TOP_K: tl.constexpr):
    """Top-k of the softmax probabilities by ``TOP_K`` picks, each a float max and an int min over the tied
    indices (the lower index wins). Returns (sel [SEL_ROWS, E_PAD] 0/1, sel_w: p where selected else 0, ids and
    weights [SEL_ROWS, TOPK_PAD])."""
    p = _softmax(lg, valid, row_ok, tl.max(lg, axis=1))
    # A NaN probability (a NaN or inf in the row) ranks above every other, as torch.topk ranks NaN: 2.0 stands for
    # it in the search (a probability is at most 1) and is turned back into NaN as the weight, so the row is routed
    # and its output comes out NaN instead of the row being dropped.
    work = tl.where(valid, tl.where(p != p, 2.0, p), -1.0)
    sel = tl.zeros([SEL_ROWS, E_PAD], dtype=tl.int32)
    sel_w = tl.zeros([SEL_ROWS, E_PAD], dtype=tl.float32)
    ids = tl.zeros([SEL_ROWS, TOPK_PAD], dtype=tl.int32)
    wts = tl.zeros([SEL_ROWS, TOPK_PAD], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(work, axis=1)
        idx = tl.min(tl.where(work == best[:, None], ee[None, :], E_PAD), axis=1)
        hit = ee[None, :] == idx[:, None]
        sel = tl.where(hit, 1, sel)
        sel_w = tl.where(hit, p, sel_w)
        ids = tl.where(kk[None, :] == k, idx[:, None], ids)
        wts = tl.where(kk[None, :] == k, tl.where(best > 1.0, float("nan"), best)[:, None], wts)
        work = tl.where(hit, -2.0, work)
    return sel, sel_w, ids, wts


@triton.jit
def _key_logit(best, dtype: tl.constexpr):
    """The float32 logit held in the high 16 bits of keys ``best`` (see ``_top_k_by_keys``)."""
    o = best >> 16
    bits = tl.where(o >= 0, o, o ^ 0x7FFF)
    return bits.to(tl.int16).to(dtype, bitcast=True).to(tl.float32)


@triton.jit
def _top_k_by_keys(lg, valid, row_ok, ee, kk, dtype: tl.constexpr, SEL_ROWS: tl.constexpr, E_PAD: tl.constexpr,
                   TOPK_PAD: tl.constexpr, TOP_K: tl.constexpr):
    """``_top_k_by_scores`` for 16-bit logits with one int32 max per pick (``MoEKernelConfig.route_keys``).

    A logit of a 16-bit activation dtype fits 16 bits, so ``key = order(logit) << 16 | (0xFFFF - e)`` orders the
    experts by logit, then by lower index, in one int32: ``order`` maps the float's bits to a signed integer in the
    float's order (negative values' magnitude bits flipped, -0 as +0, NaN above +inf, as torch.topk ranks NaN).
    The max of a key is one integer reduction (``redux.sync`` on sm80+) where the score search does a float max
    and an int min. Softmax is monotonic, so the picks are the probabilities' top-k, except among equal float32
    probabilities of different logits (logits closer than float32 resolves after subtracting the row's max, or
    underflowing to 0), where the higher logit wins instead of the lower index: the picks' weights are equal, and
    where they are 0 (underflow) the slots may differ but the output cannot. The row's max is the first pick's
    logit; a row whose max is not finite (a NaN or inf in the row: all its probabilities are NaN) picks experts
    0..k-1 with NaN weights, as the score search does."""
    bits = lg.to(dtype).to(tl.int16, bitcast=True).to(tl.int32)  # exact: the logits are rounded to dtype
    bits = tl.where(bits == -32768, 0, bits)  # -0 ranks as +0
    order = tl.where(lg != lg, 32767, tl.where(bits >= 0, bits, bits ^ 0x7FFF))
    keys = tl.where(valid, (order << 16) | (0xFFFF - ee[None, :]), -2147483648)
    best = tl.max(keys, axis=1)
    mx = _key_logit(best, dtype)
    bad = (mx != mx) | (tl.abs(mx) == float("inf"))
    p = _softmax(lg, valid, row_ok, mx)
    sel = tl.zeros([SEL_ROWS, E_PAD], dtype=tl.int32)
    ids = tl.zeros([SEL_ROWS, TOPK_PAD], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        if k > 0:
            best = tl.max(keys, axis=1)
        idx = tl.where(bad, k, 0xFFFF - (best & 0xFFFF))
        hit = ee[None, :] == idx[:, None]
        sel = tl.where(hit, 1, sel)
        ids = tl.where(kk[None, :] == k, idx[:, None], ids)
        keys = tl.where(hit, -2147483648, keys)
    sel_w = tl.where(sel > 0, p, 0.0)
    wts = tl.where((kk < TOP_K)[None, :], tl.gather(p, ids, axis=1), 0.0)  # padded k columns stay 0
    return sel, sel_w, ids, wts


def route_launch_params(hidden: int, num_experts: int, top_k: int, programs: int) -> dict[str, int]:
    """Compile-time sizes and grid of :func:`moe_route_kernel` for these model sizes.

    ``E_BLOCK`` router rows per program, a power of two giving about ``programs`` programs per row (``grid`` is
    the first grid axis; the second is the step's rows): with 32 programs for 128 experts the 0.5 MiB router
    matrix of Qwen3-30B-A3B is read by many SMs at once (one SM alone would take several microseconds).
    """
    e_pad = triton.next_power_of_2(num_experts)
    e_block = max(1, min(e_pad, triton.next_power_of_2(triton.cdiv(num_experts, max(1, programs)))))
    return {
        "E_BLOCK": e_block,
        "E_PAD": e_pad,
        "H_PAD": triton.next_power_of_2(hidden),
        "TOP_K": top_k,
        "TOPK_PAD": triton.next_power_of_2(top_k),
        "BITS": min(32, e_pad),
        "grid": triton.cdiv(num_experts, e_block),
    }
