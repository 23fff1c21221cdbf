"""MonoForward: a decode/verify step as embedding, persistent launches for the decoder layers, and the LM head.

Per step: ``embed_kernel`` (also bumps the device step tag), then the decoder layers: one persistent launch for
all of them (``kernels.step``, option ``one_launch``) or, per layer (the default), K1 (``k1_attn_in``) and K2
(``k2_attn_out_mlp``); then ``head_kernel``. The residual stream lives in the workspace ``x [8, H]`` between
launches. Everything a launch reads comes from device tensors, so a captured CUDA graph replays correctly
with new inputs and a new tag. A missed deadline inside a launch is reported by ``check_errors`` (eager steps
check after every step; captured steps are checked at the next ``prepare_for_replay``). At tp_size > 1
(``lowlat_amd_mono.tp``) K2 is ``kernels.k2_tp``'s (dense layers) or ``kernels.k2_moe_tp``'s (MoE layers): o_proj and
down (the expert down) publish to every rank and two reduce stages of the same launch sum the ranks; the embedding is
all-reduced and the logits gathered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl
from lowlat.plugin import ForwardBatch, ForwardMode, ModelConfig
from lowlat.plugin import rope_tables as core_rope_tables

from lowlat_amd_mono.kernels import plan as P
from lowlat_amd_mono.kernels.embed_head import embed_kernel, head_kernel
from lowlat_amd_mono.kernels.k1_attn_in import k1_attn_in_kernel
from lowlat_amd_mono.kernels.k2_attn_out_mlp import k2_dense_kernel, k2_moe_kernel
from lowlat_amd_mono.kernels.k2_moe_tp import k2_moe_tp_kernel
from lowlat_amd_mono.kernels.k2_tp import k2_dense_tp_kernel
from lowlat_amd_mono.kernels.launch import MonoOptions, StageRunner, is_interpreted
from lowlat_amd_mono.kernels.step import WTAB_COLS, step_dense_kernel, step_moe_kernel
from lowlat_amd_mono.kernels.sync import CNT_STRIDE, CTL_SIZE, KIND_COUNT, TIMER_CUDA
from lowlat_amd_mono.tp import MonoTP
from lowlat_amd_mono.weights import bind_weights, layer_pointers

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
AllocFn = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


class MonoStageTimeout(RuntimeError):
    """A cross-workgroup wait missed its deadline; every workgroup left the launch and the step's output is
    invalid. Attributes: ``layer``, ``stage`` (the waiting stage's name), ``awaited`` (the stage it waited on).
    ``progress`` names what was missing: the first unpublished item (a flag wait) or the items counted so far
    (a stage-counter wait)."""

    def __init__(self, layer: int, stage: str, awaited: str, progress: str, deadline_ms: float) -> None:
        self.layer, self.stage, self.awaited = layer, stage, awaited
        super().__init__(
            f"amd_mono: layer {layer}, stage {stage} waited more than {deadline_ms:g} ms for {awaited} "
            f"({progress}) and aborted the step; every workgroup left the launch. Rerun with "
            "LOWLAT_MONO_STAGED=1 to run the stages as separate launches, or raise LOWLAT_MONO_DEADLINE_MS")


def rope_tables(cfg: ModelConfig, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[max_len, head_dim / 2]`` float32 on ``device``: core's tables (plugin API 2), bit for bit
    the general path's. Raises ValueError for a rope_scaling type core does not support."""
    return core_rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_len, device)


