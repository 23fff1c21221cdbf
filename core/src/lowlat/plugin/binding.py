"""PluginBinding: what core hands a plugin's ``build``, and PluginForward: what build returns.

Order at engine start (DESIGN §4): discover -> guard -> load weights -> check_model -> build(binding)
-> size the KV pool from the memory left (workspaces counted) -> ``binding.kv_pool`` becomes readable and
ready callbacks run -> dispatcher installed -> graphs captured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from lowlat.config import EngineConfig, ModelConfig
from lowlat.distributed import TPInfo
from lowlat.errors import KVPoolNotReady, PluginBuildError
from lowlat.forward_batch import ForwardBatch

PeerFactory = Callable[[int, torch.dtype, int, Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]], Any]
"""``factory(capacity, dtype, block, alloc) -> PeerBuffers``: the runtime's rendezvous of the TP group
(``lowlat.runtime.peer_reduce.peer_factory``), handed to the binding at tp_size > 1."""


@runtime_checkable
class PluginForward(Protocol):
    """What a plugin's build returns.

    ``supports(batch)`` may refuse a covered step (e.g. a context longer than its kernels handle);
    ``forward(batch)`` returns float32 logits [R, vocab] (ForwardBatch's convention, full vocab on every
    TP rank) and writes every layer's K and V at exactly ``batch.out_cache_loc``. With ``coverage.sampling`` in its
    spec (plugin API 3), when ``batch.wants_ids`` it returns int64 ids [R] instead: each row's token sampled
    as ``batch.sampling`` says, or -1 for a row whose logits were not all finite (the runtime only sets
    ``wants_ids`` for steps ``coverage.sampling.covers``). Optional hooks:
    ``prepare_for_capture(batch)`` before a CUDA graph records ``forward`` for that shape, and
    ``prepare_for_replay(batch)`` before each replay (host-side only; it must not launch device work
    that the graph does not also contain).
    """

    def supports(self, batch: ForwardBatch) -> bool: ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


def rope_tables(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None, max_positions: int,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin tables equal bit for bit to the general path's (plugin API 2).

    Angles are ``float(pos) * inv_freq`` in float32 with HF's default, linear and Llama-3 rope scaling rules
    (``lowlat.layers.rotary``); the general path's tables repeat these two halves along head_dim
    (neox-style rotate_half).

    Returns:
        (cos, sin), each float32 [max_positions, head_dim // 2], contiguous, on ``device``.
    Raises:
        ValueError: the model's rope_scaling type is not supported.
    """
    from lowlat.layers.rotary import rope_angles

    freqs = rope_angles(head_dim, rope_theta, rope_scaling, max_positions, device)
    return freqs.cos().contiguous(), freqs.sin().contiguous()



