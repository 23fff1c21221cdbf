"""K1, the first persistent launch of a decoder layer: input RMSNorm, QKV projection, q/k norm, RoPE, KV writes.

Stages (ids from ``plan``):
  S_QKV  items (column tile, K split) of ``Wqkv [(Hq + 2 Hkv) D, H]``. Each item loads its first weight chunk,
         then (PDL) waits for the previous launch, computes the rows' RMSNorm while that chunk is in flight,
         and writes float32 partial sums ``part[ks, t, n]``; it publishes its flag.
  S_ROPE items = heads (q heads, k heads, v heads). Each waits for the QKV items covering its head, sums the
         split-K partials, rounds to the model dtype, applies q/k RMSNorm (Qwen3) and neox RoPE (q, k), and
         writes q to ``q_ws [8, Hq*D]`` and k, v to the KV pool at ``out_cache_loc``.
The launch boundary to K2 is what makes these KV writes visible to K2's attention.
Math: HF ``LlamaAttention`` / ``Qwen3Attention`` (rotate_half RoPE, RMSNorm in float32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_amd_mono.kernels.gemv import l2_prefetch, rnd
from lowlat_amd_mono.kernels.gemv_row1 import gemv_tile, rows_rstd, rstd_init, w_chunk
from lowlat_amd_mono.kernels.sync import publish, stage_runs, wait_all_if, wait_if

try:  # PDL helpers (triton >= 3.5); absent ones are only referenced under USE_PDL, which the host leaves off
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton
    gdc_launch_dependents = gdc_wait = None

_S_QKV = tl.constexpr(0)
_S_ROPE = tl.constexpr(1)


@triton.jit
def _rope_head(hh, T, part_ptr, q_ptr, kc_ptr, vc_ptr, qnw_ptr, knw_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, eps,
               HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, KS: tl.constexpr, QK_NORM: tl.constexpr,
               DT: tl.constexpr, INTERP: tl.constexpr, XC: tl.constexpr):
    """Finish head ``hh``: sum partials, q/k norm, RoPE, and store it (q workspace, or K/V cache slots)."""
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    HALF: tl.constexpr = D // 2
    r = tl.arange(0, 8)
    c = tl.arange(0, HALF)
    rmask = r < T
    m2 = rmask[:, None]
    base = part_ptr + r[:, None] * NQKV + hh * D + c[None, :]
    v1 = tl.zeros([8, HALF], tl.float32)
    v2 = tl.zeros([8, HALF], tl.float32)
    for ks in tl.static_range(KS):
        v1 += tl.load(base + ks * 8 * NQKV, mask=m2, other=0.0, cache_modifier=XC)
        v2 += tl.load(base + ks * 8 * NQKV + HALF, mask=m2, other=0.0, cache_modifier=XC)
    v1 = rnd(v1, DT, INTERP)
    v2 = rnd(v2, DT, INTERP)
    if hh < HQ + HKV:
        if QK_NORM:
            is_q = hh < HQ
            w1 = tl.where(is_q, tl.load(qnw_ptr + c), tl.load(knw_ptr + c)).to(tl.float32)
            w2 = tl.where(is_q, tl.load(qnw_ptr + HALF + c), tl.load(knw_ptr + HALF + c)).to(tl.float32)
            rs = tl.rsqrt((tl.sum(v1 * v1, axis=1) + tl.sum(v2 * v2, axis=1)) / D + eps)
            v1 = rnd(rnd(v1 * rs[:, None], DT, INTERP) * w1[None, :], DT, INTERP)
            v2 = rnd(rnd(v2 * rs[:, None], DT, INTERP) * w2[None, :], DT, INTERP)
        pos = tl.load(pos_ptr + r, mask=rmask, other=0)
        cs = rnd(tl.load(cos_ptr + pos[:, None] * HALF + c[None, :], mask=m2, other=0.0), DT, INTERP)
        sn = rnd(tl.load(sin_ptr + pos[:, None] * HALF + c[None, :], mask=m2, other=0.0), DT, INTERP)
        o1 = rnd(rnd(v1 * cs, DT, INTERP) - rnd(v2 * sn, DT, INTERP), DT, INTERP)
        o2 = rnd(rnd(v2 * cs, DT, INTERP) + rnd(v1 * sn, DT, INTERP), DT, INTERP)
    else:
        o1 = v1
        o2 = v2
    if hh < HQ:
        dst = q_ptr + r[:, None] * (HQ * D) + hh * D + c[None, :]
        tl.store(dst, o1.to(DT), mask=m2)
        tl.store(dst + HALF, o2.to(DT), mask=m2)
    else:
        loc = tl.load(loc_ptr + r, mask=rmask, other=0).to(tl.int64)
        if hh < HQ + HKV:
            dst = kc_ptr + loc[:, None] * (HKV * D) + (hh - HQ) * D + c[None, :]
        else:
            dst = vc_ptr + loc[:, None] * (HKV * D) + (hh - HQ - HKV) * D + c[None, :]
        tl.store(dst, o1.to(DT), mask=m2)
        tl.store(dst + HALF, o2.to(DT), mask=m2)


@triton.jit
def qkv_stage(alive, pid, nprog, T, layer, deadline, debug_mask, eps, x_ptr, part_ptr, lnw_ptr, wqkv_ptr,
              flags_ptr, prev_flags_ptr, prev_cnt_ptr, n_prev, ctl_ptr, step_ptr,
              H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, KS: tl.constexpr, KCH: tl.constexpr, MAX_ITEMS: tl.constexpr, PF_BYTES: tl.constexpr,
              WAIT_PREV: tl.constexpr, PREV_STAGE: tl.constexpr, USE_PDL: tl.constexpr, DT: tl.constexpr,
              INTERP: tl.constexpr, TIMER: tl.constexpr, PF_L2: tl.constexpr, PREC: tl.constexpr, AXC: tl.constexpr,
              MAXW: tl.constexpr, COUNT: tl.constexpr, ROW1: tl.constexpr):
    """S_QKV: items (column tile, K split) of ``Wqkv``; float32 partials ``part[ks, t, n]``, one flag per item.

    Each program requests its first weight chunk, then (once, before its first item) waits: for the previous
    launch (PDL), or with ``WAIT_PREV`` for the ``n_prev`` items of the previous layer's last stage (``prev_flags``
    / ``prev_cnt``, stage ``PREV_STAGE``: the one-launch step), and computes the rows' RMSNorm while that chunk is
    in flight. ``AXC`` is the cache modifier of the activation loads (``.cg`` when another program of the same
    launch wrote ``x``). ``ROW1``: the one-row FMA form of the GEMV (``gemv_row1``; the step has one row)."""
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    NT: tl.constexpr = (NQKV + BN - 1) // BN
    BM: tl.constexpr = 16
    RM: tl.constexpr = 1 if ROW1 else BM
    rstd = rstd_init(BM, ROW1)
    tag = tl.full([], 0, tl.int32)
    for i in range(pid, NT * KS, nprog):
        nt = i // KS
        k0 = (i % KS) * KCH
        k1 = tl.minimum(k0 + KCH, H)
        # Projection weights are requested before the norm (and before the previous layer ends).
        w0 = w_chunk(wqkv_ptr, nt * BN, NQKV, H, k0, H, BN, BK, DT, INTERP, ROW1)
        l2_prefetch(wqkv_ptr, nt * BN, NQKV, H, k0 + BK, k1, PF_BYTES, BN, PF_L2)
        if i == pid:  # the rows' RMSNorm, once per program, while the first chunk is in flight
            if USE_PDL:
                gdc_wait()
            tag = tl.load(step_ptr)
            if WAIT_PREV:
                alive = wait_all_if(alive, prev_flags_ptr, prev_cnt_ptr, n_prev, tag, ctl_ptr, deadline, layer,
                                    0, PREV_STAGE, MAXW, TIMER, True, COUNT)
            rstd = rows_rstd(x_ptr, H, T, H, eps, BM, BK, AXC, ROW1)
        if alive != 0:
            if stage_runs(debug_mask, 0):
                acc = gemv_tile(w0, x_ptr, H, T, wqkv_ptr, H, nt * BN, NQKV, k0, k1, H, rstd, lnw_ptr, True, BM, BN,
                                BK, DT, INTERP, PREC, AXC, ROW1)
                r = tl.arange(0, RM)
                n = nt * BN + tl.arange(0, BN)
                dst = part_ptr + (i % KS) * 8 * NQKV + r[:, None] * NQKV + n[None, :]
                tl.store(dst, acc, mask=(r[:, None] < T) & (n[None, :] < NQKV))
            publish(flags_ptr + _S_QKV * MAX_ITEMS + i, flags_ptr, tag, debug_mask, 0, False)  # waited per item
    return alive


@triton.jit
def rope_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, part_ptr, q_ptr, kc_ptr, vc_ptr,
               qnw_ptr, knw_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, flags_ptr, ctl_ptr,
               HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr,
               QK_NORM: tl.constexpr, MAX_ITEMS: tl.constexpr, PERSISTENT: tl.constexpr, PUBLISH: tl.constexpr,
               DT: tl.constexpr, INTERP: tl.constexpr, TIMER: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr):
    """S_ROPE: one item per head; waits for the QKV items covering it. With ``PUBLISH`` (the one-launch step,
    where attention runs in the same launch) each head publishes its flag once its q or K/V rows are stored."""
    for hh in range(pid, HQ + 2 * HKV, nprog):
        lo = (hh * D) // BN * KS
        hi = ((hh * D + D - 1) // BN + 1) * KS
        alive = wait_if(alive, flags_ptr + _S_QKV * MAX_ITEMS, lo, hi, tag, ctl_ptr, deadline, layer,
                        1, 0, MAXW, TIMER, PERSISTENT)
        if alive != 0:
            if stage_runs(debug_mask, 1):
                _rope_head(hh, T, part_ptr, q_ptr, kc_ptr, vc_ptr, qnw_ptr, knw_ptr, pos_ptr, loc_ptr,
                           cos_ptr, sin_ptr, eps, HQ, HKV, D, KS, QK_NORM, DT, INTERP, XC)
            if PUBLISH:
                publish(flags_ptr + _S_ROPE * MAX_ITEMS + hh, flags_ptr, tag, debug_mask, 1, False)
    return alive


@triton.jit(do_not_specialize=["T", "layer", "deadline", "debug_mask"])
def k1_attn_in_kernel(
        x_ptr, q_ptr, part_ptr, kc_ptr, vc_ptr,
        lnw_ptr, wqkv_ptr, qnw_ptr, knw_ptr,
        pos_ptr, loc_ptr, cos_ptr, sin_ptr,
        flags_ptr, ctl_ptr, step_ptr,
        T, layer, deadline, debug_mask, eps,
        H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, KCH: tl.constexpr, QK_NORM: tl.constexpr,
        MAX_ITEMS: tl.constexpr, PF_BYTES: tl.constexpr,
        STAGE: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, TIMER: tl.constexpr, USE_PDL: tl.constexpr,
        PDL_EARLY: tl.constexpr, PF_L2: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr,
        ROW1: tl.constexpr):
    """K1 for one layer. ``STAGE`` = -1 runs all stages in one persistent launch (with tag waits); 0 or 1 runs
    only that stage (stage-per-launch mode: no waits). Buffers: ``x [8, H]`` layer input, ``q [8, Hq*D]``,
    ``part [KS, 8, (Hq+2Hkv)*D]`` float32, ``kc``/``vc`` this layer's ``[slots, Hkv, D]``, ``flags`` this layer's
    ``[8, MAX_ITEMS]`` int32, ``ctl`` the error record, ``step`` the device step tag. ``ROW1``: the step has one row
    and its GEMV runs in the one-row FMA form (``gemv_row1``)."""
    PERSISTENT: tl.constexpr = STAGE < 0
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    alive = tl.full([], 1, tl.int32)
    if USE_PDL and PDL_EARLY:
        gdc_launch_dependents()
    if PERSISTENT or STAGE == 0:
        alive = qkv_stage(alive, pid, nprog, T, layer, deadline, debug_mask, eps, x_ptr, part_ptr, lnw_ptr, wqkv_ptr,
                          flags_ptr, flags_ptr, flags_ptr, 0, ctl_ptr, step_ptr, H, HQ, HKV, D, BN, BK, KS, KCH,
                          MAX_ITEMS, PF_BYTES, False, 0, USE_PDL, DT, INTERP, TIMER, PF_L2, PREC, "", MAXW, False,
                          ROW1)
    if PERSISTENT or STAGE == 1:
        if USE_PDL:
            if not PDL_EARLY:
                gdc_launch_dependents()
            gdc_wait()
        tag = tl.load(step_ptr)
        alive = rope_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, part_ptr, q_ptr, kc_ptr,
                           vc_ptr, qnw_ptr, knw_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, flags_ptr, ctl_ptr, HQ, HKV,
                           D, BN, KS, QK_NORM, MAX_ITEMS, PERSISTENT, False, DT, INTERP, TIMER, XC, MAXW)
    if USE_PDL:
        gdc_wait()  # every program waits once, so this launch ends only after the previous one has