class MonoForward:
    """The plugin forward of lowlat-amd-mono (``PluginForward``): DECODE/VERIFY steps of 1 to 8 rows.

    Args:
        model_config: the model's shapes; params: tensors named as in the general model (this rank's shards at
        tp_size > 1); dtype, device: compute dtype and device; alloc_workspace: accounted allocator
        ``(name, shape, dtype)``; max_context_len: the longest sequence (RoPE table size); options: launch options
        (resolved from the environment when None); tp: this rank's ``MonoTP`` at tp_size > 1 (``tp.open_tp``).
    Raises:
        ValueError: a missing parameter or one of the wrong shape, a head_dim that is not a power of two >= 16, or
            at TP the option ``one_launch`` or tiles the peer buffers cannot hold.
    """

    def __init__(self, *, model_config: ModelConfig, params: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, alloc_workspace: AllocFn, max_context_len: int,
                 options: MonoOptions | None = None, tp: MonoTP | None = None) -> None:
        self.cfg, self.tp = model_config, tp
        self.dims = dm = P.Dims.from_config(model_config, tp.bufs.world if tp is not None else 1)
        if dm.head_dim < 16 or dm.head_dim & (dm.head_dim - 1):
            raise ValueError(f"amd_mono needs head_dim a power of two >= 16, got {dm.head_dim}")
        if dtype not in _TL_DTYPES:
            raise ValueError(f"amd_mono runs bfloat16, float16 or float32, not {dtype}")
        self.device, self.dtype, self.max_context_len = torch.device(device), dtype, max_context_len
        self.interpret = is_interpreted(k1_attn_in_kernel)
        if self.device.type == "cpu" and not self.interpret:
            raise ValueError("amd_mono runs on CPU only under the Triton interpreter: set TRITON_INTERPRET=1 before "
                             "importing lowlat_amd_mono")
        self.options = options or MonoOptions.resolve(self.device, interpret=self.interpret)
        if self.options.staged:
            nprog = 4 if self.device.type == "cpu" else torch.cuda.get_device_properties(device).multi_processor_count
        elif self.interpret:  # one persistent program: every wait targets work it has already done (CPU tests)
            nprog = 1
        else:
            per_sm = self.options.programs_per_sm or (2 if dm.any_moe else 1)
            nprog = torch.cuda.get_device_properties(device).multi_processor_count * per_sm
        self.plan = P.MonoPlan.build(dm, nprog, interpret=self.interpret, bk_max=self.options.gemv_bk_max,
                                     max_tile_elems=self.options.gemv_tile_elems)
        self.runner = StageRunner(self.device, self.options, self.interpret, nprog)
        self.w = bind_weights(params, dm, dtype)
        if tp is not None:
            if self.options.one_launch:
                raise ValueError("amd_mono's one_launch has no TP form (its step kernel does not publish across "
                                 "ranks): unset LOWLAT_MONO_ONE_LAUNCH / amd_mono_one_launch at tp_size > 1")
            tp.check_tiles(self.plan)
        # One launch for all layers, unless staged or the model mixes dense and MoE layers (one kernel per kind).
        self.one_launch = self.options.one_launch and not self.options.staged and not (dm.any_moe and dm.any_dense)
        self._two_launch_reason = ""  # why attach_kv_pool turned one_launch off
        self.vocab = dm.vocab
        g, mi = dm.group, self.plan.max_items
        alloc = alloc_workspace
        self.x = alloc("amd_mono.x", (P.MAX_ROWS, dm.hidden), dtype)
        self.x_mid = alloc("amd_mono.x_mid", (P.MAX_ROWS, dm.hidden), dtype)
        self.q = alloc("amd_mono.q", (P.MAX_ROWS, dm.heads * dm.head_dim), dtype)
        self.attn_out = alloc("amd_mono.attn_out", (P.MAX_ROWS, dm.heads * dm.head_dim), dtype)
        self.qkv_part = alloc("amd_mono.qkv_part", (self.plan.qkv.ksplit, P.MAX_ROWS, dm.qkv_rows), torch.float32)
        rows_att = dm.kv_heads * self.plan.nsplit_max * P.MAX_ROWS * g
        self.att_op = alloc("amd_mono.att_op", (rows_att, dm.head_dim), torch.float32)
        self.att_ml = alloc("amd_mono.att_ml", (rows_att, 2), torch.float32)
        self.act = alloc("amd_mono.act", (P.MAX_ROWS, max(dm.inter, 1)), dtype)
        self.router_logits = alloc("amd_mono.router_logits", (P.MAX_ROWS, max(dm.experts, 1)), torch.float32)
        self.act_moe = alloc("amd_mono.act_moe", (P.MAX_ROWS * max(dm.topk, 1), P.MAX_ROWS, max(dm.moe_inter, 1)),
                             dtype)
        self.slot_e = alloc("amd_mono.slot_e", (P.MAX_ROWS * max(dm.topk, 1),), torch.int32)
        self.slot_w = alloc("amd_mono.slot_w", (P.MAX_ROWS * max(dm.topk, 1), 16), torch.float32)
        self.flags = alloc("amd_mono.flags", (dm.layers, P.NUM_STAGES, mi), torch.int32)
        # Stage counters (sync.wait_count): one int32 per (layer, stage), each on its own 128-byte line.
        self.n_counters = P.next_pow2(dm.layers * P.NUM_STAGES)
        self.counters = alloc("amd_mono.counters", (self.n_counters, CNT_STRIDE), torch.int32)
        self.ctl = alloc("amd_mono.ctl", (CTL_SIZE,), torch.int32)
        self.step = alloc("amd_mono.step", (1,), torch.int32)
        self.wtab = alloc("amd_mono.layer_pointers", (dm.layers, WTAB_COLS), torch.int64)
        self.dbg = alloc("amd_mono.debug_masks", (dm.layers,), torch.int32)
        for t in (self.flags, self.counters, self.ctl, self.step):
            t.zero_()
        self.cos, self.sin = rope_tables(model_config, max_context_len, self.device)
        self._ctl_host = torch.zeros(CTL_SIZE, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._errors_seen = 0
        self.kv_pool: Any = None
        self.debug_masks = [0] * dm.layers  # per layer: skip (bits 0-7) / never publish (bits 8-15) per stage

    @property
    def launch_note(self) -> str:
        """How the decoder layers of a step launch, and why one launch is not used when it was asked for."""
        if self.options.staged:
            return "one launch per stage"
        if self.one_launch:
            return "one persistent launch for all layers"
        return "two persistent launches per layer" + self._two_launch_reason

    # ----- plugin API -------------------------------------------------------------------------------------
    def attach_kv_pool(self, kv_pool: Any) -> None:
        """Bind the engine's KV pool (``binding.on_kv_pool_ready`` callback). Raises ValueError on a mismatch."""
        want = (self.dims.kv_heads, self.dims.head_dim)
        k0 = kv_pool.k_buffers[0]
        if len(kv_pool.k_buffers) != self.dims.layers or tuple(k0.shape[1:]) != want or k0.dtype != self.dtype:
            raise ValueError(f"KV pool has {len(kv_pool.k_buffers)} layers of {tuple(k0.shape)} {k0.dtype}; "
                             f"amd_mono needs {self.dims.layers} layers of [slots, {want[0]}, {want[1]}] {self.dtype}")
        if not all(b.is_contiguous() for b in (*kv_pool.k_buffers, *kv_pool.v_buffers)):
            raise ValueError("amd_mono needs contiguous KV buffers")
        self.kv_pool = kv_pool
        if self.one_launch:
            table, why = layer_pointers(self.w, kv_pool.k_buffers, kv_pool.v_buffers, self.dims.any_moe)
            if table is None:
                self.one_launch, self._two_launch_reason = False, f" ({why})"
            else:
                self.wtab.copy_(table)

    def supports(self, batch: ForwardBatch) -> bool:
        """DECODE or VERIFY steps of 1 to 8 rows with a uniform token count per request, once the pool exists."""
        tpr = _tokens_per_req(batch)
        n = batch.num_tokens
        if self.kv_pool is None or batch.forward_mode not in (ForwardMode.DECODE, ForwardMode.VERIFY):
            return False
        if not tpr or not 1 <= n <= P.MAX_ROWS or n % tpr:
            return False
        return batch.seq_lens_cpu is None or max(batch.seq_lens_cpu) <= self.max_context_len

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; returns float32 logits ``[T, vocab]`` and writes every layer's K/V at out_cache_loc.

        Raises:
            RuntimeError: the KV pool is not attached yet; ValueError: a step ``supports`` refuses;
            MonoStageTimeout: (eager steps) a wait missed its deadline; ResidencyError: the grid cannot fit.
        """
        if self.kv_pool is None:
            raise RuntimeError("amd_mono forward called before the KV pool exists (binding.on_kv_pool_ready)")
        if not self.supports(batch):
            raise ValueError(f"amd_mono serves DECODE/VERIFY steps of 1..{P.MAX_ROWS} uniform rows; got "
                             f"{batch.forward_mode.name} with {batch.num_tokens} tokens")
        shape = self.plan.step_shape(batch.num_tokens, _tokens_per_req(batch))
        self.embed(batch.input_ids)
        if self.tp is not None:
            self.tp.all_reduce_embedding(self.x[:shape.rows], site=2 * self.dims.layers)
        self.run_layers(batch, shape)
        logits = torch.empty(shape.rows, self.vocab, dtype=torch.float32, device=self.device)
        grid, args, meta = self.head_launch(logits)
        head_kernel[grid](*args, **meta, **({"launch_pdl": True} if self.options.pdl else {}))
        if self.tp is not None:
            logits = self.tp.gather_logits(logits)
        if not self.options.staged:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                self._ctl_host.copy_(self.ctl, non_blocking=True)
            else:
                self.check_errors()
        return logits

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        """Before a graph replay: raise the error a previous replay recorded (read from pinned memory)."""
        self._raise_if_new(self._ctl_host.tolist())

    def check_errors(self) -> None:
        """Synchronize on the error record and raise MonoStageTimeout if a wait missed its deadline since the last
        check (the record names the layer, the waiting stage and the stage it waited for)."""
        self._raise_if_new(self.ctl.tolist())

    def embed(self, input_ids: torch.Tensor) -> None:
        """The step's first launch: ``x[:T] = embed[input_ids]`` (int64 ``[T]``), a new step tag, and (with
        ``stage_counters``) zeroed stage counters. At TP only this rank's vocabulary rows; other ids give zeros."""
        v0 = self.tp.vocab_start if self.tp is not None else 0
        embed_kernel[(input_ids.shape[0],)](input_ids, self.w["embed"], self.x, self.step, self.counters, v0,
                                            self.w["embed"].shape[0],
                                            H=self.dims.hidden, BH=min(1024, P.next_pow2(self.dims.hidden)),
                                            N_CNT=self.n_counters if self.options.stage_counters else 0)

    def run_layers(self, batch: ForwardBatch, shape: P.StepShape) -> None:
        """Every decoder layer of the step over ``x`` (after ``embed``): the one-launch step, or K1 and K2 per
        layer."""
        if self.one_launch:
            self.runner.run(*self.step_launch(batch, shape))
            return
        for layer in range(self.dims.layers):
            self._k1(layer, batch, shape)
            self._k2(layer, batch, shape)

    def row1(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs its GEMVs in the one-row FMA form (the kernels' ``ROW1``): exactly
        one row and ``MonoOptions.row1_fma``. Each CUDA graph is captured at one row count, so it holds one form."""
        return rows == 1 and self.options.row1_fma

    def plan_for(self, rows: int) -> P.MonoPlan:
        """The tiles a step of ``rows`` rows launches with: ``plan``, or at ``ROW1`` ``plan.for_row1`` (the same
        tiles and items, chunks kept within the FMA form's register budget)."""
        return self.plan.for_row1(self.options.num_warps) if self.row1(rows) else self.plan

    def head_launch(self, logits: torch.Tensor) -> tuple[tuple[int], tuple[Any, ...], dict[str, Any]]:
        """The LM head over ``x`` into float32 ``logits [T, vocab]`` as ``(grid, args, meta)`` of ``head_kernel``."""
        dm, rows = self.dims, logits.shape[0]
        pl = self.plan_for(rows)
        args = (self.x, self.w["norm"], self.w["lm_head"], logits, rows, self.vocab, logits.stride(0), dm.eps)
        meta = dict(H=dm.hidden, BN=pl.head_bn, BK=pl.head_bk, DT=_TL_DTYPES[self.dtype], INTERP=self.interpret,
                    PREC=self._prec, USE_PDL=self.options.pdl, ROW1=self.row1(rows))
        return (P.cdiv(self.vocab, pl.head_bn),), args, meta

    # ----- test and benchmark hooks ---------------------------------------------------------------------------
    def set_debug(self, layer: int, *, skip: tuple[int, ...] = (), never_publish: tuple[int, ...] = ()) -> None:
        """Alter stages of ``layer`` (stage ids from ``kernels.plan``): skip their compute (they still publish),
        or make them never publish (fault injection). Eager steps only: a captured graph keeps its values."""
        self.debug_masks[layer] = sum(1 << s for s in skip) | sum(1 << (8 + s) for s in never_publish)
        self.dbg[layer] = self.debug_masks[layer]  # the one-launch step reads its masks from the device

    def stage_name(self, layer: int, stage: int) -> str:
        names = P.STAGE_NAMES_MOE if self.dims.moe_layers[layer] else P.STAGE_NAMES_DENSE
        return names.get(stage, f"stage {stage}")

    # ----- internals -------------------------------------------------------------------------------------------
    @property
    def _prec(self) -> str | None:
        return "ieee" if self.dtype == torch.float32 else None

    def _raise_if_new(self, rec: list[int]) -> None:
        if rec[1] <= self._errors_seen:
            return
        self._errors_seen = rec[1]
        layer, stage, awaited, item, kind = rec[3], rec[4], rec[5], rec[6], rec[7]
        progress = f"{item} items published" if kind == int(KIND_COUNT) else f"item {item} unpublished"
        # The one-launch step's QKV waits on the previous layer's last stage; every other wait is within a layer.
        waited = (f"{self.stage_name(layer - 1, awaited)} of layer {layer - 1}" if stage == P.S_QKV and layer > 0
                  else self.stage_name(layer, awaited))
        raise MonoStageTimeout(layer, self.stage_name(layer, stage), waited, progress, self.options.deadline_ms)

    def _meta(self, rows: int) -> dict[str, Any]:
        return {"DT": _TL_DTYPES[self.dtype], "PREC": self._prec, "ROW1": self.row1(rows), **self.runner.common_meta()}

    def _pf_bytes(self) -> int:
        return self.options.l2_prefetch_bytes // 16 * 16

    def _k1(self, layer: int, b: ForwardBatch, shape: P.StepShape) -> None:
        self.runner.run(*self.k1_launch(layer, b, shape))

    def k1_launch(self, layer: int, b: ForwardBatch, shape: P.StepShape) -> tuple[str, Any, dict[int, int],
                                                                               tuple[Any, ...], dict[str, Any]]:
        """K1 of ``layer`` as ``(name, kernel, stage -> items, args, meta)`` for ``StageRunner.run``."""
        dm, pl, w = self.dims, self.plan_for(shape.rows), self.w["layers"][layer]
        args = (self.x, self.q, self.qkv_part, self.kv_pool.k_buffers[layer], self.kv_pool.v_buffers[layer],
                w["ln1"], w["qkv"], w["q_norm"], w["k_norm"], b.positions, b.out_cache_loc, self.cos, self.sin,
                self.flags[layer], self.ctl, self.step,
                shape.rows, layer, self.runner.deadline, self.debug_masks[layer], dm.eps)
        meta = dict(H=dm.hidden, HQ=dm.heads, HKV=dm.kv_heads, D=dm.head_dim, BN=pl.qkv.bn, BK=pl.qkv.bk,
                    KS=pl.qkv.ksplit, KCH=pl.qkv.kchunk, QK_NORM=dm.qk_norm, MAX_ITEMS=pl.max_items,
                    PF_BYTES=self._pf_bytes(), **self._meta(shape.rows))
        return "k1_attn_in", k1_attn_in_kernel, {s: pl.items(s, shape, False) for s in P.K1_STAGES}, args, meta

    def _k2(self, layer: int, b: ForwardBatch, shape: P.StepShape) -> None:
        self.runner.run(*self.k2_launch(layer, b, shape))

    def k2_launch(self, layer: int, b: ForwardBatch, shape: P.StepShape) -> tuple[str, Any, dict[int, int],
                                                                               tuple[Any, ...], dict[str, Any]]:
        """K2 of ``layer`` as ``(name, kernel, stage -> items, args, meta)`` for ``StageRunner.run`` (benchmarks
        launch single stages of it with other tiles: bench_gemv.py)."""
        dm, pl, w = self.dims, self.plan_for(shape.rows), self.w["layers"][layer]
        moe = dm.moe_layers[layer]
        r2t = self.kv_pool.req_to_token
        head = (self.x, self.x_mid, self.q, self.attn_out, self.att_op, self.att_ml)
        kv = (self.kv_pool.k_buffers[layer], self.kv_pool.v_buffers[layer], b.seq_lens, b.req_pool_indices, r2t)
        sync = (self.flags[layer], self.counters[layer * P.NUM_STAGES], self.ctl, self.step)
        scalars = (shape.rows, shape.batch, shape.nsplit, r2t.stride(0), layer, self.runner.deadline,
                   self.debug_masks[layer], dm.eps, dm.head_dim ** -0.5 * math.log2(math.e))
        meta = dict(H=dm.hidden, HQ=dm.heads, HKV=dm.kv_heads, D=dm.head_dim, TPR=shape.tpr, M_ATT=shape.m_att,
                    BLOCK_S=pl.block_s, NSPLIT_MAX=pl.nsplit_max, BN_O=pl.o.bn, BK_O=pl.o.bk,
                    MAX_ITEMS=pl.max_items, PF_BYTES=self._pf_bytes(), COUNT=self.options.stage_counters,
                    **self._meta(shape.rows))
        if moe:
            assert pl.router and pl.eup and pl.edown
            meta |= dict(E=dm.experts, E_P2=P.next_pow2(dm.experts), TOPK=dm.topk, NORM_TOPK=dm.norm_topk,
                         IM=dm.moe_inter, BN_R=pl.router.bn, BK_R=pl.router.bk, BN_EU=pl.eup.bn, BK_EU=pl.eup.bk,
                         BN_ED=pl.edown.bn, BK_ED=pl.edown.bk)
            mlp: tuple[Any, ...] = (self.router_logits, self.act_moe, self.slot_e, self.slot_w, *kv, w["o"],
                                    w["ln2"], w["router"], w["w13"], w["w2"])
            kernel, stages, name = k2_moe_kernel, P.K2_MOE_STAGES, "k2_attn_out_moe"
        else:
            assert pl.gu and pl.down
            mlp = (self.act, *kv, w["o"], w["ln2"], w["gate_up"], w["down"])
            meta |= dict(INTER=dm.inter, BN_GU=pl.gu.bn, BK_GU=pl.gu.bk, BN_D=pl.down.bn, BK_D=pl.down.bk)
            kernel, stages, name = k2_dense_kernel, P.K2_DENSE_STAGES, "k2_attn_out_mlp"
        args = (*head, *mlp, *sync, *scalars)
        if self.tp is not None:  # the same buffers, then the peer buffers' (kernels.k2_tp, kernels.k2_moe_tp)
            ptensors, pscalars, pmeta = self.tp.peer_args()
            b = self.tp.bufs
            # Local waits downstream of a peer wait may also wait out the peer deadline (same clock on CUDA).
            dl = self.runner.deadline + (b.deadline if self.runner.timer == TIMER_CUDA and pmeta["PTIMER"] else 0)
            scalars = (*scalars[:5], dl, *scalars[6:])
            args = (*head, *mlp, *sync, *ptensors, *scalars, *pscalars)
            meta |= pmeta
            kernel, stages, name = ((k2_moe_tp_kernel, P.K2_MOE_TP_STAGES, "k2_attn_out_moe_tp") if moe else
                                    (k2_dense_tp_kernel, P.K2_DENSE_TP_STAGES, "k2_attn_out_mlp_tp"))
        return name, kernel, {s: pl.items(s, shape, moe) for s in stages}, args, meta

    def step_launch(self, b: ForwardBatch, shape: P.StepShape) -> tuple[str, Any, dict[int, int], tuple[Any, ...],
                                                                       dict[str, Any]]:
        """The one-launch step over every layer as ``(name, kernel, {}, args, meta)`` for ``StageRunner.run``
        (persistent only: the stage-per-launch mode runs K1/K2)."""
        dm, pl = self.dims, self.plan_for(shape.rows)
        r2t = self.kv_pool.req_to_token
        head = (self.x, self.x_mid, self.q, self.attn_out, self.att_op, self.att_ml, self.qkv_part)
        tail = (self.wtab, self.dbg, b.positions, b.out_cache_loc, self.cos, self.sin, b.seq_lens,
                b.req_pool_indices, r2t, self.flags, self.counters, self.ctl, self.step,
                shape.rows, shape.batch, shape.nsplit, r2t.stride(0), self.runner.deadline, dm.eps,
                dm.head_dim ** -0.5 * math.log2(math.e))
        meta = dict(L=dm.layers, H=dm.hidden, HQ=dm.heads, HKV=dm.kv_heads, D=dm.head_dim, TPR=shape.tpr,
                    M_ATT=shape.m_att, BLOCK_S=pl.block_s, NSPLIT_MAX=pl.nsplit_max, BN_Q=pl.qkv.bn, BK_Q=pl.qkv.bk,
                    KS=pl.qkv.ksplit, KCH=pl.qkv.kchunk, QK_NORM=dm.qk_norm, BN_O=pl.o.bn, BK_O=pl.o.bk,
                    MAX_ITEMS=pl.max_items, PF_BYTES=self._pf_bytes(), COUNT=self.options.stage_counters,
                    **self._meta(shape.rows))
        if dm.any_moe:
            assert pl.router and pl.eup and pl.edown
            args = (*head, self.router_logits, self.act_moe, self.slot_e, self.slot_w, *tail)
            meta |= dict(E=dm.experts, E_P2=P.next_pow2(dm.experts), TOPK=dm.topk, NORM_TOPK=dm.norm_topk,
                         IM=dm.moe_inter, BN_R=pl.router.bn, BK_R=pl.router.bk, BN_EU=pl.eup.bn, BK_EU=pl.eup.bk,
                         BN_ED=pl.edown.bn, BK_ED=pl.edown.bk)
            return "step_moe", step_moe_kernel, {}, args, meta
        assert pl.gu and pl.down
        meta |= dict(INTER=dm.inter, BN_GU=pl.gu.bn, BK_GU=pl.gu.bk, BN_D=pl.down.bn, BK_D=pl.down.bk)
        return "step_dense", step_dense_kernel, {}, (*head, self.act, *tail), meta


def _tokens_per_req(batch: ForwardBatch) -> int | None:
    """New tokens per request: the batch's uniform count (a DECODE batch without it has 1)."""
    if batch.tokens_per_req:
        return batch.tokens_per_req
    return 1 if batch.forward_mode is ForwardMode.DECODE else None
