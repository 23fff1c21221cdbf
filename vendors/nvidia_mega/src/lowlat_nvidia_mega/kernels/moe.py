"""Sparse MoE (Qwen3-MoE) for at most 8 rows per step, in three PDL-chained Triton kernels.

Math (HF ``Qwen3MoeSparseMoeBlock``, ``lowlat.layers.moe``)::

    h   = rmsnorm(x) * norm_w                                  (optional post-attention norm, HF rounding order)
    p   = softmax(h @ gate_w^T, float32); top-k; / sum when renormalize; cast to x.dtype
    out = residual + sum_k w_k * down_e(silu(gate_e(h)) * up_e(h))     (e = k-th expert of the row)

Kernels (the routing one is in ``moe_route.py``):

1. ``moe_route_kernel``, grid ``(cdiv(E, E_BLOCK), T)``: norm + router + softmax + top-k + presence bitmap; each
   selected expert gets a slot, one 8-row tile (rows that did not select it have weight 0 and are masked). No sort.
2. ``_moe_gate_up_kernel``, grid ``(cdiv(I, BLOCK_N), S)`` with ``S = min(E, T * top_k)`` (static for a given T, so
   CUDA-graph capturable): program (n, s) streams rows ``[n*BLOCK_N, (n+1)*BLOCK_N)`` of the gate and up weights
   of slot s's expert once, for all rows of the tile at once, and writes ``silu(gate) * up``. Programs whose slot
   is unused (``s >= num_slots``: padding of the static grid) exit right after ``gdc_wait``. It is launched with
   PDL, so its programs are resident and waiting while routing finishes.
3. ``_moe_down_kernel``, grid ``(cdiv(H, BLOCK_N), S)``: before its ``gdc_wait`` a program reads its slot's expert
   id and loads its [BLOCK_N, I] slice of that expert's down weights into registers (overlapping kernel 2); it
   then multiplies by the routing weight and writes a float32 partial per (slot, row). The last program to finish
   an H tile (atomic ticket per tile, self-resetting) sums the row's top-k partials in k order and adds the
   residual: deterministic (fixed order, no float atomics) and no extra combine kernel.

One-row steps (``MoEKernelConfig.row1``, on): gate/up runs ``moe_row1._moe_gate_up_row1_kernel`` (the FMA loop of
``gemv.py``, ``h`` as a 1-D vector) and down its ``ROW1`` form (the products on the FMA units, no ``tl.dot`` layout
conversion of the [BLOCK_N, I] tile); grids, ticket and roundings unchanged. On the H200 at Qwen3-30B-A3B's shapes
they take a layer's MoE from 42.0 to 32.5 µs (bench/results/2026-12-02-h200-mega-moe/call2,
``bench_moe_head.py --sweep moe``). ``bench_moe_head.py --stages`` times route / gate_up / down (``MoEStages``).

Why slot-major grids: every selected expert's weights are read exactly once (one tile covers all rows), and at
batch 1 the 8 experts x 48 (gate/up) or x 128 (down) tiles give several programs per SM, enough memory requests
in flight to approach the copy bandwidth; an (E, N) grid would launch 16x more programs that mostly exit.

PDL ordering: kernel 2 issues ``gdc_launch_dependents`` only after its own ``gdc_wait`` returned, i.e. after the
routing kernel completed; that is what makes kernel 3's pre-wait reads of the routing (``.cg``, bypassing L1)
safe. Precision: accumulation in float32; gate, up, silu and the expert output are rounded to the activation dtype
as HF's bf16 modules do; the weighted sum over experts and the residual add stay in float32 and are rounded once
(HF accumulates them in bf16).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import triton

from lowlat_nvidia_mega.kernels.env_config import config_from_env, is_flag
from lowlat_nvidia_mega.kernels.moe_experts import _moe_down_kernel, _moe_gate_up_kernel
from lowlat_nvidia_mega.kernels.moe_route import ROWS, moe_route_kernel, route_launch_params
from lowlat_nvidia_mega.kernels.moe_row1 import _moe_gate_up_row1_kernel
from lowlat_nvidia_mega.kernels.pdl import interpreting, launch_kwargs, pdl_supported
from lowlat_nvidia_mega.kernels.tp_epilogue import PeerTarget, check_publish, peer_launch_args


@dataclass(frozen=True)
class MoEKernelConfig:
    """Tile sizes and launch settings: powers of two, except ``route_programs`` (the number of router programs
    to aim for, 1..4096) and the ``*_stages`` software-pipeline depths (1..8). Defaults aim at Qwen3-30B-A3B shapes
    on an H200; ``bench_moe_head.py --sweep`` tries others."""

    gate_up_block_n: int = 16
    gate_up_block_k: int = 256
    gate_up_warps: int = 4
    gate_up_stages: int = 4
    # down: BLOCK_N output columns per program, I walked in chunks of down_block_i (the first loaded before the
    # PDL wait); 64 x 256 with 8 warps (bench/results/2026-12-02-h200-mega-moe/call3): 33.0 -> 30.4 µs per layer at
    # one row, 240.3 -> about 142 at 8 (16 x the whole of I before).
    down_block_n: int = 64
    down_block_i: int = 256
    down_warps: int = 8
    down_stages: int = 3
    route_warps: int = 4
    route_programs: int = 32
    # The fewest rows of the routing's selection tile (a power of two <= 8; the tile is next_pow2(T) rows or this).
    # With as many rows as warps the compiler lays the tile out one row per warp, so each top-k pick reduces inside
    # a warp; a 1- or 2-row tile spreads a row over the warps (sm90 build at one row: 41 bar.sync at 1 row, 29 at 4;
    # at two rows 55 and 29). On an H100 (bench/results/2026-12-07-h100-mega-min-rows, A/B x3, 1 -> 4): qwen3-30b-a3b
    # DECODE b=1 2.9411 / 2.9390 / 2.9392 -> 2.9316 / 2.9367 / 2.9377 ms, b=2 4.7803 / 4.7815 / 4.7807 -> 4.7560 /
    # 4.7530 / 4.7494.
    route_min_rows: int = 4
    # A one-row step's expert GEMMs on the FMA units: gate/up in moe_row1.py with the row1_* tile (rows per program,
    # K chunk, warps, stages), down in its kernel's ROW1 form with the down_* tile.
    row1: bool = True
    row1_block_n: int = 2
    row1_block_k: int = 1024
    row1_warps: int = 4
    row1_stages: int = 3
    # The routing's row_slot as a tl.gather of the slot table instead of a [rows, top_k, E] compare-and-sum (1.35 us
    # of the one-row selection on an H100 before the selection tile shrank; bench/results/2026-12-07-h100-mega-route).
    # On the H200 (bench/results/2026-12-07-h200-mega-keys, call 1, A/B/A/B): qwen3-30b-a3b DECODE b=1 2.4894 /
    # 2.4914 -> 2.4793 / 2.4806 ms, VERIFY x6 7.3445 / 7.3446 -> 7.2584 / 7.2662.
    route_gather: bool = True
    # The routing's top-k on int32 keys (16-bit logit, then the lower index): one integer max per pick instead of a
    # float max and an int min (moe_route._top_k_by_keys, which says where the picks can differ: equal float32
    # probabilities of different logits). 16-bit activations only: a float32 logit does not fit the key, so a
    # float32 model keeps the score search. On an H100 (bench/results/2026-12-07-h200-mega-keys, call 3, A/B/A/B):
    # qwen3-30b-a3b DECODE b=1 3.0303 / 3.0260 -> 2.9755 / 2.9731 ms, VERIFY x6 8.9679 / 8.9452 -> 8.8957 / 8.8950.
    route_keys: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if is_flag(f):
                if not isinstance(v, bool):
                    raise ValueError(f"MoEKernelConfig.{f.name}={v!r} must be True or False")
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"MoEKernelConfig.{f.name}={v!r} must be an integer")
            if f.name == "route_programs" or f.name.endswith("_stages"):
                top = 4096 if f.name == "route_programs" else 8  # more stages than shared memory ever holds
                if not 1 <= v <= top:
                    raise ValueError(f"MoEKernelConfig.{f.name}={v} must be in 1..{top}")
                continue
            if v < 1 or v & (v - 1):
                raise ValueError(f"MoEKernelConfig.{f.name}={v} must be a power of two >= 1")
            if f.name.endswith("_warps") and v > 32:
                raise ValueError(f"MoEKernelConfig.{f.name}={v}: a program has at most 32 warps")
        for name in ("gate_up_block_k", "down_block_i"):  # the K side of a tl.dot operand
            if getattr(self, name) < 16:
                raise ValueError(f"MoEKernelConfig.{name}={getattr(self, name)} must be >= 16 (a tl.dot K side)")
        if self.route_min_rows > ROWS:
            raise ValueError(f"route_min_rows={self.route_min_rows} must be <= {ROWS} (the rows the kernels serve)")
        if self.down_block_n < 8:
            raise ValueError(f"down_block_n={self.down_block_n} must be >= 8 (the workspace counts H/8 tiles)")


CONFIG_ENV = "LOWLAT_MEGA_MOE_CONFIG"


def default_config() -> MoEKernelConfig:
    """The config of a launch given none (the engine's): ``MoEKernelConfig()`` with the fields that
    ``LOWLAT_MEGA_MOE_CONFIG`` names replaced, e.g. ``down_block_n=32,down_warps=4`` (``env_config``).

    Raises:
        ValueError: as ``env_config.config_from_env``, naming the variable and the item.
    """
    return config_from_env(MoEKernelConfig, CONFIG_ENV)


@dataclass(frozen=True)
class MoEWorkspace:
    """Scratch tensors of :func:`moe_forward`, allocated once (CUDA-graph safe: fixed addresses).

    Rows are padded to 8 (``ROWS``); ``S = min(num_experts, max_rows * top_k)`` slots. Tensors:
    ``h`` [8, H] dtype (normalized input), ``logits`` [8, E] f32, ``topk_ids`` [8, top_k] int32,
    ``topk_weights`` [8, top_k] f32, ``row_slot`` [8, top_k] int32, ``slot_expert`` [S] int32,
    ``slot_weight`` [S, 8] f32, ``num_slots`` [1] int32, ``bitmap`` [max(1, next_pow2(E) / 32)] int32 (bit e%32 of
    word e//32 set when expert e is selected by any row), ``act`` [S, 8, I] dtype, ``partial`` [S, 8, H] f32,
    ``counters`` [1 + ceil(H/8)] int32 (zero between launches; every kernel resets what it used).
    """

    max_rows: int
    hidden: int
    inter: int
    num_experts: int
    top_k: int
    dtype: torch.dtype
    h: torch.Tensor
    logits: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    row_slot: torch.Tensor
    slot_expert: torch.Tensor
    slot_weight: torch.Tensor
    num_slots: torch.Tensor
    bitmap: torch.Tensor
    act: torch.Tensor
    partial: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def allocate(cls, max_rows: int, hidden: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 device: torch.device | str, alloc: Callable[..., torch.Tensor] = torch.empty) -> MoEWorkspace:
        """Allocate with ``alloc(shape, dtype=..., device=...)`` (``torch.empty`` or an accounted equivalent).

        Raises:
            ValueError: ``max_rows`` not in [1, 8], ``top_k`` not in [1, num_experts], or a size < 1.
        """
        if not 1 <= max_rows <= ROWS:
            raise ValueError(f"max_rows={max_rows} must be in [1, {ROWS}]: these kernels serve at most {ROWS} rows")
        if min(hidden, inter, num_experts) < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"bad MoE sizes hidden={hidden} inter={inter} num_experts={num_experts} top_k={top_k}")
        slots = min(num_experts, max_rows * top_k)
        words = triton.next_power_of_2(num_experts) // min(32, triton.next_power_of_2(num_experts))
        f32, i32 = torch.float32, torch.int32

        def new(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return alloc(shape, dtype=dt, device=device)

        counters = new((1 + triton.cdiv(hidden, 8),), i32)
        counters.zero_()
        return cls(max_rows, hidden, inter, num_experts, top_k, dtype,
                   h=new((ROWS, hidden), dtype), logits=new((ROWS, num_experts), f32),
                   topk_ids=new((ROWS, top_k), i32), topk_weights=new((ROWS, top_k), f32),
                   row_slot=new((ROWS, top_k), i32), slot_expert=new((slots,), i32),
                   slot_weight=new((slots, ROWS), f32), num_slots=new((1,), i32), bitmap=new((words,), i32),
                   act=new((slots, ROWS, inter), dtype), partial=new((slots, ROWS, hidden), f32),
                   counters=counters)

    @property
    def nbytes(self) -> int:
        """Bytes held by the workspace tensors."""
        tensors = (getattr(self, f.name) for f in fields(self))
        return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def k_chunk(block: int, size: int, low: int = 1) -> int:
    """The K chunk a launch runs: ``block`` capped at ``size`` rounded up to a power of two, and at least ``low``
    (16 for a ``tl.dot`` operand's K side; the masks cover the padding)."""
    return max(low, min(block, triton.next_power_of_2(size)))


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_inputs(x, residual, norm_w, gate_w, w13, w2, top_k, out, ws) -> None:  # type: ignore[no-untyped-def]
    _check(x.dim() == 2 and x.stride(1) == 1, f"x must be [T, H] with unit stride in H, got {tuple(x.shape)}")
    t, hidden = x.shape
    _check(1 <= t <= ws.max_rows, f"x has {t} rows; this workspace serves 1..{ws.max_rows} rows (allocate more)")
    e, inter = ws.num_experts, ws.inter
    _check((hidden, top_k) == (ws.hidden, ws.top_k) and x.dtype == ws.dtype,
           f"x {tuple(x.shape)} {x.dtype} / top_k={top_k} do not match the workspace (H={ws.hidden}, "
           f"top_k={ws.top_k}, {ws.dtype}); allocate the workspace for this layer's sizes")
    for name, w, shape in (("gate_w", gate_w, (e, hidden)), ("w13", w13, (e, 2 * inter, hidden)),
                           ("w2", w2, (e, hidden, inter))):
        _check(tuple(w.shape) == shape and w.is_contiguous() and w.dtype == x.dtype,
               f"{name} must be contiguous {shape} {x.dtype}, got {tuple(w.shape)} {w.dtype}")
    _check(norm_w is None or (tuple(norm_w.shape) == (hidden,) and norm_w.is_contiguous()),
           f"norm_w must be [H={hidden}] contiguous or None")
    for name, y in (("out", out), ("residual", residual)):
        _check(y is None or (tuple(y.shape) == (t, hidden) and y.stride(1) == 1 and y.dtype == x.dtype),
               f"{name} must be [T={t}, H={hidden}] {x.dtype} with unit stride in H")
    devs = {y.device for y in (x, residual, norm_w, gate_w, w13, w2, out, ws.h) if y is not None}
    _check(len(devs) == 1, f"all tensors must be on one device, got {sorted(map(str, devs))}")


def moe_stages(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor | None, eps: float,
               gate_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool,
               out: torch.Tensor, workspace: MoEWorkspace, *, pdl: bool,
               config: MoEKernelConfig | None = None, peer: PeerTarget | None = None) -> MoEStages:
    """Check the arguments of :func:`moe_forward` and return its three launches, unlaunched (a
    :class:`MoEStages`); the same arguments, errors and results as ``moe_forward``.

    Args:
        x: [T, H] activations (bf16 or float32; the model dtype), unit stride in H.
        residual: [T, H] like x, or None (then ``out = MoE(h)``). May be the same tensor as ``out`` or ``x``.
        norm_w: [H] post-attention RMSNorm weight, or None when x is already normalized (then h = x).
        eps: RMSNorm epsilon.
        gate_w: [E, H] router weight. w13: [E, 2I, H] gate rows then up rows. w2: [E, H, I]. All contiguous.
        top_k: experts per row; renormalize: divide the k weights by their sum (``norm_topk_prob``).
        out: [T, H] like x, written in full.
        workspace: from ``MoEWorkspace.allocate`` with these sizes and ``max_rows >= T``.
        pdl: launch with programmatic dependent launch (needs sm90+; pass ``pdl_enabled(device)``).
        config: tile sizes (default ``default_config()``).

    Returns:
        The stages; after ``route()``, ``gate_up()``, ``down()`` in that order ``out`` holds the result and the
        workspace the routing (``topk_ids``, ``topk_weights``, ``bitmap``, ``num_slots``, ...).

    Raises:
        ValueError: a shape, dtype, stride or device does not match, T is outside [1, max_rows], ``pdl=True``
            where PDL cannot run (CPU, the Triton interpreter, GPUs before sm90), or a peer with a residual or
            buffers that cannot hold the output's tiles.
    """
    cfg = config or default_config()
    ws = workspace
    _check_inputs(x, residual, norm_w, gate_w, w13, w2, top_k, out, ws)
    _check(peer is None or residual is None, "a published MoE output takes no residual (reduce_rows adds it)")
    check_publish(peer, "publish" if peer is not None else "none", out, triton.cdiv(x.shape[1], cfg.down_block_n))
    _check(not pdl or pdl_supported(x.device),
           "pdl=True needs a CUDA GPU of capability >= 9.0 and no TRITON_INTERPRET; pass pdl=pdl_enabled(device)")
    return MoEStages(x, residual, norm_w, eps, gate_w, w13, w2, top_k, renormalize, out, ws, pdl, cfg, peer)


def moe_forward(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor | None, eps: float,
                gate_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool,
                out: torch.Tensor, workspace: MoEWorkspace, *, pdl: bool,
                config: MoEKernelConfig | None = None, peer: PeerTarget | None = None) -> torch.Tensor:
    """``out = residual + MoE(rmsnorm(x) * norm_w)`` for T <= 8 rows, in three PDL-chained launches (with ``peer``,
    at TP: this rank's ``MoE(...)`` partial published to every rank instead, ``out`` unwritten).

    Arguments and errors are :func:`moe_stages`'s. Returns ``out``; after the call the workspace also holds the
    routing (``topk_ids``, ``topk_weights``, ``bitmap``, ``num_slots``, ...) for inspection.
    """
    stages = moe_stages(x, residual, norm_w, eps, gate_w, w13, w2, top_k, renormalize, out, workspace, pdl=pdl,
                        config=config, peer=peer)
    stages.route()
    stages.gate_up()
    stages.down()
    return out


@dataclass(frozen=True)
class MoEStages:
    """The three launches of :func:`moe_forward` for checked arguments, one method each (the order is route ->
    gate_up -> down; each reads what the one before wrote in ``workspace``). ``bench_moe_head.py --stages`` times
    each alone and the chain's prefixes; everything else calls :func:`moe_forward`, which checks the arguments."""

    x: torch.Tensor
    residual: torch.Tensor | None
    norm_w: torch.Tensor | None
    eps: float
    gate_w: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    top_k: int
    renormalize: bool
    out: torch.Tensor
    ws: MoEWorkspace
    pdl: bool
    cfg: MoEKernelConfig
    peer: PeerTarget | None = None

    @property
    def slots(self) -> int:
        """Static slot count of the expert grids: ``min(E, T * top_k)``."""
        return min(self.ws.num_experts, self.x.shape[0] * self.top_k)

    @property
    def sel_rows(self) -> int:
        """Rows of the routing's selection tile: T rounded up to a power of two, at least ``route_min_rows``."""
        return max(triton.next_power_of_2(self.x.shape[0]), self.cfg.route_min_rows)

    @property
    def row1(self) -> bool:
        """Whether the step runs the one-row FMA forms: one row and ``MoEKernelConfig.row1``."""
        return self.x.shape[0] == 1 and self.cfg.row1

    @property
    def _dot_f32(self) -> bool:
        # exact fp32 products; the interpreter's bf16 dot is wrong
        return self.x.dtype == torch.float32 or interpreting()

    def route(self) -> None:
        """``moe_route_kernel``: norm, router logits, top-k, slots, bitmap."""
        x, ws, cfg = self.x, self.ws, self.cfg
        t, hidden = x.shape
        rp = route_launch_params(hidden, ws.num_experts, self.top_k, cfg.route_programs)
        moe_route_kernel[(rp["grid"], t)](
            x, self.norm_w if self.norm_w is not None else x, self.gate_w,
            ws.h, ws.logits, ws.topk_ids, ws.topk_weights, ws.row_slot,
            ws.slot_expert, ws.slot_weight, ws.num_slots, ws.bitmap, ws.counters,
            t, hidden, ws.num_experts, float(self.eps), x.stride(0),
            TOP_K=self.top_k, TOPK_PAD=rp["TOPK_PAD"], E_BLOCK=rp["E_BLOCK"], E_PAD=rp["E_PAD"],
            H_PAD=rp["H_PAD"], ROWS_C=ROWS, SEL_ROWS=self.sel_rows, BITS=rp["BITS"],
            HAS_NORM=self.norm_w is not None,
            RENORM=bool(self.renormalize), USE_PDL=self.pdl, GATHER=cfg.route_gather,
            KEYS=cfg.route_keys and x.element_size() == 2, num_warps=cfg.route_warps, **launch_kwargs(self.pdl))

    def gate_up(self) -> None:
        """``_moe_gate_up_kernel`` (``moe_row1._moe_gate_up_row1_kernel`` for one row with ``row1``):
        ``act = silu(gate_e(h)) * up_e(h)`` per slot."""
        ws, cfg = self.ws, self.cfg
        t, hidden = self.x.shape
        if self.row1:
            bk = k_chunk(cfg.row1_block_k, hidden)
            _moe_gate_up_row1_kernel[(triton.cdiv(ws.inter, cfg.row1_block_n), self.slots)](
                ws.h, self.w13, ws.act, ws.slot_expert, ws.num_slots, hidden, ws.inter,
                ROWS_C=ROWS, BLOCK_N=cfg.row1_block_n, BLOCK_K=bk, EVEN_K=hidden % bk == 0, USE_PDL=self.pdl,
                num_warps=cfg.row1_warps, num_stages=cfg.row1_stages, **launch_kwargs(self.pdl))
            return
        _moe_gate_up_kernel[(triton.cdiv(ws.inter, cfg.gate_up_block_n), self.slots)](
            ws.h, self.w13, ws.act, ws.slot_expert, ws.slot_weight, ws.num_slots,
            t, hidden, ws.inter,
            ROWS_C=ROWS, BLOCK_N=cfg.gate_up_block_n,
            BLOCK_K=k_chunk(cfg.gate_up_block_k, hidden, 16),
            DOT_F32=self._dot_f32, USE_PDL=self.pdl, num_warps=cfg.gate_up_warps, num_stages=cfg.gate_up_stages,
            **launch_kwargs(self.pdl))

    def down(self) -> None:
        """``_moe_down_kernel``: per-slot down partials, then the last arriver's fixed-order sum + residual."""
        ws, cfg, out = self.ws, self.cfg, self.out
        t, hidden = self.x.shape
        res = self.residual if self.residual is not None else out
        _moe_down_kernel[(triton.cdiv(hidden, cfg.down_block_n), self.slots)](
            ws.act, self.w2, ws.partial, out, res,
            ws.slot_expert, ws.slot_weight, ws.num_slots, ws.row_slot, ws.counters[1:],
            t, hidden, ws.inter, out.stride(0), res.stride(0), **peer_launch_args(self.peer, out),
            TOP_K=self.top_k, TOPK_PAD=triton.next_power_of_2(self.top_k), ROWS_C=ROWS,
            BLOCK_N=cfg.down_block_n, BLOCK_I=k_chunk(cfg.down_block_i, ws.inter, 16),
            HAS_RESIDUAL=self.residual is not None, DOT_F32=self._dot_f32, ROW1=self.row1,
            USE_PDL=self.pdl, PUBLISH=self.peer is not None,
            num_warps=cfg.down_warps, num_stages=cfg.down_stages, **launch_kwargs(self.pdl))
