"""Qwen3-MoE routing and routed experts for K2 (router GEMV, top-k, expert gate/up, expert down + combine).

Routing (HF ``Qwen3MoeSparseMoeBlock``): ``softmax(router_logits.float())``, top-k, divide by the top-k sum
when ``norm_topk_prob``, cast the weights to the model dtype. Every expert item recomputes the routing from
``router_logits [8, E]`` (a few KB), so no stage is spent on it. Experts chosen by any token are numbered in
ascending expert id: slot ``u`` in ``[0, n_unique)`` is the ``u``-th chosen expert; an expert's gate/up runs
once for all tokens (tokens that did not choose it get routing weight 0 in the combine).

Stages: router (items: expert tiles of ``Wg [E, H]``); expert gate/up (items ``(u, tile)`` of
``w13[e_u] [2 I, H]``; items with ``u >= n_unique`` compute nothing and only publish; routed weights are loaded
only after routing is known); expert down (items: hidden tiles of ``w2[e] [H, I]``; each waits for every gate/up
item, then streams every chosen expert's rows in one pipelined loop and adds the residual).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_amd_mono.kernels.gemv import as_operand, load_a, load_w, rnd
from lowlat_amd_mono.kernels.gemv_row1 import fma1, gemv2_rows, gemv_rows, load_w1, load_x1, rows_rstd, rstd_init
from lowlat_amd_mono.kernels.sync import CNT, publish, stage_runs, wait_all_if


@triton.jit
def route(rl_ptr, T, E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, NORM_TOPK: tl.constexpr,
          DT: tl.constexpr, INTERP: tl.constexpr, XC: tl.constexpr):
    """Routing of the step's rows from ``router_logits [8, E]`` (float32, already rounded to the model dtype).

    Among equal probabilities the lower expert id wins; a NaN probability ranks first (torch.topk's order), so a
    row with a NaN or inf input is routed and its weights, and so its output, are NaN rather than the row dropped.

    Returns ``(w [16, E_P2] float32 routing weight of each (row, expert), 0 where not chosen or row >= T;
    sel [E_P2] int32 1 where any token chose the expert; rank [E_P2] its slot; n_unique)``.
    """
    t = tl.arange(0, 16)
    e = tl.arange(0, E_P2)
    valid = (t[:, None] < T) & (e[None, :] < E)
    logits = tl.load(rl_ptr + t[:, None] * E + e[None, :], mask=valid, other=float("-inf"), cache_modifier=XC)
    mx = tl.max(logits, axis=1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    p = tl.where(valid, tl.exp(logits - mx[:, None]), 0.0)
    den = tl.sum(p, axis=1)
    p = p / tl.where(den != den, den, tl.maximum(den, 1e-30))[:, None]  # a NaN sum stays NaN (tl.maximum drops it)
    chosen = tl.zeros([16, E_P2], tl.int32)
    ranked = tl.where(p != p, 2.0, p)  # NaN (a NaN or inf input) ranks first, as in torch.topk: the row is routed
    for _ in tl.static_range(TOPK):
        cand = tl.where(valid & (chosen == 0), ranked, -1.0)
        best = tl.max(cand, axis=1)
        idx = tl.min(tl.where(cand == best[:, None], e[None, :], E_P2), axis=1)
        chosen = tl.where((e[None, :] == idx[:, None]) & valid, 1, chosen)
    w = tl.where(chosen != 0, p, 0.0)
    if NORM_TOPK:
        w = w / tl.maximum(tl.sum(w, axis=1), 1e-30)[:, None]
    w = rnd(w, DT, INTERP)
    sel = tl.max(chosen, axis=0)
    rank = tl.cumsum(sel, axis=0) - 1
    return w, sel, rank, tl.sum(sel, axis=0)


@triton.jit
def slot_expert(u, w, sel, rank, E_P2: tl.constexpr):
    """Expert id of slot ``u`` and each row's routing weight for it (``[16]`` float32)."""
    e = tl.arange(0, E_P2)
    hit = (sel != 0) & (rank == u)
    eu = tl.sum(tl.where(hit, e, 0), axis=0)
    wu = tl.sum(tl.where(e[None, :] == eu, w, 0.0), axis=1)
    return eu, wu


@triton.jit
def router_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, xmid_ptr, ln2_ptr, wg_ptr, rl_ptr,
                 flags_ptr, cnt_ptr, ctl_ptr, H: tl.constexpr, E: tl.constexpr, N_WAIT: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, MAX_ITEMS: tl.constexpr, S_WAIT: tl.constexpr, S_ME: tl.constexpr,
                 PERSISTENT: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, TIMER: tl.constexpr,
                 PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr, ROW1: tl.constexpr):
    """Router logits ``rl[t, e] = (rmsnorm(x_mid) @ Wg^T)`` rounded to the model dtype, stored float32 (``ROW1``:
    the one-row FMA form of the GEMV, ``gemv_row1``)."""
    BM: tl.constexpr = 16
    RM: tl.constexpr = 1 if ROW1 else BM
    rstd = rstd_init(BM, ROW1)
    for i in range(pid, (E + BN - 1) // BN, nprog):
        if i == pid:
            alive = wait_all_if(alive, flags_ptr + S_WAIT * MAX_ITEMS, cnt_ptr + S_WAIT * CNT, N_WAIT, tag, ctl_ptr,
                                deadline, layer, S_ME, S_WAIT, MAXW, TIMER, PERSISTENT, COUNT)
            rstd = rows_rstd(xmid_ptr, H, T, H, eps, BM, BK, XC, ROW1)
        if alive != 0:
            if stage_runs(debug_mask, S_ME):
                acc = gemv_rows(xmid_ptr, H, T, wg_ptr, H, i * BN, E, H, rstd, ln2_ptr, True, BM, BN, BK, DT, INTERP,
                                PREC, XC, ROW1)
                r = tl.arange(0, RM)
                n = i * BN + tl.arange(0, BN)
                tl.store(rl_ptr + r[:, None] * E + n[None, :], rnd(acc, DT, INTERP),
                         mask=(r[:, None] < T) & (n[None, :] < E))
            publish(flags_ptr + S_ME * MAX_ITEMS + i, cnt_ptr + S_ME * CNT, tag, debug_mask, S_ME, COUNT)
    return alive


@triton.jit
def expert_up_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, eps, xmid_ptr, ln2_ptr, w13_ptr,
                    rl_ptr, actm_ptr, slot_e_ptr, slot_w_ptr, flags_ptr, cnt_ptr, ctl_ptr, H: tl.constexpr,
                    E: tl.constexpr,
                    E_P2: tl.constexpr, TOPK: tl.constexpr, NORM_TOPK: tl.constexpr, IM: tl.constexpr,
                    N_ROUTER: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MAX_ITEMS: tl.constexpr,
                    S_ROUTER: tl.constexpr, S_ME: tl.constexpr, PERSISTENT: tl.constexpr, DT: tl.constexpr,
                    INTERP: tl.constexpr, TIMER: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr,
                    MAXW: tl.constexpr, COUNT: tl.constexpr, ROW1: tl.constexpr):
    """``act[u, t, :] = silu(h @ Wgate[e_u]^T) * (h @ Wup[e_u]^T)`` for each chosen expert slot ``u``; the items of
    tile 0 also record the slot's expert id (``slot_e[u]``) and rows' routing weights (``slot_w[u, 0:16]``).
    ``ROW1``: the one-row FMA form of the GEMVs (``gemv_row1``)."""
    BM: tl.constexpr = 16
    RM: tl.constexpr = 1 if ROW1 else BM
    NT: tl.constexpr = (IM + BN - 1) // BN
    w = tl.zeros([16, E_P2], tl.float32)
    sel = tl.zeros([E_P2], tl.int32)
    rank = tl.zeros([E_P2], tl.int32)
    n_unique = tl.full([], 0, tl.int32)
    rstd = rstd_init(BM, ROW1)
    for i in range(pid, T * TOPK * NT, nprog):
        u = i // NT
        nt = i % NT
        if i == pid:  # routing and the rows' norm, once per program
            alive = wait_all_if(alive, flags_ptr + S_ROUTER * MAX_ITEMS, cnt_ptr + S_ROUTER * CNT, N_ROUTER, tag,
                                ctl_ptr, deadline, layer, S_ME, S_ROUTER, MAXW, TIMER, PERSISTENT, COUNT)
            w, sel, rank, n_unique = route(rl_ptr, T, E, E_P2, TOPK, NORM_TOPK, DT, INTERP, XC)
            rstd = rows_rstd(xmid_ptr, H, T, H, eps, BM, BK, XC, ROW1)
        if alive != 0:
            if u < n_unique:
                eu, wu = slot_expert(u, w, sel, rank, E_P2)
                if nt == 0:
                    tl.store(slot_e_ptr + u, eu)
                    tl.store(slot_w_ptr + u * 16 + tl.arange(0, 16), wu)
                if stage_runs(debug_mask, S_ME):
                    we = w13_ptr + eu.to(tl.int64) * (2 * IM * H)
                    acc_g, acc_u = gemv2_rows(xmid_ptr, H, T, we, H, nt * BN, IM + nt * BN, 2 * IM, H, rstd, ln2_ptr,
                                              True, BM, BN, BK, DT, INTERP, PREC, XC, ROW1)
                    g = rnd(acc_g, DT, INTERP)
                    act = rnd(rnd(g * tl.sigmoid(g), DT, INTERP) * rnd(acc_u, DT, INTERP), DT, INTERP)
                    r = tl.arange(0, RM)
                    n = nt * BN + tl.arange(0, BN)
                    dst = actm_ptr + u * (8 * IM) + r[:, None] * IM + n[None, :]
                    tl.store(dst, act.to(DT), mask=(r[:, None] < T) & (n[None, :] < IM))
            # Every item publishes, also the unused slots >= n_unique: it read the routing and x_mid, which the
            # next layer overwrites in the one-launch step, so the down stage waits for the whole stage.
            publish(flags_ptr + S_ME * MAX_ITEMS + i, cnt_ptr + S_ME * CNT, tag, debug_mask, S_ME, COUNT)
    return alive