class PluginBinding:
    """Everything a plugin's build may use. Attributes are read-only by convention.

    Attributes:
        plugin: the plugin's name.
        model_config, engine_config: the model and engine configurations.
        device, dtype: where and in what dtype the model runs.
        params: the loaded general model's parameters by name (per TP rank; see docs/writing-a-plugin.md).
        tp_rank, tp_size, tp_group: tensor parallelism (group None at size 1); ``tp`` the same as a TPInfo.
        checkpoint_tensors: original checkpoint tensors by HF name when the spec sets retain_checkpoint,
            else empty; released right after build.
        workspace_bytes: bytes handed out by ``alloc_workspace`` so far.
        peers: the PeerBuffers ``peer_buffers`` opened (the runtime checks their error records after each step
            and closes them with the engine).
    """

    def __init__(
        self,
        *,
        plugin: str,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        params: dict[str, torch.Tensor],
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        checkpoint_tensors: dict[str, torch.Tensor] | None = None,
        workspace_budget_bytes: int | None = None,
        peer_factory: PeerFactory | None = None,
    ) -> None:
        self.plugin = plugin
        self.model_config = model_config
        self.engine_config = engine_config
        self.device = device
        self.dtype = dtype
        self.params = params
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.checkpoint_tensors: dict[str, torch.Tensor] = checkpoint_tensors or {}
        self.workspace_bytes = 0
        self._budget = workspace_budget_bytes
        self._kv_pool: Any = None
        self._kv_callbacks: list[Callable[[Any], None]] = []
        self._peer_factory = peer_factory
        self.peers: list[Any] = []

    @property
    def tp(self) -> TPInfo:
        """This rank's place in the TP group (``lowlat.distributed.TPInfo``: rank, size, group)."""
        return TPInfo(rank=self.tp_rank, size=self.tp_size, group=self.tp_group)

    def peer_buffers(self, capacity: int, dtype: torch.dtype, *, block: int = 1024) -> Any:
        """This rank's peer buffers for cross-rank tiles (plugin API 4): ``lowlat.plugin.peer`` has the layout and
        the device functions that publish into them and wait on them.

        A collective: every rank's build calls it at the same point, with the same arguments. The buffers are
        allocated through ``alloc_workspace`` (accounted; names ``peer.peer_data`` etc.), mapped into every rank,
        and given the engine's wait deadline (half the step deadline, at most 5 s on CUDA). The runtime turns a
        wait that gave up into ``PeerWaitTimeout`` after the step, naming the rank, the awaited peer and the site,
        and closes the buffers with the engine.

        Args:
            capacity: elements per rank one call may publish (e.g. ``rows x hidden_size``); dtype: bf16, fp16 or
                fp32; block: elements per flag tile of ``peer_all_reduce`` (a power of two; the flags hold
                ``ceil(capacity / block)`` tiles, which also bounds the tile index a kernel may publish).
        Returns:
            a ``PeerBuffers`` (``lowlat.plugin.peer.PeerBuffers`` describes what kernels read of it).
        Raises:
            PluginBuildError: at tp_size 1, on a binding the engine did not make (no group to meet), or when the
                buffers do not fit the workspace budget or a rank could not share or map them (naming it).
        """
        if self.tp_size == 1:
            raise PluginBuildError(f"plugin {self.plugin!r} asked for peer buffers at tp_size 1; they connect TP "
                                   "ranks: ask only when binding.tp_size > 1")
        if self._peer_factory is None:
            raise PluginBuildError(f"plugin {self.plugin!r} asked for peer buffers of a binding without a TP "
                                   "group's rendezvous; build through an engine (ModelRunner) at tp_size > 1")

        def alloc(name: str, shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return self.alloc_workspace(f"peer.{name}", shape, dt)

        try:
            bufs = self._peer_factory(capacity, dtype, block, alloc)
        except PluginBuildError:
            raise
        except Exception as e:  # ValueError, PeerExchangeError: one message naming the plugin and the cause
            raise PluginBuildError(f"plugin {self.plugin!r}: peer buffers of {capacity} x {dtype} could not be "
                                   f"opened on rank {self.tp_rank}: {type(e).__name__}: {e}") from e
        self.peers.append(bufs)
        return bufs

    def rope_cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The general path's RoPE tables (plugin API 2): see ``lowlat.plugin.rope_tables``.

        Returns:
            (cos, sin), each float32 [engine_config.max_context_len, head_dim // 2] on ``device``; NOT counted as
            a workspace (copy it through ``alloc_workspace`` to have it accounted, as the tables are small).
        """
        mc = self.model_config
        return rope_tables(mc.head_dim, mc.rope_theta, mc.rope_scaling, self.engine_config.max_context_len, self.device)

    def alloc_workspace(self, name: str, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """Allocate an accounted, zero-filled workspace tensor on the model's device.

        Raises:
            PluginBuildError: the allocation would exceed the memory left for plugins (names the plugin,
                the workspace, and the bytes asked and left).
        """
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        if self._budget is not None and self.workspace_bytes + nbytes > self._budget:
            raise PluginBuildError(
                f"plugin {self.plugin!r} asked for workspace {name!r} of {nbytes / 2**20:.1f} MiB, but only "
                f"{(self._budget - self.workspace_bytes) / 2**20:.1f} MiB are left after the weights; "
                f"lower max_batch_size/max_context_len or use a larger device"
            )
        self.workspace_bytes += nbytes
        return torch.zeros(tuple(shape), dtype=dtype, device=self.device)

    @property
    def kv_pool(self) -> Any:
        """The engine's KVPool. Raises KVPoolNotReady during build; use ``on_kv_pool_ready`` there."""
        if self._kv_pool is None:
            raise KVPoolNotReady(
                f"plugin {self.plugin!r} read binding.kv_pool before the KV pool exists (it is sized after build, "
                f"so that workspaces count); register binding.on_kv_pool_ready(callback) instead"
            )
        return self._kv_pool

    def on_kv_pool_ready(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(kv_pool)`` once the pool exists (at once if it already does)."""
        if self._kv_pool is not None:
            callback(self._kv_pool)
        else:
            self._kv_callbacks.append(callback)

    def attach_kv_pool(self, kv_pool: Any) -> None:
        """Runtime side: publish the KV pool and run the callbacks registered during build."""
        self._kv_pool = kv_pool
        callbacks, self._kv_callbacks = self._kv_callbacks, []
        for cb in callbacks:
            cb(kv_pool)

    def release_checkpoint(self) -> None:
        """Runtime side: drop the retained checkpoint tensors after build."""
        self.checkpoint_tensors.clear()
