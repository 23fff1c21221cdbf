"""K2 of a dense layer at tp_size > 1: o_proj and down publish their tiles to every rank, and two reduce stages
inside the same launch sum the ranks.

Stages (ids from ``plan``), in launch order, and what each waits for::

  S_ATTN, S_COMB   as at tp_size 1 (``k2_attn_out_mlp.attention_stages``)
  S_OPROJ  hidden tile i of Wo: publish rnd(attn_out @ Wo[i]^T) to every rank   -- every S_COMB item (local)
  S_RED_O  hidden tile i: x_mid = rnd(x + rnd(sum over ranks, in rank order))   -- every rank's o_proj tile i (peer)
  S_MLP1   gate/up tile (``k2_attn_out_mlp.gate_up_stage``; rmsnorm(x_mid))     -- every S_RED_O item (local)
  S_MLP2   hidden tile i of W_down: publish rnd(act @ Wd[i]^T) to every rank    -- every S_MLP1 item (local)
  S_RED_D  hidden tile i: x = rnd(x_mid + rnd(sum over ranks, in rank order))   -- every rank's down tile i (peer)

A publish is ``lowlat.plugin.peer.publish_tile``: the tile goes to this rank's slot of every rank's peer buffer at
elements ``row * H + col`` and flag ``i`` (the producer's column tile) is released on every rank. A reduce item
polls its tile's flags of every rank with ``wait_tiles`` (bounded by the peer buffers' deadline; a wait that gives
up writes NaN and the error record, which the engine turns into ``PeerWaitTimeout`` naming this rank, the missing
rank and the call site ``2 * layer`` (o_proj) / ``2 * layer + 1`` (down)), adds the ranks in rank order in float32,
rounds that sum once, adds the residual and rounds again (the general path's ``x + all_reduce(F.linear(...))``),
stores the result and publishes its own amd_mono flag, so the next stage's norm prologue reads whole rows.

Tags: a K2 launch is two calls of the peer protocol. Every program reads the device tag once (``device_tag``):
o_proj and its reduce use it, down and its reduce the next one (``tag % TAG_CYCLE + 1``), and the launch's end
(persistent; in the stage-per-launch mode, the S_RED_D launch) stores the second as the last tag used
(``finish_call``), so tags stay consecutive across layers and steps. Reading the tag once per launch instead of
once per call is what lets both calls live in one persistent launch: a program that reached down must not see a
bump made by a slower program still in the o_proj reduce.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_amd_mono.kernels.gemv import rnd
from lowlat_amd_mono.kernels.gemv_row1 import gemv_tile, rstd_init, w_chunk
from lowlat_amd_mono.kernels.k2_attn_out_mlp import _k2_prologue, attention_stages, gate_up_stage
from lowlat_amd_mono.kernels.sync import CNT, publish, stage_runs, wait_all_if

try:
    from lowlat.plugin.peer import TAG_CYCLE, device_tag, finish_call, publish_tile, wait_tiles
except ImportError:  # a core before plugin API 4: specs.py keeps tp_size at 1, so this kernel never compiles
    TAG_CYCLE = 1 << 30

    @triton.jit
    def _needs_api4():
        tl.static_assert(False, "amd_mono at tp_size > 1 needs lowlat's plugin API 4 (lowlat.plugin.peer)")

    device_tag = finish_call = publish_tile = wait_tiles = _needs_api4

try:
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # pragma: no cover - older triton; only referenced under USE_PDL
    gdc_launch_dependents = None

_TAG_CYCLE = tl.constexpr(TAG_CYCLE)
_S_COMB, _S_OPROJ, _S_MLP1, _S_MLP2 = tl.constexpr(3), tl.constexpr(4), tl.constexpr(5), tl.constexpr(6)
_S_RED_O, _S_RED_D = tl.constexpr(8), tl.constexpr(9)
_R = tl.constexpr(8)  # rows a reduce item covers (plan.MAX_ROWS; rows >= T are masked)
_RUNTIME_INTS = ["T", "B", "NSPLIT", "layer", "deadline", "debug_mask", "rank", "pdeadline", "publish"]


@triton.jit
def publish_rows(acc, i, T, H: tl.constexpr, BN: tl.constexpr, RM: tl.constexpr, pdata_ptrs, pflag_ptrs, ptag, rank,
                 cap, cap_tiles, publish_on, DT: tl.constexpr, INTERP: tl.constexpr, WORLD: tl.constexpr):
    """Round the float32 tile ``acc [RM, BN]`` (rows ``< T``, columns ``i * BN ..`` of an ``[T, H]`` output) to
    ``DT`` as ``F.linear`` rounds, and publish it as flag tile ``i`` under the call's tag ``ptag``
    (``publish_on`` 0: stored, flags never released; fault injection)."""
    r = tl.arange(0, RM)
    n = i * BN + tl.arange(0, BN)
    m = (r[:, None] < T) & (n[None, :] < H)
    publish_tile(rnd(acc, DT, INTERP).to(DT), r[:, None] * H + n[None, :], m, pdata_ptrs, pflag_ptrs, ptag, rank,
                 cap, cap_tiles, i, publish_on, WORLD)


@triton.jit
def reduce_stage(alive, pid, nprog, tag, T, debug_mask, res_ptr, out_ptr, flags_ptr, cnt_ptr, pdata_ptrs,
                 pflag_ptrs, pctl_ptr, ptag, rank, cap, cap_tiles, pdeadline, site, H: tl.constexpr,
                 BN: tl.constexpr, MAX_ITEMS: tl.constexpr, STAGE_ID: tl.constexpr, DT: tl.constexpr,
                 INTERP: tl.constexpr, XC: tl.constexpr, COUNT: tl.constexpr, WORLD: tl.constexpr,
                 WPAD: tl.constexpr, PTIMER: tl.constexpr):
    """S_RED_O / S_RED_D: for each of this program's hidden tiles ``i`` (``BN`` columns, the producer's tiles),
    wait until every rank published tile ``i`` of call ``ptag``, then ``out = rnd(res + rnd(sum_s partial_s))``
    (float32, ranks 0 .. WORLD-1 in order; NaN where the wait gave up) for rows ``< T``, and publish this stage's
    amd_mono flag ``i`` (the local consumers wait on those)."""
    parity = ptag & 1
    own_data = tl.load(pdata_ptrs + rank).to(tl.pointer_type(DT))
    own_flags = tl.load(pflag_ptrs + rank).to(tl.pointer_type(tl.int32))
    r = tl.arange(0, _R)
    for i in range(pid, (H + BN - 1) // BN, nprog):
        ready = alive != 0
        if alive != 0:
            ready = wait_tiles(own_flags + (parity * cap_tiles + i) * WORLD, ptag, pctl_ptr, pdeadline, rank, i, site,
                               1, WORLD, WPAD, PTIMER, 1)
        n = i * BN + tl.arange(0, BN)
        m = (r[:, None] < T) & (n[None, :] < H)
        offs = r[:, None] * H + n[None, :]
        acc = tl.zeros([_R, BN], tl.float32)
        for s in tl.static_range(WORLD):
            v = tl.load(own_data + (parity * WORLD + s).to(tl.int64) * cap + offs, mask=m, other=0.0,
                        cache_modifier=XC)
            acc += v.to(tl.float32)
        res = tl.load(res_ptr + offs, mask=m, other=0.0, cache_modifier=XC).to(tl.float32)
        y = rnd(res + rnd(acc, DT, INTERP), DT, INTERP)
        y = tl.where(ready, y, float("nan"))
        tl.store(out_ptr + offs, y.to(DT), mask=m)
        publish(flags_ptr + STAGE_ID * MAX_ITEMS + i, cnt_ptr + STAGE_ID * CNT, tag, debug_mask, STAGE_ID, COUNT)
    return alive


@triton.jit
def oproj_publish_stage(alive, pid, nprog, tag, T, B, layer, deadline, debug_mask, ao_ptr, wo_ptr, flags_ptr,
                        cnt_ptr, ctl_ptr, pdata_ptrs, pflag_ptrs, ptag, rank, cap, cap_tiles, publish_on,
                        H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, MAX_ITEMS: tl.constexpr, PERSISTENT: tl.constexpr, DT: tl.constexpr,
                        INTERP: tl.constexpr, TIMER: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr,
                        MAXW: tl.constexpr, COUNT: tl.constexpr, ROW1: tl.constexpr, WORLD: tl.constexpr):
    """S_OPROJ at TP: this rank's partial ``attn_out @ Wo[tile]^T`` (its heads' slice of the reduction), published
    to every rank instead of added to the residual (``publish_rows``); a skipped stage publishes zeros."""
    BM: tl.constexpr = 16
    RM: tl.constexpr = 1 if ROW1 else BM
    KO: tl.constexpr = HQ * D
    for i in range(pid, (H + BN - 1) // BN, nprog):
        w0 = w_chunk(wo_ptr, i * BN, H, KO, 0, KO, BN, BK, DT, INTERP, ROW1)
        if i == pid:
            alive = wait_all_if(alive, flags_ptr + _S_COMB * MAX_ITEMS, cnt_ptr + _S_COMB * CNT, B * HKV, tag,
                                ctl_ptr, deadline, layer, 4, 3, MAXW, TIMER, PERSISTENT, COUNT)
        if alive != 0:
            acc = tl.zeros([RM, BN], tl.float32)
            if stage_runs(debug_mask, 4):
                acc = gemv_tile(w0, ao_ptr, KO, T, wo_ptr, KO, i * BN, H, 0, KO, KO, rstd_init(BM, ROW1), wo_ptr,
                                False, BM, BN, BK, DT, INTERP, PREC, XC, ROW1)
            publish_rows(acc, i, T, H, BN, RM, pdata_ptrs, pflag_ptrs, ptag, rank, cap, cap_tiles, publish_on, DT,
                         INTERP, WORLD)
        publish(flags_ptr + _S_OPROJ * MAX_ITEMS + i, cnt_ptr + _S_OPROJ * CNT, tag, debug_mask, 4, COUNT)
    return alive


@triton.jit
def down_publish_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, act_ptr, wdn_ptr, flags_ptr, cnt_ptr,
                       ctl_ptr, pdata_ptrs, pflag_ptrs, ptag, rank, cap, cap_tiles, publish_on, H: tl.constexpr,
                       INTER: tl.constexpr, N_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
                       MAX_ITEMS: tl.constexpr, PERSISTENT: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr,
                       TIMER: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr,
                       COUNT: tl.constexpr, ROW1: tl.constexpr, WORLD: tl.constexpr):
    """S_MLP2 at TP: this rank's partial ``act @ W_down[tile]^T`` (its intermediate slice), published to every rank
    (``publish_rows``) after every gate/up item; a skipped stage publishes zeros."""
    BM: tl.constexpr = 16
    RM: tl.constexpr = 1 if ROW1 else BM
    for i in range(pid, (H + BN_D - 1) // BN_D, nprog):
        w0 = w_chunk(wdn_ptr, i * BN_D, H, INTER, 0, INTER, BN_D, BK_D, DT, INTERP, ROW1)
        if i == pid:
            alive = wait_all_if(alive, flags_ptr + _S_MLP1 * MAX_ITEMS, cnt_ptr + _S_MLP1 * CNT, N_GU, tag, ctl_ptr,
                                deadline, layer, 6, 5, MAXW, TIMER, PERSISTENT, COUNT)
        if alive != 0:
            acc = tl.zeros([RM, BN_D], tl.float32)
            if stage_runs(debug_mask, 6):
                acc = gemv_tile(w0, act_ptr, INTER, T, wdn_ptr, INTER, i * BN_D, H, 0, INTER, INTER,
                                rstd_init(BM, ROW1), wdn_ptr, False, BM, BN_D, BK_D, DT, INTERP, PREC, XC, ROW1)
            publish_rows(acc, i, T, H, BN_D, RM, pdata_ptrs, pflag_ptrs, ptag, rank, cap, cap_tiles, publish_on, DT,
                         INTERP, WORLD)
        publish(flags_ptr + _S_MLP2 * MAX_ITEMS + i, cnt_ptr + _S_MLP2 * CNT, tag, debug_mask, 6, COUNT)
    return alive


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def k2_dense_tp_kernel(
        x_ptr, xmid_ptr, q_ptr, ao_ptr, op_ptr, ml_ptr, act_ptr, kc_ptr, vc_ptr,
        seq_ptr, req_ptr, r2t_ptr, wo_ptr, ln2_ptr, wgu_ptr, wdn_ptr,
        flags_ptr, cnt_ptr, ctl_ptr, step_ptr, pdata_ptrs, pflag_ptrs, pctl_ptr, ptag_ptr,
        T, B, NSPLIT, r2t_stride, layer, deadline, debug_mask, eps, scale_log2,
        rank, cap, cap_tiles, pdeadline, publish,
        H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr, TPR: tl.constexpr,
        M_ATT: tl.constexpr, BLOCK_S: tl.constexpr, NSPLIT_MAX: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
        BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr, MAX_ITEMS: tl.constexpr,
        PF_BYTES: tl.constexpr, STAGE: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, TIMER: tl.constexpr,
        USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, PF_L2: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr,
        MAXW: tl.constexpr, COUNT: tl.constexpr, ROW1: tl.constexpr, WORLD: tl.constexpr, WPAD: tl.constexpr,
        PTIMER: tl.constexpr):
    """K2 of a dense layer on one rank of ``WORLD`` (module docstring). ``STAGE`` -1: one persistent launch; 2..6,
    8, 9: only that stage. Buffers as ``k2_dense_kernel``'s (this rank's shards: ``HQ`` / ``HKV`` heads, ``INTER``
    columns), plus the peer buffers' pointer tables ``pdata_ptrs`` / ``pflag_ptrs`` (int64 ``[WORLD]``), error
    record ``pctl`` and device tag ``ptag`` (``lowlat.plugin.peer``), this rank's ``rank``, their capacity ``cap``
    (elements per rank, >= 8 * H) and ``cap_tiles`` flag tiles (>= the o_proj and down tile counts), the deadline
    ``pdeadline`` in units of ``PTIMER`` (the peer buffers' timer), and ``publish`` (0: fault injection)."""
    PERSISTENT: tl.constexpr = STAGE < 0
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tag = _k2_prologue(wo_ptr, H, HQ * D, BN_O, PF_BYTES, step_ptr, USE_PDL, PDL_EARLY, PF_L2)
    t_o = device_tag(ptag_ptr, 0)  # the o_proj call; down's is the next tag (module docstring)
    t_d = t_o % _TAG_CYCLE + 1
    alive = tl.full([], 1, tl.int32)
    alive = attention_stages(alive, pid, nprog, tag, B, NSPLIT, layer, deadline, debug_mask, scale_log2, q_ptr,
                             kc_ptr, vc_ptr, seq_ptr, req_ptr, r2t_ptr, r2t_stride, op_ptr, ml_ptr, ao_ptr,
                             flags_ptr, cnt_ptr, ctl_ptr, HQ, HKV, D, TPR, M_ATT, BLOCK_S, NSPLIT_MAX, MAX_ITEMS,
                             STAGE, DT, INTERP, TIMER, PREC, XC, MAXW, COUNT, False)
    if PERSISTENT or STAGE == 4:
        alive = oproj_publish_stage(alive, pid, nprog, tag, T, B, layer, deadline, debug_mask, ao_ptr, wo_ptr,
                                    flags_ptr, cnt_ptr, ctl_ptr, pdata_ptrs, pflag_ptrs, t_o, rank, cap, cap_tiles,
                                    publish, H, HQ, HKV, D, BN_O, BK_O, MAX_ITEMS, PERSISTENT, DT, INTERP, TIMER,
                                    PREC, XC, MAXW, COUNT, ROW1, WORLD)
    if PERSISTENT or STAGE == 8:
        alive = reduce_stage(alive, pid, nprog, tag, T, debug_mask, x_ptr, xmid_ptr, flags_ptr, cnt_ptr, pdata_ptrs,
                             pflag_ptrs, pctl_ptr, t_o, rank, cap, cap_tiles, pdeadline, 2 * layer, H, BN_O,
                             MAX_ITEMS, _S_RED_O, DT, INTERP, XC, COUNT, WORLD, WPAD, PTIMER)
    if USE_PDL and not PDL_EARLY:  # release the next layer's K1 once this program reaches the MLP
        gdc_launch_dependents()
    if PERSISTENT or STAGE == 5:
        alive = gate_up_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, xmid_ptr, act_ptr, ln2_ptr,
                              wgu_ptr, flags_ptr, cnt_ptr, ctl_ptr, H, INTER, (H + BN_O - 1) // BN_O, BN_GU, BK_GU,
                              MAX_ITEMS, PF_BYTES, PERSISTENT, DT, INTERP, TIMER, PF_L2, PREC, XC, MAXW, COUNT, ROW1,
                              _S_RED_O)
    if PERSISTENT or STAGE == 6:
        alive = down_publish_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, act_ptr, wdn_ptr,
                                   flags_ptr, cnt_ptr, ctl_ptr, pdata_ptrs, pflag_ptrs, t_d, rank, cap, cap_tiles,
                                   publish, H, INTER, (INTER + BN_GU - 1) // BN_GU, BN_D, BK_D, MAX_ITEMS,
                                   PERSISTENT, DT, INTERP, TIMER, PREC, XC, MAXW, COUNT, ROW1, WORLD)
    if PERSISTENT or STAGE == 9:
        alive = reduce_stage(alive, pid, nprog, tag, T, debug_mask, xmid_ptr, x_ptr, flags_ptr, cnt_ptr, pdata_ptrs,
                             pflag_ptrs, pctl_ptr, t_d, rank, cap, cap_tiles, pdeadline, 2 * layer + 1, H, BN_D,
                             MAX_ITEMS, _S_RED_D, DT, INTERP, XC, COUNT, WORLD, WPAD, PTIMER)
        finish_call(ptag_ptr, t_d, nprog)  # the launch's last call ends here (module docstring)
