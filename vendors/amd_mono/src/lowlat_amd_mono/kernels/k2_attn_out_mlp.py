"""K2, the second persistent launch of a decoder layer: attention, o_proj + residual, post-attention norm, MLP/MoE.

Stages (ids from ``plan``) and what each waits for:
  S_ATTN   (request, kv head, KV split) partial attention                 -- none (K1's writes precede the launch)
  S_COMB   (request, kv head) merge of the splits into ``attn_out``        -- its S_ATTN splits
  S_OPROJ  hidden tiles: ``x_mid = x + attn_out @ Wo^T``                   -- every S_COMB item
  dense:   S_MLP1 gate/up tiles: ``act = silu(h Wg^T) * (h Wu^T)``, ``h = rmsnorm(x_mid)`` -- every S_OPROJ item
           S_MLP2 hidden tiles: ``x = x_mid + act @ Wd^T``                 -- every S_MLP1 item
  MoE:     S_MLP1 router, S_MLP2 expert gate/up, S_MLP3 expert down + combine + residual (see ``moe``).
Weights that do not depend on routing are requested before the wait (the first chunk into registers, and on
sm90 the rest of the tile into L2); routed weights only after routing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_amd_mono.kernels.attention import attention_item, combine_item
from lowlat_amd_mono.kernels.gemv import l2_prefetch, rnd
from lowlat_amd_mono.kernels.gemv_row1 import gemv2_tile, gemv_tile, rows_rstd, rstd_init, w_chunk
from lowlat_amd_mono.kernels.moe import expert_down_stage, expert_up_stage, router_stage
from lowlat_amd_mono.kernels.sync import CNT, publish, stage_runs, wait_all_if, wait_if

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton; only referenced under USE_PDL
    gdc_launch_dependents = gdc_wait = None

_S_ROPE = tl.constexpr(1)
_S_ATTN = tl.constexpr(2)
_S_COMB = tl.constexpr(3)
_S_OPROJ = tl.constexpr(4)
_S_MLP1 = tl.constexpr(5)
_S_MLP2 = tl.constexpr(6)
_S_MLP3 = tl.constexpr(7)
# Step-varying ints are not specialized (Triton would otherwise compile a variant for the value 1).
_RUNTIME_INTS = ["T", "B", "NSPLIT", "layer", "deadline", "debug_mask"]


@triton.jit
def attention_stages(alive, pid, nprog, tag, B, NSPLIT, layer, deadline, debug_mask, scale_log2,
                      q_ptr, kc_ptr, vc_ptr, seq_ptr, req_ptr, r2t_ptr, r2t_stride, op_ptr, ml_ptr, ao_ptr,
                      flags_ptr, cnt_ptr, ctl_ptr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                      TPR: tl.constexpr, M_ATT: tl.constexpr, BLOCK_S: tl.constexpr, NSPLIT_MAX: tl.constexpr,
                      MAX_ITEMS: tl.constexpr, STAGE: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr,
                      TIMER: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr,
                      COUNT: tl.constexpr, WAIT_KV: tl.constexpr):
    """S_ATTN and S_COMB. With ``WAIT_KV`` (the one-launch step: the RoPE stage ran in this launch) an attention
    item first waits for its kv head's RoPE items (its q heads, its k head and its v head) and reads q and K/V
    with ``XC``; otherwise the launch boundary after K1 already made them visible."""
    PERSISTENT: tl.constexpr = STAGE < 0
    G: tl.constexpr = HQ // HKV
    if PERSISTENT or STAGE == 2:
        for i in range(pid, B * HKV * NSPLIT, nprog):
            if WAIT_KV:
                kvh = (i // NSPLIT) % HKV
                rope = flags_ptr + _S_ROPE * MAX_ITEMS
                alive = wait_if(alive, rope, kvh * G, kvh * G + G, tag, ctl_ptr, deadline, layer, 2, 1, MAXW, TIMER,
                                PERSISTENT)
                alive = wait_if(alive, rope, HQ + kvh, HQ + kvh + 1, tag, ctl_ptr, deadline, layer, 2, 1, MAXW, TIMER,
                                PERSISTENT)
                alive = wait_if(alive, rope, HQ + HKV + kvh, HQ + HKV + kvh + 1, tag, ctl_ptr, deadline, layer, 2, 1,
                                MAXW, TIMER, PERSISTENT)
            if alive != 0:
                if stage_runs(debug_mask, 2):
                    attention_item(i, q_ptr, kc_ptr, vc_ptr, seq_ptr, req_ptr, r2t_ptr, r2t_stride, op_ptr, ml_ptr,
                                   NSPLIT, scale_log2, HQ, HKV, D, TPR, M_ATT, BLOCK_S, NSPLIT_MAX, DT, INTERP, PREC,
                                   XC if WAIT_KV else "")
                publish(flags_ptr + _S_ATTN * MAX_ITEMS + i, cnt_ptr, tag, debug_mask, 2, False)  # waited per item
    if PERSISTENT or STAGE == 3:
        for i in range(pid, B * HKV, nprog):
            alive = wait_if(alive, flags_ptr + _S_ATTN * MAX_ITEMS, i * NSPLIT, (i + 1) * NSPLIT, tag, ctl_ptr,
                            deadline, layer, 3, 2, MAXW, TIMER, PERSISTENT)
            if alive != 0:
                if stage_runs(debug_mask, 3):
                    combine_item(i, op_ptr, ml_ptr, ao_ptr, NSPLIT, HQ, HKV, D, TPR, M_ATT, NSPLIT_MAX, DT, INTERP,
                                 XC)
                publish(flags_ptr + _S_COMB * MAX_ITEMS + i, cnt_ptr + _S_COMB * CNT, tag, debug_mask, 3, COUNT)
    return alive


@triton.jit
def oproj_stage(alive, pid, nprog, tag, T, B, layer, deadline, debug_mask, x_ptr, ao_ptr, xmid_ptr, wo_ptr,
                 flags_ptr, cnt_ptr, ctl_ptr, H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, MAX_ITEMS: tl.constexpr, PF_BYTES: tl.constexpr,
                 PERSISTENT: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, TIMER: tl.constexpr,
                 PF_L2: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr,
                 ROW1: tl.constexpr):
    """``x_mid[:, tile] = x + round(attn_out @ Wo[tile]^T)``; Wo's tile is requested before attention is done.
    ``ROW1``: the one-row FMA form of the GEMV (``gemv_row1``)."""
    BM: tl.constexpr = 16
    RM: tl.constexpr = 1 if ROW1 else BM
    KO: tl.constexpr = HQ * D
    for i in range(pid, (H + BN - 1) // BN, nprog):
        w0 = w_chunk(wo_ptr, i * BN, H, KO, 0, KO, BN, BK, DT, INTERP, ROW1)
        l2_prefetch(wo_ptr, i * BN, H, KO, BK, KO, PF_BYTES, BN, PF_L2)
        if i == pid:  # later items of this program need the same flags
            alive = wait_all_if(alive, flags_ptr + _S_COMB * MAX_ITEMS, cnt_ptr + _S_COMB * CNT, B * HKV, tag,
                                ctl_ptr, deadline, layer, 4, 3, MAXW, TIMER, PERSISTENT, COUNT)
        if alive != 0:
            if stage_runs(debug_mask, 4):
                acc = gemv_tile(w0, ao_ptr, KO, T, wo_ptr, KO, i * BN, H, 0, KO, KO, rstd_init(BM, ROW1), wo_ptr,
                                False, BM, BN, BK, DT, INTERP, PREC, XC, ROW1)
                r = tl.arange(0, RM)
                n = i * BN + tl.arange(0, BN)
                m = (r[:, None] < T) & (n[None, :] < H)
                x = tl.load(x_ptr + r[:, None] * H + n[None, :], mask=m, other=0.0, cache_modifier=XC).to(tl.float32)
                xm = rnd(x + rnd(acc, DT, INTERP), DT, INTERP)
                tl.store(xmid_ptr + r[:, None] * H + n[None, :], xm.to(DT), mask=m)
            publish(flags_ptr + _S_OPROJ * MAX_ITEMS + i, cnt_ptr + _S_OPROJ * CNT, tag, debug_mask, 4, COUNT)
    return alive


@triton.jit
def gate_up_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, xmid_ptr, act_ptr, ln2_ptr, wgu_ptr,
                  flags_ptr, cnt_ptr, ctl_ptr, H: tl.constexpr, INTER: tl.constexpr, N_WAIT: tl.constexpr,
                  BN_GU: tl.constexpr, BK_GU: tl.constexpr, MAX_ITEMS: tl.constexpr, PF_BYTES: tl.constexpr,
                  PERSISTENT: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, TIMER: tl.constexpr,
                  PF_L2: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr,
                  ROW1: tl.constexpr, AWAIT: tl.constexpr):
    """S_MLP1: ``act = silu(h Wg^T) * (h Wu^T)``, ``h = rmsnorm(x_mid) * ln2``, after the first ``N_WAIT`` items of
    stage ``AWAIT`` (the o_proj at tp_size 1; its reduce stage at TP, ``k2_tp``), which wrote ``x_mid``."""
    BM: tl.constexpr = 16
    RM: tl.constexpr = 1 if ROW1 else BM
    NT_GU: tl.constexpr = (INTER + BN_GU - 1) // BN_GU
    rstd = rstd_init(BM, ROW1)
    for i in range(pid, NT_GU, nprog):
        wg0 = w_chunk(wgu_ptr, i * BN_GU, 2 * INTER, H, 0, H, BN_GU, BK_GU, DT, INTERP, ROW1)
        wu0 = w_chunk(wgu_ptr, INTER + i * BN_GU, 2 * INTER, H, 0, H, BN_GU, BK_GU, DT, INTERP, ROW1)
        l2_prefetch(wgu_ptr, i * BN_GU, 2 * INTER, H, BK_GU, H, PF_BYTES // 2, BN_GU, PF_L2)
        l2_prefetch(wgu_ptr, INTER + i * BN_GU, 2 * INTER, H, BK_GU, H, PF_BYTES // 2, BN_GU, PF_L2)
        if i == pid:
            alive = wait_all_if(alive, flags_ptr + AWAIT * MAX_ITEMS, cnt_ptr + AWAIT * CNT, N_WAIT, tag,
                                ctl_ptr, deadline, layer, 5, AWAIT, MAXW, TIMER, PERSISTENT, COUNT)
            rstd = rows_rstd(xmid_ptr, H, T, H, eps, BM, BK_GU, XC, ROW1)
        if alive != 0:
            if stage_runs(debug_mask, 5):
                acc_g, acc_u = gemv2_tile(wg0, wu0, xmid_ptr, H, T, wgu_ptr, H, i * BN_GU, INTER + i * BN_GU,
                                          2 * INTER, H, rstd, ln2_ptr, True, BM, BN_GU, BK_GU, DT, INTERP, PREC, XC,
                                          ROW1)
                g = rnd(acc_g, DT, INTERP)
                act = rnd(rnd(g * tl.sigmoid(g), DT, INTERP) * rnd(acc_u, DT, INTERP), DT, INTERP)
                r = tl.arange(0, RM)
                n = i * BN_GU + tl.arange(0, BN_GU)
                tl.store(act_ptr + r[:, None] * INTER + n[None, :], act.to(DT),
                         mask=(r[:, None] < T) & (n[None, :] < INTER))
            publish(flags_ptr + _S_MLP1 * MAX_ITEMS + i, cnt_ptr + _S_MLP1 * CNT, tag, debug_mask, 5, COUNT)
    return alive


@triton.jit
def dense_mlp_stages(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, x_ptr, xmid_ptr, act_ptr,
                      ln2_ptr, wgu_ptr, wdn_ptr, flags_ptr, cnt_ptr, ctl_ptr, H: tl.constexpr, INTER: tl.constexpr,
                      N_OPROJ: tl.constexpr, BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr,
                      BK_D: tl.constexpr, MAX_ITEMS: tl.constexpr, PF_BYTES: tl.constexpr, STAGE: tl.constexpr,
                      DT: tl.constexpr, INTERP: tl.constexpr, TIMER: tl.constexpr, PF_L2: tl.constexpr,
                      PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr,
                      ROW1: tl.constexpr):
    """S_MLP1 (gate/up + SiLU into ``act``) and S_MLP2 (down + residual into ``x``) of a dense layer; ``ROW1``:
    their GEMVs in the one-row FMA form (``gemv_row1``)."""
    PERSISTENT: tl.constexpr = STAGE < 0
    BM: tl.constexpr = 16
    RM: tl.constexpr = 1 if ROW1 else BM
    NT_GU: tl.constexpr = (INTER + BN_GU - 1) // BN_GU
    if PERSISTENT or STAGE == 5:
        alive = gate_up_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, xmid_ptr, act_ptr, ln2_ptr,
                              wgu_ptr, flags_ptr, cnt_ptr, ctl_ptr, H, INTER, N_OPROJ, BN_GU, BK_GU, MAX_ITEMS,
                              PF_BYTES, PERSISTENT, DT, INTERP, TIMER, PF_L2, PREC, XC, MAXW, COUNT, ROW1, _S_OPROJ)
    if PERSISTENT or STAGE == 6:
        for i in range(pid, (H + BN_D - 1) // BN_D, nprog):
            w0 = w_chunk(wdn_ptr, i * BN_D, H, INTER, 0, INTER, BN_D, BK_D, DT, INTERP, ROW1)
            l2_prefetch(wdn_ptr, i * BN_D, H, INTER, BK_D, INTER, PF_BYTES, BN_D, PF_L2)
            if i == pid:
                alive = wait_all_if(alive, flags_ptr + _S_MLP1 * MAX_ITEMS, cnt_ptr + _S_MLP1 * CNT, NT_GU, tag,
                                    ctl_ptr, deadline, layer, 6, 5, MAXW, TIMER, PERSISTENT, COUNT)
            if alive != 0:
                if stage_runs(debug_mask, 6):
                    acc = gemv_tile(w0, act_ptr, INTER, T, wdn_ptr, INTER, i * BN_D, H, 0, INTER, INTER,
                                    rstd_init(BM, ROW1), wdn_ptr, False, BM, BN_D, BK_D, DT, INTERP, PREC, XC, ROW1)
                    r = tl.arange(0, RM)
                    n = i * BN_D + tl.arange(0, BN_D)
                    m = (r[:, None] < T) & (n[None, :] < H)
                    xm = tl.load(xmid_ptr + r[:, None] * H + n[None, :], mask=m, other=0.0, cache_modifier=XC)
                    res = rnd(xm.to(tl.float32) + rnd(acc, DT, INTERP), DT, INTERP)
                    tl.store(x_ptr + r[:, None] * H + n[None, :], res.to(DT), mask=m)
                # the next layer's QKV waits on these in the one-launch step
                publish(flags_ptr + _S_MLP2 * MAX_ITEMS + i, cnt_ptr + _S_MLP2 * CNT, tag, debug_mask, 6, COUNT)
    return alive


@triton.jit
def _k2_prologue(wo_ptr, H: tl.constexpr, KO: tl.constexpr, BN_O: tl.constexpr, PF_BYTES: tl.constexpr,
                 step_ptr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, PF_L2: tl.constexpr):
    """Let the next launch start early (PDL, ``PDL_EARLY``), prefetch this program's first Wo tile, then wait
    for K1."""
    pid = tl.program_id(0)
    if USE_PDL and PDL_EARLY:
        gdc_launch_dependents()
    l2_prefetch(wo_ptr, pid * BN_O, H, KO, 0, KO, PF_BYTES, BN_O, PF_L2)
    if USE_PDL:
        gdc_wait()
    return tl.load(step_ptr)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def k2_dense_kernel(
        x_ptr, xmid_ptr, q_ptr, ao_ptr, op_ptr, ml_ptr, act_ptr, kc_ptr, vc_ptr,
        seq_ptr, req_ptr, r2t_ptr, wo_ptr, ln2_ptr, wgu_ptr, wdn_ptr,
        flags_ptr, cnt_ptr, ctl_ptr, step_ptr,
        T, B, NSPLIT, r2t_stride, layer, deadline, debug_mask, eps, scale_log2,
        H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr, TPR: tl.constexpr,
        M_ATT: tl.constexpr, BLOCK_S: tl.constexpr, NSPLIT_MAX: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
        BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr, MAX_ITEMS: tl.constexpr,
        PF_BYTES: tl.constexpr, STAGE: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, TIMER: tl.constexpr,
        USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, PF_L2: tl.constexpr,
        PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr, ROW1: tl.constexpr):
    """K2 of a dense layer. ``STAGE`` = -1: one persistent launch; 2..6: only that stage (no waits).
    ``x [8, H]`` is read as the residual and overwritten with the layer output; ``x_mid``, ``attn_out``, ``act``
    are workspaces; ``q`` comes from K1; ``kc``/``vc`` are this layer's KV buffers. ``ROW1``: the step has one row
    and every GEMV runs in the one-row FMA form (``gemv_row1``)."""
    PERSISTENT: tl.constexpr = STAGE < 0
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tag = _k2_prologue(wo_ptr, H, HQ * D, BN_O, PF_BYTES, step_ptr, USE_PDL, PDL_EARLY, PF_L2)
    alive = tl.full([], 1, tl.int32)
    alive = attention_stages(alive, pid, nprog, tag, B, NSPLIT, layer, deadline, debug_mask, scale_log2, q_ptr,
                              kc_ptr, vc_ptr, seq_ptr, req_ptr, r2t_ptr, r2t_stride, op_ptr, ml_ptr, ao_ptr,
                              flags_ptr, cnt_ptr, ctl_ptr, HQ, HKV, D, TPR, M_ATT, BLOCK_S, NSPLIT_MAX, MAX_ITEMS,
                              STAGE, DT, INTERP, TIMER, PREC, XC, MAXW, COUNT, False)
    if PERSISTENT or STAGE == 4:
        alive = oproj_stage(alive, pid, nprog, tag, T, B, layer, deadline, debug_mask, x_ptr, ao_ptr, xmid_ptr,
                             wo_ptr, flags_ptr, cnt_ptr, ctl_ptr, H, HQ, HKV, D, BN_O, BK_O, MAX_ITEMS, PF_BYTES,
                             PERSISTENT, DT, INTERP, TIMER, PF_L2, PREC, XC, MAXW, COUNT, ROW1)
    if USE_PDL and not PDL_EARLY:  # release the next layer's K1 once this program reaches the MLP
        gdc_launch_dependents()
    alive = dense_mlp_stages(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, x_ptr, xmid_ptr, act_ptr,
                              ln2_ptr, wgu_ptr, wdn_ptr, flags_ptr, cnt_ptr, ctl_ptr, H, INTER, (H + BN_O - 1) // BN_O,
                              BN_GU, BK_GU, BN_D, BK_D, MAX_ITEMS, PF_BYTES, STAGE, DT, INTERP, TIMER, PF_L2, PREC, XC,
                              MAXW, COUNT, ROW1)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def k2_moe_kernel(
        x_ptr, xmid_ptr, q_ptr, ao_ptr, op_ptr, ml_ptr, rl_ptr, actm_ptr, slot_e_ptr, slot_w_ptr, kc_ptr, vc_ptr,
        seq_ptr, req_ptr, r2t_ptr, wo_ptr, ln2_ptr, wg_ptr, w13_ptr, w2_ptr,
        flags_ptr, cnt_ptr, ctl_ptr, step_ptr,
        T, B, NSPLIT, r2t_stride, layer, deadline, debug_mask, eps, scale_log2,
        H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, E: tl.constexpr, E_P2: tl.constexpr,
        TOPK: tl.constexpr, NORM_TOPK: tl.constexpr, IM: tl.constexpr, TPR: tl.constexpr, M_ATT: tl.constexpr,
        BLOCK_S: tl.constexpr, NSPLIT_MAX: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr, BN_R: tl.constexpr,
        BK_R: tl.constexpr, BN_EU: tl.constexpr, BK_EU: tl.constexpr, BN_ED: tl.constexpr, BK_ED: tl.constexpr,
        MAX_ITEMS: tl.constexpr, PF_BYTES: tl.constexpr, STAGE: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr,
        TIMER: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, PF_L2: tl.constexpr,
        PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr, ROW1: tl.constexpr):
    """K2 of a sparse-MoE layer (Qwen3-MoE). ``STAGE`` = -1: one persistent launch; 2..7: only that stage.
    ``rl [8, E]`` float32 router logits, ``actm [8 * TOPK, 8, IM]`` expert activations, and the slot table
    ``slot_e [8 * TOPK]`` int32 / ``slot_w [8 * TOPK, 16]`` float32 are workspaces. ``ROW1`` as in
    ``k2_dense_kernel``."""
    PERSISTENT: tl.constexpr = STAGE < 0
    N_ROUTER: tl.constexpr = (E + BN_R - 1) // BN_R
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tag = _k2_prologue(wo_ptr, H, HQ * D, BN_O, PF_BYTES, step_ptr, USE_PDL, PDL_EARLY, PF_L2)
    alive = tl.full([], 1, tl.int32)
    alive = attention_stages(alive, pid, nprog, tag, B, NSPLIT, layer, deadline, debug_mask, scale_log2, q_ptr,
                              kc_ptr, vc_ptr, seq_ptr, req_ptr, r2t_ptr, r2t_stride, op_ptr, ml_ptr, ao_ptr,
                              flags_ptr, cnt_ptr, ctl_ptr, HQ, HKV, D, TPR, M_ATT, BLOCK_S, NSPLIT_MAX, MAX_ITEMS,
                              STAGE, DT, INTERP, TIMER, PREC, XC, MAXW, COUNT, False)
    if PERSISTENT or STAGE == 4:
        alive = oproj_stage(alive, pid, nprog, tag, T, B, layer, deadline, debug_mask, x_ptr, ao_ptr, xmid_ptr,
                             wo_ptr, flags_ptr, cnt_ptr, ctl_ptr, H, HQ, HKV, D, BN_O, BK_O, MAX_ITEMS, PF_BYTES,
                             PERSISTENT, DT, INTERP, TIMER, PF_L2, PREC, XC, MAXW, COUNT, ROW1)
    if PERSISTENT or STAGE == 5:
        alive = router_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, xmid_ptr, ln2_ptr, wg_ptr,
                             rl_ptr, flags_ptr, cnt_ptr, ctl_ptr, H, E, (H + BN_O - 1) // BN_O, BN_R, BK_R,
                             MAX_ITEMS, _S_OPROJ, _S_MLP1, PERSISTENT, DT, INTERP, TIMER, PREC, XC, MAXW, COUNT,
                             ROW1)
    if USE_PDL and not PDL_EARLY:  # release the next layer's K1 once this program reaches the experts
        gdc_launch_dependents()
    if PERSISTENT or STAGE == 6:
        alive = expert_up_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, xmid_ptr, ln2_ptr,
                                w13_ptr, rl_ptr, actm_ptr, slot_e_ptr, slot_w_ptr, flags_ptr, cnt_ptr, ctl_ptr, H, E,
                                E_P2, TOPK, NORM_TOPK, IM, N_ROUTER, BN_EU, BK_EU, MAX_ITEMS, _S_MLP1, _S_MLP2,
                                PERSISTENT, DT, INTERP, TIMER, PREC, XC, MAXW, COUNT, ROW1)
    if PERSISTENT or STAGE == 7:
        alive = expert_down_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, x_ptr, xmid_ptr, w2_ptr,
                                  rl_ptr, actm_ptr, slot_e_ptr, slot_w_ptr, flags_ptr, cnt_ptr, ctl_ptr, H, E, E_P2,
                                  TOPK, NORM_TOPK, IM, N_ROUTER, (IM + BN_EU - 1) // BN_EU, BN_ED, BK_ED, MAX_ITEMS,
                                  _S_MLP1, _S_MLP2, _S_MLP3, PERSISTENT, DT, INTERP, TIMER, PREC, XC, MAXW, COUNT,
                                  ROW1)
