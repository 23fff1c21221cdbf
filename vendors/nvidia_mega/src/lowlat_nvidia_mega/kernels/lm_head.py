"""Final RMSNorm + LM head (+ fused sampling) for at most 8 rows: one pass over the vocabulary weight.

``logits = rmsnorm(x) * norm_w @ lm_head_w^T`` (HF order: ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``), float32
accumulation, rounded to the model dtype and widened to float32 as ``F.linear(h, W).float()`` does
(``lowlat.layers.logits``), so ties resolve like the general path.

Grid ``(ceil(V / BLOCK_V),)``: program p owns vocab rows ``[p*BLOCK_V, (p+1)*BLOCK_V)`` of the weight, streams them once
(K loop over H, software-pipelined by ``tl.dot`` with the weight as the M operand: "swap AB", so the T rows, padded to a
power of two ``ROWS_C`` <= 8, are the small N side) and computes that tile's logits for all rows. ``ROWS_C`` follows T
(one compiled variant per 1, 2, 4, 8; at least ``LMHeadConfig.min_rows``) because the sampling epilogue's work scales
with it. For Qwen3 (V = 151936, H = 2048, bf16, 622 MB) that is 1187 programs of 512 KiB each. Every program recomputes
the rows' RMS from x (T*H elements from L2) before its loop. Nothing precedes ``gdc_wait``: the first weight tiles are
issued by the software pipeline right after it. With ``lm_head_sample`` the tile's logits never leave the chip unless
asked: each program writes a small record and a merge tree of atomic tickets reduces them across programs
(``sampling.py``). Activation prefetch (``PREFETCH_ACT``, off by default; see ``small_gemm.py``): the K loop loads the
next x / norm-weight chunk one iteration ahead; bit-identical results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lowlat_nvidia_mega.kernels.env_config import config_from_env
from lowlat_nvidia_mega.kernels.pdl import gdc_launch_dependents, gdc_wait, interpreting, launch_kwargs, pdl_supported
from lowlat_nvidia_mega.kernels.rounding import to_act
from lowlat_nvidia_mega.kernels.sampling import LMHeadWorkspace, merge_records, pick_tokens, tile_record
from lowlat_nvidia_mega.kernels.small_gemm import dot_acc, prefetch_act_enabled

ROWS = 8


@dataclass(frozen=True)
class LMHeadConfig:
    """Launch settings (integers: powers of two, the two tile sides >= 16 and at most 2**20 elements together;
    ``num_stages`` 1..8). ``block_v`` is used by ``lm_head_logits``; ``lm_head_sample`` takes it from its workspace
    (the merge tree's shape depends on it; the engine sizes that workspace from the same config).
    ``min_rows`` (a power of two, 1..8) pads the rows to at least that many: ``ROWS_C = max(next_pow2(T),
    min_rows)``. At one row 8 turns the tile's dot from ``mma.sync m16n8k16`` (N padded by Triton, the weight tile
    through registers) into sm90's ``wgmma m64n8k16`` (read from shared memory), as an 8-row launch compiles
    (Triton 3.9's sm90 build, ``tests/test_compile_sm90_lm_head.py``). Default 8: the 8-row kernel is the faster
    one at 151936 x 2048 (H200 logits 151.5 against 156.1 µs, greedy ids 157.0 against 174.5; H100 217.0 against
    227.2 for greedy ids), and llama-3.2-1b's DECODE b=1 step took 1.0516 / 1.0534 -> 1.0481 / 1.0480 ms with it on
    an H100 (A/B/A/B; b=4 and qwen3-30b-a3b b=1 within noise; bench/results/2026-12-07-h100-mega-route).
    Defaults measured on the H200 (``bench_moe_head.py --sweep lm_head``, 151936 x 2048 logits): K chunks of 128
    with 3 stages take 155.0 µs at 1 row and 150.9 at 8, against 177.6 and 163.7 for the earlier 64 / 4 stages
    (docs/kernels.md, "Launch plans"). ``LOWLAT_MEGA_LM_HEAD_CONFIG`` (``default_lm_head_config``) replaces fields
    for the engine."""

    block_v: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    min_rows: int = 8

    def __post_init__(self) -> None:
        for name in ("block_v", "block_k", "num_warps", "min_rows", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"LMHeadConfig.{name}={v!r} must be an integer, not {type(v).__name__}")
        for name in ("block_v", "block_k", "num_warps", "min_rows"):
            v = getattr(self, name)
            low = 16 if name in ("block_v", "block_k") else 1  # the tiles are tl.dot operands: each side >= 16
            if v < low or v & (v - 1):
                raise ValueError(f"LMHeadConfig.{name}={v} must be " +
                                 ("1, 2, 4 or 8" if name == "min_rows" else f"a power of two >= {low}"))
        if self.block_v * self.block_k > 1 << 20:  # Triton's largest tensor (block_k is also capped at H)
            raise ValueError(f"LMHeadConfig: block_v x block_k = {self.block_v} x {self.block_k} is above 2**20 "
                             "elements, Triton's largest tensor")
        if self.num_warps > 32:
            raise ValueError(f"LMHeadConfig.num_warps={self.num_warps}: a program has at most 32 warps")
        if self.min_rows > ROWS:
            raise ValueError(f"LMHeadConfig.min_rows={self.min_rows} must be at most {ROWS} (the rows a launch serves)")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"LMHeadConfig.num_stages={self.num_stages} must be in 1..8 (shared memory holds fewer)")


CONFIG_ENV = "LOWLAT_MEGA_LM_HEAD_CONFIG"


def default_lm_head_config() -> LMHeadConfig:
    """The config of the engine's LM head: ``LMHeadConfig()`` with the fields that ``LOWLAT_MEGA_LM_HEAD_CONFIG``
    names replaced, e.g. ``min_rows=8`` (``env_config``).

    Raises:
        ValueError: as ``env_config.config_from_env``, naming the variable and the item.
    """
    return config_from_env(LMHeadConfig, CONFIG_ENV)


# ``n_tiles`` is never specialized: Triton turns an int argument equal to 1 into a constant, and with one tile
# (V <= BLOCK_V) SCCP then proves the merge-tree loop below never runs. Triton 3.6 leaves that dead loop body in
# place and ConvertTritonGPUToLLVM fails on it (AxisInfo is never computed for unreachable blocks).
@triton.jit(do_not_specialize=["n_tiles"])
def _lm_head_kernel(
    x_ptr, norm_w_ptr, w_ptr, logits_ptr,
    temp_ptr, topk_ptr, topp_ptr, seed_ptr, offset_ptr, tokens_ptr,
    greedy_ptr, gumbel_ptr, max_ptr, sum_ptr, key_ptr, counters_ptr,
    n_rows, H, V, n_tiles, eps, stride_x, stride_logits,
    ROWS_C: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, CAND: tl.constexpr,
    FAN_IN: tl.constexpr, WRITE_LOGITS: tl.constexpr, SAMPLE: tl.constexpr, FILTER: tl.constexpr,
    ROUND_LOGITS: tl.constexpr, DOT_F32: tl.constexpr, BITONIC: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_ACT: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    rows = tl.arange(0, ROWS_C)
    row_ok = rows < n_rows
    offs_v = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = offs_v < V
    w_rows = w_ptr + offs_v[:, None].to(tl.int64) * H
    gdc_wait(USE_PDL)
    gdc_launch_dependents(USE_PDL)

    ss = tl.zeros([ROWS_C], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                     mask=row_ok[:, None] & (offs_k < H)[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(xk * xk, axis=1)
    rstd = tl.rsqrt(ss / H + eps)

    acc = tl.zeros([BLOCK_V, ROWS_C], dtype=tl.float32)
    if PREFETCH_ACT:  # the first raw x^T chunk and norm weights, loaded one chunk ahead from here on
        xt_nx, nw_nx = _load_xt_nw(x_ptr, norm_w_ptr, rows, row_ok, stride_x, tl.arange(0, BLOCK_K), H)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < H
        w = tl.load(w_rows + offs_k[None, :], mask=vmask[:, None] & kmask[None, :], other=0.0)
        if PREFETCH_ACT:  # the same values and arithmetic as below, the next chunk in flight during this dot
            xt, nw = xt_nx.to(tl.float32), nw_nx.to(tl.float32)
            xt_nx, nw_nx = _load_xt_nw(x_ptr, norm_w_ptr, rows, row_ok, stride_x, offs_k + BLOCK_K, H)
        else:
            xt = tl.load(x_ptr + rows[None, :] * stride_x + offs_k[:, None], mask=kmask[:, None] & row_ok[None, :],
                         other=0.0).to(tl.float32)
            nw = tl.load(norm_w_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)
        ht = to_act(nw[:, None] * to_act(xt * rstd[None, :], dtype).to(tl.float32), dtype)
        acc = dot_acc(w, ht, acc, DOT_F32)
    if ROUND_LOGITS:
        acc = to_act(acc, dtype).to(tl.float32)
    if WRITE_LOGITS:
        tl.store(logits_ptr + rows[None, :] * stride_logits + offs_v[:, None], acc,
                 mask=vmask[:, None] & row_ok[None, :])

    if SAMPLE > 0:
        tile_record(acc, offs_v, vmask, rows, row_ok, pid, temp_ptr, seed_ptr, offset_ptr,
                    greedy_ptr, gumbel_ptr, max_ptr, sum_ptr, key_ptr, ROWS_C, CAND, SAMPLE, FILTER, BITONIC)
        # Merge tree: level records lie one after another; the last arriver of each group merges it.
        node = pid
        n = n_tiles + pid * 0
        base = pid * 0
        cbase = pid * 0
        active = pid >= 0
        while (n > 1) & active:
            group = node // FAN_IN
            first = group * FAN_IN
            cnt = tl.minimum(n - first, FAN_IN)
            n_next = (n + FAN_IN - 1) // FAN_IN
            tl.debug_barrier()
            ticket = tl.atomic_add(counters_ptr + cbase + group, 1, sem="acq_rel")
            active = ticket == cnt - 1
            if active:
                tl.atomic_xchg(counters_ptr + cbase + group, 0)
                merge_records(base + first, cnt, base + n + group, rows, row_ok, temp_ptr,
                              greedy_ptr, gumbel_ptr, max_ptr, sum_ptr, key_ptr,
                              ROWS_C, CAND, FAN_IN, SAMPLE, FILTER, BITONIC)
            base += n
            cbase += n_next
            node = group
            n = n_next
        if active:
            tl.debug_barrier()
            pick_tokens(base, rows, row_ok, V, temp_ptr, topk_ptr, topp_ptr, seed_ptr, offset_ptr, tokens_ptr,
                        greedy_ptr, gumbel_ptr, max_ptr, sum_ptr, key_ptr, ROWS_C, CAND, SAMPLE, FILTER)


@triton.jit
def _load_xt_nw(x_ptr, norm_w_ptr, rows, row_ok, stride_x, offs_k, H):
    """(x[rows, offs_k]^T, norm_w[offs_k]) as stored, zeros past ``H`` and for rows >= T."""
    kmask = offs_k < H
    xt = tl.load(x_ptr + rows[None, :] * stride_x + offs_k[:, None], mask=kmask[:, None] & row_ok[None, :], other=0.0)
    return xt, tl.load(norm_w_ptr + offs_k, mask=kmask, other=0.0)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_common(x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, pdl: bool) -> None:
    _check(x.dim() == 2 and x.stride(1) == 1, f"x must be [T, H] with unit stride in H, got {tuple(x.shape)}")
    t, hidden = x.shape
    _check(1 <= t <= ROWS, f"x has {t} rows; the LM head kernel serves 1..{ROWS} rows")
    _check(w.dim() == 2 and w.shape[1] == hidden and w.is_contiguous() and w.dtype == x.dtype,
           f"lm_head_w must be contiguous [V, H={hidden}] {x.dtype}, got {tuple(w.shape)} {w.dtype}")
    _check(tuple(norm_w.shape) == (hidden,) and norm_w.is_contiguous(), f"norm_w must be [H={hidden}] contiguous")
    _check(len({x.device, w.device, norm_w.device}) == 1, "x, norm_w and lm_head_w must be on one device")
    _check(not pdl or pdl_supported(x.device),
           "pdl=True needs a CUDA GPU of capability >= 9.0 and no TRITON_INTERPRET; pass pdl=pdl_enabled(device)")


def _launch(x, norm_w, w, eps, logits, samp, ws, block_v, cfg, pdl, prefetch):  # type: ignore[no-untyped-def]
    t, hidden = x.shape
    vocab = w.shape[0]
    n_tiles = triton.cdiv(vocab, block_v)
    temp, topk, topp, seeds, offsets, tokens = samp if samp is not None else (x,) * 6
    sample = 0 if samp is None else (1 if samp[0] is None else 2)
    filt = samp is not None and samp[1] is not None
    if sample == 1:
        temp, topk, topp, seeds, offsets = (tokens,) * 5
    elif not filt:
        topk, topp = temp, temp
    bufs = (ws.greedy, ws.gumbel, ws.row_max, ws.row_sum, ws.keys, ws.counters) if ws is not None else (x,) * 6
    _lm_head_kernel[(n_tiles,)](
        x, norm_w, w, logits if logits is not None else x,
        temp, topk, topp, seeds, offsets, tokens, *bufs,
        t, hidden, vocab, n_tiles, float(eps), x.stride(0), logits.stride(0) if logits is not None else 0,
        ROWS_C=max(triton.next_power_of_2(t), cfg.min_rows), BLOCK_V=block_v,
        BLOCK_K=min(cfg.block_k, max(16, triton.next_power_of_2(hidden))),
        CAND=ws.candidates if ws is not None else 1, FAN_IN=ws.fan_in if ws is not None else 2,
        WRITE_LOGITS=logits is not None, SAMPLE=sample, FILTER=filt, ROUND_LOGITS=x.dtype != torch.float32,
        DOT_F32=x.dtype == torch.float32 or interpreting(), BITONIC=not interpreting(),
        USE_PDL=pdl, PREFETCH_ACT=prefetch_act_enabled() if prefetch is None else bool(prefetch),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(pdl))


def _check_logits(out: torch.Tensor, t: int, vocab: int, device: torch.device) -> None:
    _check(out.dim() == 2 and tuple(out.shape) == (t, vocab) and out.dtype == torch.float32 and out.stride(1) == 1
           and out.device == device, f"logits out must be float32 [T={t}, V={vocab}] with unit stride on {device}")


def lm_head_logits(x: torch.Tensor, norm_w: torch.Tensor, lm_head_w: torch.Tensor, eps: float, out: torch.Tensor,
                   *, pdl: bool, config: LMHeadConfig | None = None, prefetch_act: bool | None = None) -> torch.Tensor:
    """``out = (rmsnorm(x) * norm_w) @ lm_head_w^T`` as float32 (values rounded to x.dtype first).

    Args:
        x: [T, H] final hidden states (T <= 8; bf16 or float32), unit stride in H.
        norm_w: [H] final norm weight. lm_head_w: [V, H] contiguous, x's dtype. eps: RMSNorm epsilon.
        out: [T, V] float32, unit stride in V (written in full).
        pdl: launch with programmatic dependent launch (sm90+). config: tile sizes (``LMHeadConfig()``).
        prefetch_act: load each x / norm-weight chunk one K chunk ahead (bit-identical results); default
            ``small_gemm.prefetch_act_enabled()``.

    Returns:
        ``out``.

    Raises:
        ValueError: a shape, dtype, stride or device mismatch, T outside [1, 8], or pdl where it cannot run.
    """
    cfg = config or LMHeadConfig()
    _check_common(x, norm_w, lm_head_w, pdl)
    _check_logits(out, x.shape[0], lm_head_w.shape[0], x.device)
    _launch(x, norm_w, lm_head_w, eps, out, None, None, cfg.block_v, cfg, pdl, prefetch_act)
    return out


def lm_head_sample(x: torch.Tensor, norm_w: torch.Tensor, lm_head_w: torch.Tensor, eps: float,
                   temperature: torch.Tensor | None, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                   seeds: torch.Tensor | None, offsets: torch.Tensor | None, out_tokens: torch.Tensor,
                   workspace: LMHeadWorkspace, *, pdl: bool, out_logits: torch.Tensor | None = None,
                   config: LMHeadConfig | None = None, prefetch_act: bool | None = None) -> torch.Tensor:
    """Final norm + LM head + sampling in one launch and one pass over ``lm_head_w``; semantics in ``sampling.py``.

    Args:
        x, norm_w, lm_head_w, eps: as in :func:`lm_head_logits`.
        temperature: [T] float32, <= 0 means greedy for that row; None: every row greedy (cheapest path).
        top_k: [T] int32 (<= 0 or >= V: off) and top_p: [T] float32 in (0, 1] (>= 1: off); both None: no filtering
            (cheaper: no candidate lists). Give both or neither.
        seeds: [T] int64 Philox seeds; offsets: [T] int64 Philox offsets (token i uses ``offset + i``; advance
            by >= V per step). Required when ``temperature`` is given.
        out_tokens: [T] int64, written.
        workspace: ``LMHeadWorkspace.allocate(max_rows >= T, vocab=V, ...)``; its ``block_v`` sets the tiles.
        pdl: launch with programmatic dependent launch (sm90+).
        out_logits: optional [T, V] float32 that also receives the logits.
        config: ``block_k``, warps and stages (``LMHeadConfig()``).
        prefetch_act: as in :func:`lm_head_logits`.

    Returns:
        ``out_tokens``.

    Raises:
        ValueError: a shape, dtype or device mismatch, a missing seed/offset, top_k without top_p (or the
            reverse), a workspace for another vocabulary or fewer rows, or pdl where it cannot run.
    """
    cfg = config or LMHeadConfig()
    _check_common(x, norm_w, lm_head_w, pdl)
    t = x.shape[0]
    vocab = lm_head_w.shape[0]
    _check(workspace.vocab == vocab and workspace.max_rows >= t,
           f"workspace was allocated for vocab={workspace.vocab}, max_rows={workspace.max_rows}; "
           f"this call has V={vocab}, T={t}: allocate LMHeadWorkspace for it")
    _check(workspace.counters.device == x.device, "workspace must be on x's device")
    _check((top_k is None) == (top_p is None), "give both top_k and top_p (use 0 and 1.0 to disable) or neither")
    _check(temperature is not None or top_k is None, "top_k/top_p need a temperature tensor (rows with 0 are greedy)")
    specs = (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
             ("top_p", top_p, torch.float32), ("seeds", seeds, torch.int64), ("offsets", offsets, torch.int64),
             ("out_tokens", out_tokens, torch.int64))
    for name, v, dt in specs:
        if v is None:
            _check(temperature is None or name not in ("seeds", "offsets"),
                   f"{name} is required when temperature is given")
            continue
        _check(tuple(v.shape) == (t,) and v.dtype == dt and v.is_contiguous() and v.device == x.device,
               f"{name} must be a contiguous [T={t}] {dt} tensor on {x.device}, got {tuple(v.shape)} {v.dtype}")
    if out_logits is not None:
        _check_logits(out_logits, t, vocab, x.device)
    samp = (temperature, top_k, top_p, seeds, offsets, out_tokens)
    _launch(x, norm_w, lm_head_w, eps, out_logits, samp, workspace, workspace.block_v, cfg, pdl, prefetch_act)
    return out_tokens
