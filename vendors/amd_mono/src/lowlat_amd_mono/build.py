"""``build(binding) -> MonoForward``: the entry the lowlat-amd-mono ModelSpecs name (``lowlat_amd_mono.build:build``).

Runs after weights load and before the KV pool exists: it checks what the kernels need, allocates the
workspaces through the binding (so they count against memory), and registers for the KV pool.
"""

from __future__ import annotations

from typing import Any

import torch

from lowlat_amd_mono.forward import MonoForward
from lowlat_amd_mono.kernels.launch import MonoOptions, is_interpreted


def build(binding: Any) -> MonoForward:
    """Build the plugin forward from a ``PluginBinding``.

    Raises:
        ValueError: tp_size other than 1, a CPU device without ``TRITON_INTERPRET=1``, parameters missing or of
            the wrong shape, or an unsupported RoPE scaling.
    """
    if binding.tp_size != 1:
        raise ValueError(f"amd_mono runs tp_size 1, got tp_size={binding.tp_size}; use plugin 'none' for TP")
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
    )
    binding.on_kv_pool_ready(fwd.attach_kv_pool)
    return fwd
