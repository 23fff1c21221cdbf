"""``build(binding) -> MonoForward``: the entry the lowlat-amd-mono ModelSpecs name (``lowlat_amd_mono.build:build``).

Runs after weights load and before the KV pool exists: it checks what the kernels need, allocates the
workspaces through the binding (so they count against memory), and registers for the KV pool.
"""

from __future__ import annotations

from typing import Any

import torch

from lowlat_amd_mono.forward import MonoForward
from lowlat_amd_mono.kernels.launch import MonoOptions, is_interpreted
from lowlat_amd_mono.tp import open_tp


def build(binding: Any) -> MonoForward:
    """Build the plugin forward from a ``PluginBinding``.

    At tp_size > 1 (plugin API 4; dense and MoE models) the params are this rank's shards, and build opens the TP
    group's peer buffers (``tp.open_tp``, a collective: every rank builds).

    Raises:
        PluginBuildError: as ``tp.open_tp`` (a core without plugin API 4, a bad ``LOWLAT_MONO_FAULT_NO_PUBLISH``,
            peer buffers that could not be opened).
        ValueError: a CPU device without ``TRITON_INTERPRET=1``, parameters missing or of the wrong shape, an
            unsupported RoPE scaling, or ``one_launch`` at tp_size > 1.
    """
    mc = binding.model_config
    tp = open_tp(binding, mc.hidden_size, binding.dtype) if binding.tp_size != 1 else None
    device = torch.device(binding.device)
    from lowlat_amd_mono.kernels.k1_attn_in import k1_attn_in_kernel

    interpret = is_interpreted(k1_attn_in_kernel)
    extra = dict(getattr(binding.engine_config, "extra", None) or {})
    options = MonoOptions.resolve(device, extra, interpret=interpret)
    fwd = MonoForward(
        model_config=binding.model_config,
        params=binding.params,
        dtype=binding.dtype,
        device=device,
        alloc_workspace=binding.alloc_workspace,
        max_context_len=binding.engine_config.max_context_len,
        options=options,
        tp=tp,
    )
    binding.on_kv_pool_ready(fwd.attach_kv_pool)
    return fwd
