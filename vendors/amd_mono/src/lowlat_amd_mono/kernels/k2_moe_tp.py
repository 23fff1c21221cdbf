"""K2 of a sparse-MoE layer (Qwen3-MoE) at tp_size > 1: o_proj and the expert down stage publish their tiles to every
rank, and two reduce stages inside the same launch sum the ranks (the dense form is ``k2_tp``; the same publish,
reduce and tag scheme).

Sharding (the general model's, ``lowlat.layers.moe``): every rank holds every expert's slice of the intermediate
dim, ``w13 [E, 2 * I / tp, H]`` (gate rows then up rows of this rank's slice) and ``w2 [E, H, I / tp]``; the router
``[E, H]`` is replicated, so every rank computes the same routing from the same reduced ``x_mid``.

Stages (ids from ``plan``), in launch order, and what each waits for::

  S_ATTN, S_COMB   as at tp_size 1 (``k2_attn_out_mlp.attention_stages``)
  S_OPROJ  hidden tile i of Wo: publish rnd(attn_out @ Wo[i]^T) to every rank   -- every S_COMB item (local)
  S_RED_O  hidden tile i: x_mid = rnd(x + rnd(sum over ranks, in rank order))   -- every rank's o_proj tile i (peer)
  S_MLP1   router tile (``moe.router_stage``; rmsnorm(x_mid))                  -- every S_RED_O item (local)
  S_MLP2   (slot, tile) of this rank's expert gate/up slice (``moe.expert_up_stage``) -- every router item (local)
  S_MLP3   hidden tile i: publish rnd(sum_u (w_u * act_u) @ W2[e_u][i]^T) to every rank, this rank's partial of the
           MoE output over every chosen expert (``moe.expert_down_tile``)  -- the router, every S_MLP2 item (local)
  S_RED_D  hidden tile i: x = rnd(x_mid + rnd(sum over ranks, in rank order))  -- every rank's S_MLP3 tile i (peer)

One S_MLP3 item already covers every chosen expert of its hidden tile (one pipelined loop over (slot, K chunk)), so
the item that computes the top-k sum is the one that publishes it: no last-arriver election across items (which
nvidia_mega's down kernel, split over experts, needs). The publish rounds the float32 sum once to the model dtype,
as the general path's ``moe_experts`` output is rounded before ``all_reduce``; the reduce is ``k2_tp.reduce_stage``,
the dense down reduce itself (call site ``2 * layer + 1``, as the general model's MoE all-reduce).

Tags: as ``k2_tp`` (every program reads the device tag once; o_proj's call uses it, the MoE's the next one, and the
end of the launch, or in the stage-per-launch mode the S_RED_D launch, stores the second with ``finish_call``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_amd_mono.kernels.k2_attn_out_mlp import _k2_prologue, attention_stages
from lowlat_amd_mono.kernels.k2_tp import (
    _TAG_CYCLE,
    device_tag,
    finish_call,
    oproj_publish_stage,
    publish_rows,
    reduce_stage,
)
from lowlat_amd_mono.kernels.moe import expert_down_tile, expert_up_stage, route, router_stage
from lowlat_amd_mono.kernels.sync import CNT, publish, stage_runs, wait_all_if

try:
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # pragma: no cover - older triton; only referenced under USE_PDL
    gdc_launch_dependents = None

_S_OPROJ, _S_MLP1, _S_MLP2, _S_MLP3 = tl.constexpr(4), tl.constexpr(5), tl.constexpr(6), tl.constexpr(7)
_S_RED_O, _S_RED_D = tl.constexpr(8), tl.constexpr(9)
_RUNTIME_INTS = ["T", "B", "NSPLIT", "layer", "deadline", "debug_mask", "rank", "pdeadline", "publish"]


@triton.jit
def expert_down_publish_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, w2_ptr, rl_ptr, actm_ptr,
                              slot_e_ptr, slot_w_ptr, flags_ptr, cnt_ptr, ctl_ptr, pdata_ptrs, pflag_ptrs, ptag, rank,
                              cap, cap_tiles, publish_on, H: tl.constexpr, E: tl.constexpr, E_P2: tl.constexpr,
                              TOPK: tl.constexpr, NORM_TOPK: tl.constexpr, IM: tl.constexpr, N_ROUTER: tl.constexpr,
                              NT_UP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MAX_ITEMS: tl.constexpr,
                              PERSISTENT: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, TIMER: tl.constexpr,
                              PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr,
                              ROW1: tl.constexpr, WORLD: tl.constexpr):
    """S_MLP3 at TP: for each of this program's hidden tiles ``i`` (``BN`` columns), this rank's partial of the MoE
    output, ``sum_u (w[t, e_u] * act[u, t]) @ W2[e_u][i]^T`` over every chosen expert slot ``u`` (float32, its
    intermediate slice), rounded once and published to every rank as flag tile ``i`` of call ``ptag``
    (``k2_tp.publish_rows``) instead of added to the residual; then this stage's amd_mono flag ``i``. Waits, once
    per program, for the router (the routing gives the slot count) and every expert gate/up item. A skipped stage
    publishes zeros."""
    BM: tl.constexpr = 16
    RM: tl.constexpr = 1 if ROW1 else BM
    n_unique = tl.full([], 0, tl.int32)
    for i in range(pid, (H + BN - 1) // BN, nprog):
        if i == pid:
            alive = wait_all_if(alive, flags_ptr + _S_MLP1 * MAX_ITEMS, cnt_ptr + _S_MLP1 * CNT, N_ROUTER, tag,
                                ctl_ptr, deadline, layer, 7, 5, MAXW, TIMER, PERSISTENT, COUNT)
            w, sel, rank_e, n_unique = route(rl_ptr, T, E, E_P2, TOPK, NORM_TOPK, DT, INTERP, XC)
            alive = wait_all_if(alive, flags_ptr + _S_MLP2 * MAX_ITEMS, cnt_ptr + _S_MLP2 * CNT, T * TOPK * NT_UP,
                                tag, ctl_ptr, deadline, layer, 7, 6, MAXW, TIMER, PERSISTENT, COUNT)
        if alive != 0:
            acc = tl.zeros([RM, BN], tl.float32)
            if stage_runs(debug_mask, 7):
                acc = expert_down_tile(i, n_unique, T, w2_ptr, actm_ptr, slot_e_ptr, slot_w_ptr, H, IM, BN, BK, DT,
                                       INTERP, PREC, XC, ROW1)
            publish_rows(acc, i, T, H, BN, RM, pdata_ptrs, pflag_ptrs, ptag, rank, cap, cap_tiles, publish_on, DT,
                         INTERP, WORLD)
        publish(flags_ptr + _S_MLP3 * MAX_ITEMS + i, cnt_ptr + _S_MLP3 * CNT, tag, debug_mask, 7, COUNT)
    return alive


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def k2_moe_tp_kernel(
        x_ptr, xmid_ptr, q_ptr, ao_ptr, op_ptr, ml_ptr, rl_ptr, actm_ptr, slot_e_ptr, slot_w_ptr, kc_ptr, vc_ptr,
        seq_ptr, req_ptr, r2t_ptr, wo_ptr, ln2_ptr, wg_ptr, w13_ptr, w2_ptr,
        flags_ptr, cnt_ptr, ctl_ptr, step_ptr, pdata_ptrs, pflag_ptrs, pctl_ptr, ptag_ptr,
        T, B, NSPLIT, r2t_stride, layer, deadline, debug_mask, eps, scale_log2,
        rank, cap, cap_tiles, pdeadline, publish,
        H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, E: tl.constexpr, E_P2: tl.constexpr,
        TOPK: tl.constexpr, NORM_TOPK: tl.constexpr, IM: tl.constexpr, TPR: tl.constexpr, M_ATT: tl.constexpr,
        BLOCK_S: tl.constexpr, NSPLIT_MAX: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr, BN_R: tl.constexpr,
        BK_R: tl.constexpr, BN_EU: tl.constexpr, BK_EU: tl.constexpr, BN_ED: tl.constexpr, BK_ED: tl.constexpr,
        MAX_ITEMS: tl.constexpr, PF_BYTES: tl.constexpr, STAGE: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr,
        TIMER: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, PF_L2: tl.constexpr,
        PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr, ROW1: tl.constexpr,
        WORLD: tl.constexpr, WPAD: tl.constexpr, PTIMER: tl.constexpr):
    """K2 of a sparse-MoE layer on one rank of ``WORLD`` (module docstring). ``STAGE`` -1: one persistent launch;
    2..9: only that stage. Buffers as ``k2_moe_kernel``'s (this rank's shards: ``HQ`` / ``HKV`` heads, ``IM`` =
    moe_intermediate_size / tp columns of every expert), the peer arguments as ``k2_dense_tp_kernel``'s."""
    PERSISTENT: tl.constexpr = STAGE < 0
    N_ROUTER: tl.constexpr = (E + BN_R - 1) // BN_R
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tag = _k2_prologue(wo_ptr, H, HQ * D, BN_O, PF_BYTES, step_ptr, USE_PDL, PDL_EARLY, PF_L2)
    t_o = device_tag(ptag_ptr, 0)  # the o_proj call; the MoE's is the next tag (module docstring)
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
    if PERSISTENT or STAGE == 5:
        alive = router_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, xmid_ptr, ln2_ptr, wg_ptr,
                             rl_ptr, flags_ptr, cnt_ptr, ctl_ptr, H, E, (H + BN_O - 1) // BN_O, BN_R, BK_R,
                             MAX_ITEMS, _S_RED_O, _S_MLP1, PERSISTENT, DT, INTERP, TIMER, PREC, XC, MAXW, COUNT,
                             ROW1)
    if USE_PDL and not PDL_EARLY:  # release the next layer's K1 once this program reaches the experts
        gdc_launch_dependents()
    if PERSISTENT or STAGE == 6:
        alive = expert_up_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, xmid_ptr, ln2_ptr,
                                w13_ptr, rl_ptr, actm_ptr, slot_e_ptr, slot_w_ptr, flags_ptr, cnt_ptr, ctl_ptr, H, E,
                                E_P2, TOPK, NORM_TOPK, IM, N_ROUTER, BN_EU, BK_EU, MAX_ITEMS, _S_MLP1, _S_MLP2,
                                PERSISTENT, DT, INTERP, TIMER, PREC, XC, MAXW, COUNT, ROW1)
    if PERSISTENT or STAGE == 7:
        alive = expert_down_publish_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, w2_ptr, rl_ptr,
                                          actm_ptr, slot_e_ptr, slot_w_ptr, flags_ptr, cnt_ptr, ctl_ptr, pdata_ptrs,
                                          pflag_ptrs, t_d, rank, cap, cap_tiles, publish, H, E, E_P2, TOPK, NORM_TOPK,
                                          IM, N_ROUTER, (IM + BN_EU - 1) // BN_EU, BN_ED, BK_ED, MAX_ITEMS,
                                          PERSISTENT, DT, INTERP, TIMER, PREC, XC, MAXW, COUNT, ROW1, WORLD)
    if PERSISTENT or STAGE == 9:
        alive = reduce_stage(alive, pid, nprog, tag, T, debug_mask, xmid_ptr, x_ptr, flags_ptr, cnt_ptr, pdata_ptrs,
                             pflag_ptrs, pctl_ptr, t_d, rank, cap, cap_tiles, pdeadline, 2 * layer + 1, H, BN_ED,
                             MAX_ITEMS, _S_RED_D, DT, INTERP, XC, COUNT, WORLD, WPAD, PTIMER)
        finish_call(ptag_ptr, t_d, nprog)  # the launch's last call ends here (module docstring)
