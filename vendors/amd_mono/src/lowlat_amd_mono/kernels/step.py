"""The one-launch step: every decoder layer of a DECODE/VERIFY step in one persistent launch.

Each program walks the layers in order and, in each layer, runs its items of every stage of K1 and K2 (the same
stage functions as ``k1_attn_in`` and ``k2_attn_out_mlp``). What the launch boundaries of the two-launch mode
ordered is carried by step-tagged flags instead, per tile where the math allows:
  * layer ``l``'s QKV items wait for every item of layer ``l - 1``'s last stage (dense ``down_residual`` or MoE
    ``expert_down_combine_residual``): the input RMSNorm needs whole rows of ``x``. This is the only wait on
    the whole previous layer, and a program requests its first weight chunk of layer ``l`` before it.
  * an attention item waits for its kv head's RoPE items (its q heads, its k head, its v head), which
    publish once their rows are stored in ``q`` and the KV pool; the other stages wait as in K2.
Workspaces (``x``, ``part``, ``q``, attention partials, ``x_mid``, activations) are reused by every layer. A
program writes layer ``l + 1``'s copy only after a wait that transitively covers every reader of layer ``l``'s
copy (each stage waits for all items, or the covering items, of the stage before it), so no value is
overwritten while another program still reads it. Deadlock freedom: a wait only targets an earlier (layer,
stage), and the grid is resident (``residency.check_grid``), so the argument of docs/design.md holds.

Per-layer weights and KV buffers come from a pointer table ``wtab [layers, WTAB_COLS]`` int64 (data pointers,
16-byte aligned, checked by the host; columns ``COL_*``), so one compiled kernel serves every layer. The
embedding (which bumps the step tag) and the LM head stay separate launches: three launches per step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_amd_mono.kernels import plan as P
from lowlat_amd_mono.kernels.k1_attn_in import qkv_stage, rope_stage
from lowlat_amd_mono.kernels.k2_attn_out_mlp import attention_stages, dense_mlp_stages, oproj_stage
from lowlat_amd_mono.kernels.moe import expert_down_stage, expert_up_stage, router_stage
from lowlat_amd_mono.kernels.sync import CNT

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton; only referenced under USE_PDL
    gdc_launch_dependents = gdc_wait = None

# Columns of the pointer table (host: weights.layer_pointers), and the same as constexprs for the kernels.
COL_LN1, COL_QKV, COL_QNORM, COL_KNORM, COL_O, COL_LN2, COL_MLP_A, COL_MLP_B, COL_MLP_C, COL_KC, COL_VC = range(11)
W_LN1, W_QKV, W_QNORM, W_KNORM, W_O, W_LN2, W_MLP_A, W_MLP_B, W_MLP_C, W_KC, W_VC = map(
    tl.constexpr, (COL_LN1, COL_QKV, COL_QNORM, COL_KNORM, COL_O, COL_LN2, COL_MLP_A, COL_MLP_B, COL_MLP_C, COL_KC,
                   COL_VC))
WTAB_COLS = 16
_COLS = tl.constexpr(WTAB_COLS)
_NUM_STAGES = tl.constexpr(P.NUM_STAGES)
_S_MLP2 = tl.constexpr(P.S_MLP2)
_S_MLP3 = tl.constexpr(P.S_MLP3)
_RUNTIME_INTS = ["T", "B", "NSPLIT", "deadline"]


@triton.jit
def _wptr(row_ptr, col: tl.constexpr, DT: tl.constexpr):
    """Column ``col`` of a pointer-table row as a 16-byte aligned pointer to ``DT`` (the alignment lets Triton
    vectorize the loads, as it does for pointer arguments)."""
    return tl.multiple_of(tl.load(row_ptr + col).to(tl.pointer_type(DT)), 16)


# The two halves of a layer are separate (noinline) functions: inlined into the layer loop, loop-invariant index
# tensors of every stage were hoisted out of the loop and stayed live across all of it (255 registers and a
# stack, against 182 and none this way, at llama-3.2-1b's sm90 build; docs/design.md, "One launch per step").
@triton.jit(noinline=True)
def _attn_block(alive, pid, nprog, tag, T, B, NSPLIT, layer, deadline, dbg, eps, scale_log2, x_ptr, xmid_ptr, q_ptr,
                ao_ptr, op_ptr, ml_ptr, part_ptr, w, pos_ptr, loc_ptr, cos_ptr, sin_ptr, seq_ptr, req_ptr, r2t_ptr,
                r2t_stride, fl, cn, prev_fl, prev_cn, n_prev, ctl_ptr, step_ptr, H: tl.constexpr, HQ: tl.constexpr,
                HKV: tl.constexpr, D: tl.constexpr, TPR: tl.constexpr, M_ATT: tl.constexpr, BLOCK_S: tl.constexpr,
                NSPLIT_MAX: tl.constexpr, BN_Q: tl.constexpr, BK_Q: tl.constexpr, KS: tl.constexpr,
                KCH: tl.constexpr, QK_NORM: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
                MAX_ITEMS: tl.constexpr, PF_BYTES: tl.constexpr, PREV_STAGE: tl.constexpr, DT: tl.constexpr,
                INTERP: tl.constexpr, TIMER: tl.constexpr, PF_L2: tl.constexpr, PREC: tl.constexpr,
                XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr, ROW1: tl.constexpr):
    """One layer's attention half: QKV, q/k norm + RoPE + KV writes, attention, combine, o_proj + residual."""
    kc = _wptr(w, W_KC, DT)
    vc = _wptr(w, W_VC, DT)
    alive = qkv_stage(alive, pid, nprog, T, layer, deadline, dbg, eps, x_ptr, part_ptr, _wptr(w, W_LN1, DT),
                      _wptr(w, W_QKV, DT), fl, prev_fl, prev_cn, n_prev, ctl_ptr, step_ptr, H, HQ, HKV, D, BN_Q,
                      BK_Q, KS, KCH, MAX_ITEMS, PF_BYTES, True, PREV_STAGE, False, DT, INTERP, TIMER, PF_L2, PREC,
                      XC, MAXW, COUNT, ROW1)
    alive = rope_stage(alive, pid, nprog, tag, T, layer, deadline, dbg, eps, part_ptr, q_ptr, kc, vc,
                       _wptr(w, W_QNORM, DT), _wptr(w, W_KNORM, DT), pos_ptr, loc_ptr, cos_ptr, sin_ptr, fl, ctl_ptr,
                       HQ, HKV, D, BN_Q, KS, QK_NORM, MAX_ITEMS, True, True, DT, INTERP, TIMER, XC, MAXW)
    alive = attention_stages(alive, pid, nprog, tag, B, NSPLIT, layer, deadline, dbg, scale_log2, q_ptr, kc, vc,
                             seq_ptr, req_ptr, r2t_ptr, r2t_stride, op_ptr, ml_ptr, ao_ptr, fl, cn, ctl_ptr, HQ, HKV,
                             D, TPR, M_ATT, BLOCK_S, NSPLIT_MAX, MAX_ITEMS, -1, DT, INTERP, TIMER, PREC, XC, MAXW,
                             COUNT, True)
    alive = oproj_stage(alive, pid, nprog, tag, T, B, layer, deadline, dbg, x_ptr, ao_ptr, xmid_ptr,
                        _wptr(w, W_O, DT), fl, cn, ctl_ptr, H, HQ, HKV, D, BN_O, BK_O, MAX_ITEMS, PF_BYTES, True, DT,
                        INTERP, TIMER, PF_L2, PREC, XC, MAXW, COUNT, ROW1)
    return alive