@triton.jit
def expert_down_stage(alive, pid, nprog, tag, T, layer, deadline, debug_mask, x_ptr, xmid_ptr, w2_ptr, rl_ptr,
                      actm_ptr, slot_e_ptr, slot_w_ptr, flags_ptr, cnt_ptr, ctl_ptr, H: tl.constexpr,
                      E: tl.constexpr,
                      E_P2: tl.constexpr, TOPK: tl.constexpr, NORM_TOPK: tl.constexpr, IM: tl.constexpr,
                      N_ROUTER: tl.constexpr, NT_UP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      MAX_ITEMS: tl.constexpr, S_ROUTER: tl.constexpr, S_UP: tl.constexpr, S_ME: tl.constexpr,
                      PERSISTENT: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, TIMER: tl.constexpr,
                      PREC: tl.constexpr, XC: tl.constexpr, MAXW: tl.constexpr, COUNT: tl.constexpr,
                      ROW1: tl.constexpr):
    """``x[t, n] = x_mid[t, n] + sum_u (w[t, e_u] * act[u, t]) @ W2[e_u][n]^T`` for hidden tile ``n``.

    One loop runs over (expert slot, K chunk) pairs, so Triton pipelines the weight loads across experts; the
    routing weight scales the activation rows (rounded to the model dtype) before the product, and the experts
    accumulate in float32. Expert ids and weights come from the slot table the gate/up stage wrote. ``ROW1``: the
    one-row FMA form (``gemv_row1``; row 0's routing weight scales its activation chunk).
    """
    BM: tl.constexpr = 16
    RM: tl.constexpr = 1 if ROW1 else BM
    n_unique = tl.full([], 0, tl.int32)
    r = tl.arange(0, RM)
    for i in range(pid, (H + BN - 1) // BN, nprog):
        if i == pid:
            alive = wait_all_if(alive, flags_ptr + S_ROUTER * MAX_ITEMS, cnt_ptr + S_ROUTER * CNT, N_ROUTER, tag,
                                ctl_ptr, deadline, layer, S_ME, S_ROUTER, MAXW, TIMER, PERSISTENT, COUNT)
            w, sel, rank, n_unique = route(rl_ptr, T, E, E_P2, TOPK, NORM_TOPK, DT, INTERP, XC)
            alive = wait_all_if(alive, flags_ptr + S_UP * MAX_ITEMS, cnt_ptr + S_UP * CNT, T * TOPK * NT_UP, tag,
                                ctl_ptr, deadline, layer, S_ME, S_UP, MAXW, TIMER, PERSISTENT, COUNT)
        if alive != 0:
            out = tl.zeros([RM, BN], tl.float32)
            if stage_runs(debug_mask, S_ME):
                out = expert_down_tile(i, n_unique, T, w2_ptr, actm_ptr, slot_e_ptr, slot_w_ptr, H, IM, BN, BK, DT,
                                       INTERP, PREC, XC, ROW1)
            n = i * BN + tl.arange(0, BN)
            m = (r[:, None] < T) & (n[None, :] < H)
            xm = tl.load(xmid_ptr + r[:, None] * H + n[None, :], mask=m, other=0.0, cache_modifier=XC)
            res = rnd(xm.to(tl.float32) + rnd(out, DT, INTERP), DT, INTERP)
            tl.store(x_ptr + r[:, None] * H + n[None, :], res.to(DT), mask=m)
            # the next layer's QKV waits on these in the one-launch step
            publish(flags_ptr + S_ME * MAX_ITEMS + i, cnt_ptr + S_ME * CNT, tag, debug_mask, S_ME, COUNT)
    return alive


@triton.jit
def expert_down_tile(i, n_unique, T, w2_ptr, actm_ptr, slot_e_ptr, slot_w_ptr, H: tl.constexpr, IM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
                     XC: tl.constexpr, ROW1: tl.constexpr):
    """Hidden tile ``i`` (``BN`` columns) of ``sum_u (w[t, e_u] * act[u, t]) @ W2[e_u][tile]^T`` over the
    ``n_unique`` chosen-expert slots, float32 ``[RM, BN]`` (``RM`` 1 at ``ROW1``, else 16; rows ``>= T`` are zero),
    not rounded: the caller rounds it once (``F.linear``'s rounding of the experts' weighted sum). Expert ids and
    routing weights come from the slot table (``slot_e [8 * TOPK]`` int32, ``slot_w [8 * TOPK, 16]`` float32), the
    activations from ``actm [8 * TOPK, 8, IM]``. One loop over (slot, K chunk) pairs, so the weight loads pipeline
    across experts; each activation chunk is scaled by its rows' routing weights and rounded to ``DT`` first."""
    BM: tl.constexpr = 16
    RM: tl.constexpr = 1 if ROW1 else BM
    KC: tl.constexpr = (IM + BK - 1) // BK
    out = tl.zeros([RM, BN], tl.float32)
    if ROW1:
        out1 = tl.zeros([BN], tl.float32)
        for j in range(0, n_unique * KC):
            u = j // KC
            k = (j % KC) * BK
            eu = tl.load(slot_e_ptr + u, cache_modifier=XC).to(tl.int64)
            wu1 = tl.load(slot_w_ptr + u * 16, cache_modifier=XC)
            wt = load_w1(w2_ptr + eu * (H * IM), i * BN, H, IM, k, IM, BN, BK, DT, INTERP)
            out1 = fma1(out1, wt, rnd(load_x1(actm_ptr + u * (8 * IM), k, IM, BK, XC) * wu1, DT, INTERP))
        out = out1[None, :]
    else:
        rb = tl.arange(0, BM)
        for j in range(0, n_unique * KC):
            u = j // KC
            k = (j % KC) * BK
            eu = tl.load(slot_e_ptr + u, cache_modifier=XC).to(tl.int64)
            wu = tl.load(slot_w_ptr + u * 16 + rb, cache_modifier=XC)
            wt = load_w(w2_ptr + eu * (H * IM), i * BN, H, IM, k, IM, BN, BK, DT, INTERP)
            a = rnd(load_a(actm_ptr + u * (8 * IM), IM, T, k, IM, BM, BK, XC) * wu[:, None], DT, INTERP)
            out = tl.dot(as_operand(a, DT, INTERP), wt, out, input_precision=PREC)
    return out
