"""The step's first and last launches: embedding (+ the step tag bump) and final RMSNorm + LM head.

``embed_kernel``: program ``t`` copies ``embed[input_ids[t]]`` into ``x[t]``; program 0 also advances the
device step tag (1 .. 2**30 - 1, wrapping to 1), so a captured CUDA graph gets a fresh tag on every replay
with no host value baked in, and zeroes the stage counters that ``sync.wait_count`` polls. ``head_kernel``:
``logits[t, n] = (rmsnorm(x[t]) * w_norm) @ lm_head[n]``, rounded to the model dtype as HF's ``lm_head`` output
is, stored float32; one program per ``BN`` vocabulary rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_amd_mono.kernels.gemv import rnd
from lowlat_amd_mono.kernels.gemv_row1 import gemv_tile, rows_rstd, w_chunk
from lowlat_amd_mono.kernels.sync import CNT, TAG_WRAP

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - older triton; only referenced under USE_PDL
    gdc_wait = None

_TAG_WRAP = tl.constexpr(TAG_WRAP)


@triton.jit(do_not_specialize=["v0", "v_rows"])
def embed_kernel(ids_ptr, emb_ptr, x_ptr, step_ptr, cnt_ptr, v0, v_rows, H: tl.constexpr, BH: tl.constexpr,
                 N_CNT: tl.constexpr):
    """``x[t, :] = emb[ids[t] - v0, :]`` for program ``t`` where ``v0 <= ids[t] < v0 + v_rows`` (the rows ``emb``
    holds: all of them at tp_size 1, this rank's vocabulary shard at TP), else zeros; program 0 bumps ``step`` and,
    when ``N_CNT`` > 0 (stage counters on), zeroes the ``N_CNT`` counters ``cnt[j * CNT]``, so this step's waits
    count only its items."""
    t = tl.program_id(0)
    if t == 0:
        s = tl.load(step_ptr) + 1
        tl.store(step_ptr, tl.where(s >= _TAG_WRAP, 1, s))
        if N_CNT > 0:
            j = tl.arange(0, N_CNT)
            tl.store(cnt_ptr + j * CNT, tl.zeros([N_CNT], tl.int32))
    tok = tl.load(ids_ptr + t).to(tl.int64) - v0
    hi = tl.where((tok >= 0) & (tok < v_rows), H, 0)  # columns to read: none for an id of another rank
    for h in range(0, H, BH):
        cols = h + tl.arange(0, BH)
        v = tl.load(emb_ptr + tok * H + cols, mask=cols < hi, other=0.0)
        tl.store(x_ptr + t * H + cols, v, mask=cols < H)


@triton.jit(do_not_specialize=["T"])
def head_kernel(x_ptr, nw_ptr, w_ptr, out_ptr, T, V, out_stride, eps, H: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
                USE_PDL: tl.constexpr, ROW1: tl.constexpr):
    """Logits for vocabulary rows ``[pid * BN, pid * BN + BN)`` of ``w [V, H]`` into ``out [T, out_stride]``
    (``x [T, H]`` in the model dtype, ``nw [H]``); ``ROW1``: ``T`` is 1 and the GEMV runs in the one-row FMA form
    (``gemv_row1``)."""
    BM: tl.constexpr = 16
    RM: tl.constexpr = 1 if ROW1 else BM
    n0 = tl.program_id(0) * BN
    w0 = w_chunk(w_ptr, n0, V, H, 0, H, BN, BK, DT, INTERP, ROW1)
    if USE_PDL:
        gdc_wait()
    rstd = rows_rstd(x_ptr, H, T, H, eps, BM, BK, "", ROW1)
    acc = gemv_tile(w0, x_ptr, H, T, w_ptr, H, n0, V, 0, H, H, rstd, nw_ptr, True, BM, BN, BK, DT, INTERP, PREC, "",
                    ROW1)
    r = tl.arange(0, RM)
    n = n0 + tl.arange(0, BN)
    tl.store(out_ptr + r[:, None] * out_stride + n[None, :], rnd(acc, DT, INTERP),
             mask=(r[:, None] < T) & (n[None, :] < V))