@triton.jit(noinline=True)
def _dense_mlp(alive, pid, nprog, tag, T, layer, deadline, dbg, eps, x_ptr, xmid_ptr, act_ptr, ln2_ptr, wgu_ptr,
               wdn_ptr, fl, cn, ctl_ptr, H: tl.constexpr, INTER: tl.constexpr, N_OPROJ: tl.constexpr,
               BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
               MAX_ITEMS: tl.constexpr, PF_BYTES: tl.constexpr, STAGE: tl.constexpr, DT: tl.constexpr,
               INTERP: tl.constexpr, TIMER: tl.constexpr, PF_L2: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr,
               MAXW: tl.constexpr, COUNT: tl.constexpr, ROW1: tl.constexpr):
    """One dense layer's MLP half (``k2_attn_out_mlp.dense_mlp_stages``)."""
    return dense_mlp_stages(alive, pid, nprog, tag, T, layer, deadline, dbg, eps, x_ptr, xmid_ptr, act_ptr, ln2_ptr,
                            wgu_ptr, wdn_ptr, fl, cn, ctl_ptr, H, INTER, N_OPROJ, BN_GU, BK_GU, BN_D, BK_D, MAX_ITEMS,
                            PF_BYTES, STAGE, DT, INTERP, TIMER, PF_L2, PREC, XC, MAXW, COUNT, ROW1)


