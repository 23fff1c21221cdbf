"""ModelRunner: loads the model, sizes the KV pool, captures CUDA graphs and runs one ForwardBatch.

Start-up order (after SGLang's ModelRunner, python/sglang/srt/model_executor/model_runner.py):

1. resolve the model (checkpoint directory or preset); select the plugin, agreed by every TP rank
   (``lowlat.runtime.plugin_host.agreed_selection``); refuse when the estimated weights and KV pool cannot fit
   (``lowlat.runtime.memory_check``); build the general model for this TP rank;
2. stream the checkpoint (or the preset's seeded random weights) into it, with a progress bar for
   checkpoints of 1 GiB or more;
3. ``setup_forward()``: build the plugin, if one was selected, into the runner's Dispatcher (which otherwise
   sends every step to the general forward); workspaces add to ``self.reserved_bytes``; with
   ``all_reduce="peer"`` at tp_size > 1, ``open_peer()`` makes the peer buffers of the general forward's
   row-parallel all-reduces (``lowlat.runtime.peer_reduce``; the model was built with them in its TPInfo);
4. size and allocate the KV pool (``lowlat.runtime.memory``), agreeing on the smallest pool over TP ranks;
5. capture CUDA graphs (CUDA with ``cuda_graph``): the Dispatcher gives the function of each captured shape.

One step: ``forward(batch)`` replays a captured graph when one fits, else calls ``self.dispatcher(batch)``;
either way the Dispatcher (``lowlat.runtime.dispatch``) decides and records the path. With a sampling plugin
(plugin API 3, ``Coverage.sampling``) the engine first attaches the step's ``SamplingInfo``
(``attach_sampling``), and the step may return the plugin's sampled ids instead of logits.

A failure at any point frees what was allocated before re-raising.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Callable
from pathlib import Path

import torch

from lowlat.config import EngineConfig, ModelConfig
from lowlat.distributed import SINGLE, TPInfo, kv_heads_per_rank
from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.kv_cache import KVPool
from lowlat.runtime.cuda_graph_runner import CudaGraphRunner
from lowlat.runtime.dispatch import GENERAL, Dispatcher
from lowlat.runtime.memory import KVPoolPlan, plan_kv_pool, workspace_budget
from lowlat.runtime.memory_check import check_start_memory
from lowlat.runtime.peer_reduce import PeerAllReduce
from lowlat.runtime.plugin_host.agreed_selection import select_agreed
from lowlat.runtime.plugin_host.host import PluginHost
from lowlat.runtime.progress import weights_with_progress
from lowlat.runtime.sampling_inputs import SamplingInputs
from lowlat.runtime.scheduler import make_batch
from lowlat.runtime.step_inputs import StepInputs

BIG_CHECKPOINT_BYTES = 1 << 30  # show the loading bar from this size on


class ModelRunner:
    """One rank's model, KV pool and CUDA graphs.

    Args:
        config: the engine configuration.
        tp: this rank's TPInfo (None: no tensor parallelism).
        device: the device to run on (default: ``config.resolved_device``, the current CUDA device on CUDA).
        cpu_group: a gloo-capable process group for host-side agreement between ranks (default: ``tp.group``).
        show_progress: draw progress bars (rank 0 only).

    Attributes:
        model_config, dtype, device, tp: what runs where.
        model: the general model (``forward(batch, kv_pool) -> float32 [R, vocab]``).
        dispatcher: the Dispatcher, always installed (general-only without a plugin); it picks each step's path
            and owns the path state: ``last_path``, ``graph_paths`` per captured shape, ``stats``.
        reserved_bytes: device bytes not yet allocated that must stay out of the KV pool (memory already
            allocated, e.g. eagerly allocated workspaces, is seen by ``torch.cuda.mem_get_info`` and must not be
            added); added to in ``setup_forward``, before the pool is sized.
        kv_pool_ready: callbacks ``(kv_pool) -> None`` run once the KV pool exists, before graph capture.
        kv_pool, kv_plan: the KV pool and its sizing decision; ``dummy_row`` is its padding row.
        step_inputs: the preallocated DECODE/VERIFY inputs (``lowlat.runtime.step_inputs``) the scheduler builds
            batches into; the CUDA graphs' fixed input buffers are these same tensors.
        sampling_inputs: the preallocated SamplingInfo buffers (``lowlat.runtime.sampling_inputs``), only with a
            plugin whose coverage declares sampled ids; else None.
        graph_runner: the CudaGraphRunner, or None when steps run eagerly.
        last_graphed: whether the latest ``forward`` replayed a graph.
        plugin_host: the plugin's selection and binding (``lowlat.runtime.plugin_host.PluginHost``).
        last_path: "plugin" or "general", the path the latest ``forward`` took (read from the Dispatcher).
        peer: the general forward's peer all-reduce (``all_reduce="peer"`` at tp_size > 1), else None; ``tp``
            then carries it (``TPInfo.peer``).

    Raises:
        ConfigError / ValueError / WeightLoadError / KVMemoryError: from resolving, loading or sizing.
    """

    def __init__(self, config: EngineConfig, *, tp: TPInfo | None = None, device: torch.device | None = None,
                 cpu_group: object = None, show_progress: bool = True) -> None:
        from lowlat.loader import resolve_model
        from lowlat.loader.presets import with_layers

        self.config = config
        self.tp = tp or SINGLE
        self.cpu_group = cpu_group if cpu_group is not None else self.tp.group
        self.device = device or _default_device(config)
        self.show_progress = show_progress and self.tp.rank == 0
        self.model: torch.nn.Module | None = None
        self.general_step: Callable[[ForwardBatch, KVPool], torch.Tensor] | None = None
        self.kv_pool: KVPool | None = None
        self.kv_plan: KVPoolPlan | None = None
        self.step_inputs: StepInputs | None = None
        self.sampling_inputs: SamplingInputs | None = None
        self.graph_runner: CudaGraphRunner | None = None
        self.reserved_bytes = 0
        self.kv_pool_ready: list[Callable[[KVPool], None]] = []
        self.last_graphed = False
        self.dummy_row = -1
        self.plugin_host = PluginHost(None)
        self.dispatcher: Dispatcher | None = None
        self.peer: PeerAllReduce | None = None
        try:
            self.model_config: ModelConfig = resolve_model(config.model)
            config.check_model(self.model_config)
            if config.num_layers is not None:
                self.model_config = with_layers(self.model_config, config.num_layers)
            self.dtype = config.resolved_dtype(self.model_config)
            self.plugin_host = select_agreed(config, self.model_config, tp_size=self.tp.size,
                                             group=self.cpu_group)  # the guard, agreed by all ranks: before any load
            check_start_memory(config, self.model_config, self.dtype, device=self.device, tp_size=self.tp.size)
            if config.all_reduce == "peer" and self.tp.size > 1:
                self.peer = PeerAllReduce()
                self.tp = dataclasses.replace(self.tp, peer=self.peer)  # every layer holds this TPInfo
            self.load_model()
            self.num_kv_heads = getattr(self.model, "local_kv_heads", None) or kv_heads_per_rank(
                self.model_config.num_key_value_heads, self.tp.size)
            self.dispatcher = Dispatcher(general_forward=self.general_forward,
                                         vocab_size=self.model_config.vocab_size)
            self.setup_forward()
            self.open_peer()
            self.init_kv_pool()
            if config.cuda_graph and self.device.type == "cuda":
                self.init_cuda_graphs()
        except BaseException:
            self.close()
            raise

    # -- start-up phases -------------------------------------------------------------------------------------

    def load_model(self) -> None:
        """Build the general model for this rank and stream the weights into it."""
        from lowlat.loader import open_weights
        from lowlat.loader.synthetic import synthetic_num_bytes
        from lowlat.models import build_model

        cfg = self.model_config
        self.model = build_model(cfg, dtype=self.dtype, device=self.device, tp=self.tp,
                                 max_context_len=self.config.max_context_len)
        _, weights = open_weights(self.config.model, cfg, seed=self.config.seed, dtype=self.dtype,
                                  device=self.device)
        ckpt_dtype = _checkpoint_dtype(cfg)
        total = synthetic_num_bytes(cfg, ckpt_dtype)
        elem = torch.empty((), dtype=ckpt_dtype).element_size()
        with torch.no_grad():
            self.model.load_weights(weights_with_progress(
                self.plugin_host.retain(weights), total_bytes=total, elem_size=elem,
                enabled=self.show_progress and total >= BIG_CHECKPOINT_BYTES))
        from lowlat.models.general_impl import make_general_step

        self.general_step = make_general_step(self.model, self.config.resolved_general_impl(self.device))

    def setup_forward(self) -> None:
        """Build the selected plugin (if any) and install its Dispatcher, before the KV pool is sized.

        check_model, then build with its PluginBinding (workspaces are allocated now, so the KV pool sizing
        sees them as used); the Dispatcher around the plugin replaces the general-only one, and the binding is
        told when the KV pool exists. Without a plugin the general-only Dispatcher stays.
        """
        dispatcher = self.plugin_host.build(
            model=self.model, engine=self.config, model_config=self.model_config, device=self.device,
            dtype=self.dtype, tp_rank=self.tp.rank, tp_size=self.tp.size,
            tp_group=self.tp.group, agree_group=self.cpu_group, general_forward=self.general_forward,
            workspace_budget_bytes=workspace_budget(self.device))
        if dispatcher is not None:
            self.dispatcher = dispatcher
            self.kv_pool_ready.append(self.plugin_host.attach_kv_pool)

    def open_peer(self) -> None:
        """Make the peer all-reduce's buffers (a collective of the TP group; nothing without ``self.peer``), through
        an allocator accounted against ``workspace_budget``, before the KV pool is sized."""
        if self.peer is None:
            return
        budget, used = workspace_budget(self.device), 0

        def alloc(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            nonlocal used
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if used + nbytes > budget:
                raise ValueError(f"the peer all-reduce's {name} needs {nbytes / 2**20:.1f} MiB but "
                                 f"{(budget - used) / 2**20:.1f} MiB are left after the weights; lower "
                                 "max_batch_size or max_verify_tokens, or use all_reduce='nccl'")
            used += nbytes
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.peer.open(self.tp, self.config, self.model_config, self.dtype, self.device, alloc)

    def check_peer(self) -> None:
        """Raise ``PeerWaitTimeout`` when a cross-rank wait of this rank gave up: the general path's peer
        all-reduce or the plugin's peer buffers (reads their error records)."""
        if self.peer is not None:
            self.peer.check()
        self.plugin_host.check_peers()

    def init_kv_pool(self) -> None:
        """Size (``lowlat.runtime.memory.plan_kv_pool``) and allocate the KV pool; reserve its dummy row.

        Ranks agree on the smallest pool (MIN over ``cpu_group``) so their schedules stay identical.
        """
        cfg = self.config
        per_token = KVPool.bytes_per_token(self.model_config.num_hidden_layers, self.num_kv_heads,
                                           self.model_config.head_dim, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        plan = plan_kv_pool(bytes_per_token=per_token, page_size=cfg.page_size, max_batch_size=cfg.max_batch_size,
                            max_context_len=cfg.max_context_len, device=self.device,
                            kv_cache_fraction=cfg.kv_cache_fraction, reserved_bytes=self.reserved_bytes)
        if self.tp.size > 1:
            import torch.distributed as dist

            n = torch.tensor([plan.num_pages], dtype=torch.int64)
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self.cpu_group)
            plan = KVPoolPlan(int(n.item()), plan.page_size, plan.bytes_per_page, plan.cap_pages, plan.budget_bytes)
        self.kv_plan = plan
        self.kv_pool = KVPool(num_layers=self.model_config.num_hidden_layers, num_pages=plan.num_pages,
                              page_size=cfg.page_size, num_kv_heads=self.num_kv_heads,
                              head_dim=self.model_config.head_dim, dtype=self.dtype, device=self.device,
                              max_reqs=cfg.max_batch_size + 1, max_context_len=cfg.max_context_len)
        self.dummy_row = self.kv_pool.alloc_req()  # never gets slots: req_to_token stays slot 0
        self.step_inputs = StepInputs(device=self.device, max_batch_size=cfg.max_batch_size,
                                      max_tokens_per_req=cfg.max_verify_tokens, dummy_row=self.dummy_row)
        if self.dispatcher is not None and self.dispatcher.samples:
            self.sampling_inputs = SamplingInputs(device=self.device, vocab=self.model_config.vocab_size,
                                                  max_rows=cfg.max_batch_size * cfg.max_verify_tokens)
        for callback in self.kv_pool_ready:
            callback(self.kv_pool)

    def init_cuda_graphs(self) -> None:
        """Capture DECODE and VERIFY graphs (``CudaGraphRunner``) of the path the Dispatcher picks per shape."""
        assert self.kv_pool is not None
        self.graph_runner = CudaGraphRunner(device=self.device, dummy_row=self.dummy_row,
                                            max_batch_size=self.config.max_batch_size,
                                            max_verify_tokens=self.config.max_verify_tokens,
                                            vocab_size=self.model_config.vocab_size, inputs=self.step_inputs)
        assert self.dispatcher is not None
        self.graph_runner.replay_hooks.append(self.dispatcher.replayed)  # replays: no Python dispatch
        d = self.dispatcher
        max_top_k = d.coverage.sampling.max_top_k if d.samples else 0  # type: ignore[union-attr]
        with torch.inference_mode():
            self.graph_runner.capture(function_for=d.function_for, progress=self.show_progress,
                                      ids_variants=d.ids_variants if self.sampling_inputs is not None else None,
                                      sampling=self.sampling_inputs, max_top_k=max_top_k)

    # -- steps -----------------------------------------------------------------------------------------------

    def general_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The general model's forward (``config.resolved_general_impl``): float32 logits ``[R, vocab]``
        (see ForwardBatch)."""
        return self.general_step(batch, self.kv_pool)

    def attach_sampling(self, batch: ForwardBatch, params: list, seeds: list[int], *,
                        logits_required: bool) -> None:
        """Give a DECODE ``batch`` its rows' SamplingInfo (one SamplingParams, seed per row), so that a sampling
        plugin may return ids (``batch.wants_ids`` unless ``logits_required``). Without a sampling plugin, for
        other modes, or when ``logits_required``, nothing is written (the step returns logits)."""
        si = self.sampling_inputs
        if si is None or logits_required or batch.forward_mode is not ForwardMode.DECODE or batch.seq_lens_cpu is None:
            return
        rows = len(params)
        graphs = self.graph_runner
        pad = graphs._padded[rows] if graphs is not None and rows <= graphs.max_bs else rows
        batch.sampling = si.fill(params, seeds, [n - 1 for n in batch.seq_lens_cpu], pad_to=min(pad, si.max_rows))
        batch.logits_required = False

    def forward(self, batch: ForwardBatch, *, fresh: bool = True) -> torch.Tensor:
        """Run one step (in inference mode): replay a CUDA graph when one fits, else the Dispatcher eagerly.

        Args:
            fresh: False lets a replay return a view of the graph's fixed output (``CudaGraphRunner.replay``:
                valid until the next replay; only for reads queued on the stream before it).

        Returns:
            float32 logits ``[R, vocab]``: R = T for DECODE/VERIFY, B (last token per request) for PREFILL; or
            int64 sampled ids ``[R]`` (-1: non-finite logits) when the batch ``wants_ids`` and the plugin path
            serves them (``Dispatcher.serves_ids``).
        """
        if torch.is_inference_mode_enabled():  # the engine's loop already is: skip the context manager
            return self._forward(batch, fresh)
        with torch.inference_mode():
            return self._forward(batch, fresh)

    def _forward(self, batch: ForwardBatch, fresh: bool) -> torch.Tensor:
        graphs = self.graph_runner
        key = graphs.key_for(batch, self._ids_variant(batch)) if graphs is not None else None
        self.last_graphed = key is not None
        if key is not None:
            return graphs.replay(batch, key, fresh=fresh)  # type: ignore[union-attr]
        return self.dispatcher(batch)

    def will_replay(self, batch: ForwardBatch) -> bool:
        """Whether ``forward(batch)`` will replay a CUDA graph (then no model or plugin code runs on the host). An ids
        graph is only ever captured beside its shape's logits graph, so the logits graph's presence decides."""
        return self.graph_runner is not None and self.graph_runner.can_run(batch)

    def _ids_variant(self, batch: ForwardBatch) -> str:
        """The ids graph variant for ``batch`` ("" when it replays the logits graph): only for a SamplingInfo in
        this runner's buffers (an ids graph reads those) that the plugin serves."""
        info, si = batch.sampling, self.sampling_inputs
        if info is None or si is None or not self.dispatcher.serves_ids(batch):  # type: ignore[union-attr]
            return ""
        return info.variant if info.temperature.data_ptr() == si.info(1).temperature.data_ptr() else ""

    @property
    def last_path(self) -> str:
        """"plugin" or "general": the path the latest ``forward`` took (the Dispatcher's record)."""
        return (self.dispatcher.last_path if self.dispatcher is not None else None) or GENERAL

    @property
    def forward_fn(self) -> Callable[[ForwardBatch], torch.Tensor]:
        """What an eager step runs: the Dispatcher (kept for callers of API 2's name)."""
        return self.dispatcher if self.dispatcher is not None else self.general_forward

    def prepare_batch(self, mode: ForwardMode, rows: list[int], prefix_lens: list[int],
                      token_lists: list[list[int]]) -> ForwardBatch:
        """Allocate KV slots for ``token_lists`` on top of ``prefix_lens`` cached tokens and build a batch.

        For tests and benchmarks that drive the runner directly; rows come from ``kv_pool.alloc_req()``.
        """
        return make_batch(self.kv_pool, mode, rows, prefix_lens, token_lists)

    def close(self) -> None:
        """Free graphs, KV pool and weights (idempotent)."""
        if self.graph_runner is not None:
            self.graph_runner.close()
        self.graph_runner = None
        self.kv_pool = None
        self.step_inputs = self.sampling_inputs = None
        self.model = self.general_step = None
        self.plugin_host.close()
        self.plugin_host = PluginHost(None)
        self.dispatcher = None
        if self.peer is not None:
            self.peer.close()
        gc.collect()  # plugin objects may hold weights in reference cycles; free them before the next runner
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def _default_device(config: EngineConfig) -> torch.device:
    if config.resolved_device == "cuda":
        if not torch.cuda.is_available():
            from lowlat.platform import no_cuda_message

            raise ValueError(no_cuda_message("device='cuda' (--device cuda)",
                                             "--device cpu on the command line, EngineConfig(device='cpu') from "
                                             "Python (or 'auto')"))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _checkpoint_dtype(cfg: ModelConfig) -> torch.dtype:
    from lowlat.config import DTYPES

    return DTYPES.get(cfg.torch_dtype, torch.bfloat16)


def is_checkpoint_dir(model: str) -> bool:
    """Whether ``model`` names an existing directory (else it is a preset name)."""
    return Path(os.path.expanduser(model)).is_dir()