@triton.jit(noinline=True)
def _moe_mlp(alive, pid, nprog, tag, T, layer, deadline, dbg, eps, x_ptr, xmid_ptr, rl_ptr, actm_ptr, slot_e_ptr,
             slot_w_ptr, w, fl, cn, ctl_ptr, H: tl.constexpr, E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr,
             NORM_TOPK: tl.constexpr, IM: tl.constexpr, N_ROUTER: tl.constexpr, N_OPROJ: tl.constexpr,
             BN_R: tl.constexpr, BK_R: tl.constexpr, BN_EU: tl.constexpr, BK_EU: tl.constexpr, BN_ED: tl.constexpr,
             BK_ED: tl.constexpr, MAX_ITEMS: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr,
             TIMER: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr,
             ROW1: tl.constexpr):
    """One layer's MoE half: router, expert gate/up, expert down + combine + residual."""
    ln2 = _wptr(w, W_LN2, DT)
    alive = router_stage(alive, pid, nprog, tag, T, layer, deadline, dbg, eps, xmid_ptr, ln2, _wptr(w, W_MLP_A, DT),
                         rl_ptr, fl, cn, ctl_ptr, H, E, N_OPROJ, BN_R, BK_R, MAX_ITEMS, 4, 5, True, DT, INTERP,
                         TIMER, PREC, XC, MAXW, COUNT, ROW1)
    alive = expert_up_stage(alive, pid, nprog, tag, T, layer, deadline, dbg, eps, xmid_ptr, ln2, _wptr(w, W_MLP_B, DT),
                            rl_ptr, actm_ptr, slot_e_ptr, slot_w_ptr, fl, cn, ctl_ptr, H, E, E_P2, TOPK, NORM_TOPK,
                            IM, N_ROUTER, BN_EU, BK_EU, MAX_ITEMS, 5, 6, True, DT, INTERP, TIMER, PREC, XC, MAXW,
                            COUNT, ROW1)
    return expert_down_stage(alive, pid, nprog, tag, T, layer, deadline, dbg, x_ptr, xmid_ptr, _wptr(w, W_MLP_C, DT),
                             rl_ptr, actm_ptr, slot_e_ptr, slot_w_ptr, fl, cn, ctl_ptr, H, E, E_P2, TOPK, NORM_TOPK,
                             IM, N_ROUTER, (IM + BN_EU - 1) // BN_EU, BN_ED, BK_ED, MAX_ITEMS, 5, 6, 7, True, DT,
                             INTERP, TIMER, PREC, XC, MAXW, COUNT, ROW1)


@triton.jit
def _step_start(step_ptr, USE_PDL: tl.constexpr):
    """``(pid, nprog, tag, alive)`` at the start of a step kernel, after the embedding launch (PDL)."""
    if USE_PDL:
        gdc_wait()  # the embedding launch
    return tl.program_id(0), tl.num_programs(0), tl.load(step_ptr), tl.full([], 1, tl.int32)


@triton.jit
def _layer_start(wtab_ptr, dbg_ptr, flags_ptr, cnt_ptr, layer, MAX_ITEMS: tl.constexpr, PREV_STAGE: tl.constexpr):
    """Layer ``layer``'s pointer-table row, debug mask, flags and counters, and the previous layer's last stage's
    flags and counter (layer 0's own, unread: its QKV waits for 0 items)."""
    fl = flags_ptr + layer * (_NUM_STAGES * MAX_ITEMS)
    cn = cnt_ptr + layer * (_NUM_STAGES * CNT)
    prev = tl.maximum(layer - 1, 0)
    prev_fl = flags_ptr + prev * (_NUM_STAGES * MAX_ITEMS) + PREV_STAGE * MAX_ITEMS
    prev_cn = cnt_ptr + prev * (_NUM_STAGES * CNT) + PREV_STAGE * CNT
    return wtab_ptr + layer * _COLS, tl.load(dbg_ptr + layer), fl, cn, prev_fl, prev_cn


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def step_dense_kernel(
        x_ptr, xmid_ptr, q_ptr, ao_ptr, op_ptr, ml_ptr, part_ptr, act_ptr, wtab_ptr, dbg_ptr,
        pos_ptr, loc_ptr, cos_ptr, sin_ptr, seq_ptr, req_ptr, r2t_ptr, flags_ptr, cnt_ptr, ctl_ptr, step_ptr,
        T, B, NSPLIT, r2t_stride, deadline, eps, scale_log2,
        L: tl.constexpr, H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
        TPR: tl.constexpr, M_ATT: tl.constexpr, BLOCK_S: tl.constexpr, NSPLIT_MAX: tl.constexpr, BN_Q: tl.constexpr,
        BK_Q: tl.constexpr, KS: tl.constexpr, KCH: tl.constexpr, QK_NORM: tl.constexpr, BN_O: tl.constexpr,
        BK_O: tl.constexpr, BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
        MAX_ITEMS: tl.constexpr, PF_BYTES: tl.constexpr, STAGE: tl.constexpr, DT: tl.constexpr,
        INTERP: tl.constexpr, TIMER: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
        PF_L2: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr,
        ROW1: tl.constexpr):
    """All ``L`` dense decoder layers of one step. ``x [8, H]`` holds the embeddings on entry and the last layer's
    output on exit; ``wtab [L, 16]`` int64 the per-layer pointers (columns ``COL_*``); ``dbg [L]`` int32 the
    per-layer debug masks (``sync``); the other buffers as in K1/K2. Persistent only (``STAGE`` -1). ``ROW1``: the
    step has one row and every GEMV runs in the one-row FMA form (``gemv_row1``)."""
    tl.static_assert(STAGE < 0, "the one-launch step has no stage-per-launch mode (use K1/K2)")
    pid, nprog, tag, alive = _step_start(step_ptr, USE_PDL)
    N_DOWN: tl.constexpr = (H + BN_D - 1) // BN_D
    for layer in range(0, L):
        w, dbg, fl, cn, prev_fl, prev_cn = _layer_start(wtab_ptr, dbg_ptr, flags_ptr, cnt_ptr, layer, MAX_ITEMS,
                                                        _S_MLP2)
        alive = _attn_block(alive, pid, nprog, tag, T, B, NSPLIT, layer, deadline, dbg, eps, scale_log2, x_ptr,
                            xmid_ptr, q_ptr, ao_ptr, op_ptr, ml_ptr, part_ptr, w, pos_ptr, loc_ptr, cos_ptr, sin_ptr,
                            seq_ptr, req_ptr, r2t_ptr, r2t_stride, fl, cn, prev_fl, prev_cn,
                            tl.where(layer > 0, N_DOWN, 0), ctl_ptr, step_ptr, H, HQ, HKV, D, TPR, M_ATT, BLOCK_S,
                            NSPLIT_MAX, BN_Q, BK_Q, KS, KCH, QK_NORM, BN_O, BK_O, MAX_ITEMS, PF_BYTES, _S_MLP2, DT,
                            INTERP, TIMER, PF_L2, PREC, XC, MAXW, COUNT, ROW1)
        alive = _dense_mlp(alive, pid, nprog, tag, T, layer, deadline, dbg, eps, x_ptr, xmid_ptr, act_ptr,
                           _wptr(w, W_LN2, DT), _wptr(w, W_MLP_A, DT), _wptr(w, W_MLP_B, DT), fl, cn, ctl_ptr, H,
                           INTER, (H + BN_O - 1) // BN_O, BN_GU, BK_GU, BN_D, BK_D, MAX_ITEMS, PF_BYTES, -1, DT,
                           INTERP, TIMER, PF_L2, PREC, XC, MAXW, COUNT, ROW1)
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def step_moe_kernel(
        x_ptr, xmid_ptr, q_ptr, ao_ptr, op_ptr, ml_ptr, part_ptr, rl_ptr, actm_ptr, slot_e_ptr, slot_w_ptr,
        wtab_ptr, dbg_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, seq_ptr, req_ptr, r2t_ptr, flags_ptr, cnt_ptr,
        ctl_ptr, step_ptr,
        T, B, NSPLIT, r2t_stride, deadline, eps, scale_log2,
        L: tl.constexpr, H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, E: tl.constexpr,
        E_P2: tl.constexpr, TOPK: tl.constexpr, NORM_TOPK: tl.constexpr, IM: tl.constexpr, TPR: tl.constexpr,
        M_ATT: tl.constexpr, BLOCK_S: tl.constexpr, NSPLIT_MAX: tl.constexpr, BN_Q: tl.constexpr, BK_Q: tl.constexpr,
        KS: tl.constexpr, KCH: tl.constexpr, QK_NORM: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
        BN_R: tl.constexpr, BK_R: tl.constexpr, BN_EU: tl.constexpr, BK_EU: tl.constexpr, BN_ED: tl.constexpr,
        BK_ED: tl.constexpr, MAX_ITEMS: tl.constexpr, PF_BYTES: tl.constexpr, STAGE: tl.constexpr,
        DT: tl.constexpr, INTERP: tl.constexpr, TIMER: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
        PF_L2: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr,
        ROW1: tl.constexpr):
    """All ``L`` sparse-MoE decoder layers of one step (Qwen3-MoE); buffers as in ``step_dense_kernel`` and
    ``k2_moe_kernel``. Persistent only (``STAGE`` -1)."""
    tl.static_assert(STAGE < 0, "the one-launch step has no stage-per-launch mode (use K1/K2)")
    pid, nprog, tag, alive = _step_start(step_ptr, USE_PDL)
    N_ROUTER: tl.constexpr = (E + BN_R - 1) // BN_R
    N_DOWN: tl.constexpr = (H + BN_ED - 1) // BN_ED
    for layer in range(0, L):
        w, dbg, fl, cn, prev_fl, prev_cn = _layer_start(wtab_ptr, dbg_ptr, flags_ptr, cnt_ptr, layer, MAX_ITEMS,
                                                        _S_MLP3)
        alive = _attn_block(alive, pid, nprog, tag, T, B, NSPLIT, layer, deadline, dbg, eps, scale_log2, x_ptr,
                            xmid_ptr, q_ptr, ao_ptr, op_ptr, ml_ptr, part_ptr, w, pos_ptr, loc_ptr, cos_ptr, sin_ptr,
                            seq_ptr, req_ptr, r2t_ptr, r2t_stride, fl, cn, prev_fl, prev_cn,
                            tl.where(layer > 0, N_DOWN, 0), ctl_ptr, step_ptr, H, HQ, HKV, D, TPR, M_ATT, BLOCK_S,
                            NSPLIT_MAX, BN_Q, BK_Q, KS, KCH, QK_NORM, BN_O, BK_O, MAX_ITEMS, PF_BYTES, _S_MLP3, DT,
                            INTERP, TIMER, PF_L2, PREC, XC, MAXW, COUNT, ROW1)
        alive = _moe_mlp(alive, pid, nprog, tag, T, layer, deadline, dbg, eps, x_ptr, xmid_ptr, rl_ptr, actm_ptr,
                         slot_e_ptr, slot_w_ptr, w, fl, cn, ctl_ptr, H, E, E_P2, TOPK, NORM_TOPK, IM, N_ROUTER,
                         (H + BN_O - 1) // BN_O, BN_R, BK_R, BN_EU, BK_EU, BN_ED, BK_ED, MAX_ITEMS, DT, INTERP, TIMER,
                         PREC, XC, MAXW, COUNT, ROW1)
    if USE_PDL:
        gdc_launch_dependents()
