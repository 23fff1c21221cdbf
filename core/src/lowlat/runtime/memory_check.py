"""Memory pre-check: refuse a start that cannot fit, before any weight or KV byte is allocated.

From the configs alone, estimate what this rank will allocate (bytes):

* weights: the checkpoint's tensors in the compute dtype, divided by ``tp_size`` (a lower bound: some
  tensors are replicated); computed exactly for up to ``EXACT_LAYERS`` layers, extrapolated per layer above;
* KV pool: on CPU the whole cap (``max_batch_size`` requests of ``max_context_len`` tokens, as
  ``plan_kv_pool`` sizes it); on CUDA the minimum the pool needs (one full-length request) — the rest is
  sized later from what is free;
* tables sized by max_context_len: RoPE cos/sin (float32) and ``req_to_token`` (int64).

and compare with what is free: ``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` from /proc/meminfo
(else ``os.sysconf``) on CPU. Too little raises InsufficientMemory with the numbers and the remedies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lowlat.config import ConfigError, EngineConfig, ModelConfig
from lowlat.runtime.memory import KVMemoryError, pages_per_request

EXACT_LAYERS = 64


class InsufficientMemory(KVMemoryError, ConfigError):
    """The estimated start-up allocation exceeds the free memory of the device (or host RAM on CPU)."""


@dataclass(frozen=True)
class StartEstimate:
    """Bytes this rank is expected to allocate at start, by part."""

    weights_bytes: int
    kv_bytes: int
    table_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.table_bytes


def weight_bytes(model: ModelConfig, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of ``model``'s weights in ``dtype`` on one of ``tp_size`` ranks (lower bound).

    Cost is O(EXACT_LAYERS) whatever ``model.num_hidden_layers`` says, so an absurd layer count is cheap
    to refuse.
    """
    from lowlat.loader.presets import with_layers
    from lowlat.loader.synthetic import synthetic_num_bytes

    layers = model.num_hidden_layers
    if layers <= EXACT_LAYERS:
        total = synthetic_num_bytes(model, dtype)
    else:
        base = synthetic_num_bytes(with_layers(model, EXACT_LAYERS), dtype)
        per_layer = (base - synthetic_num_bytes(with_layers(model, 1), dtype)) // (EXACT_LAYERS - 1)
        total = base + (layers - EXACT_LAYERS) * per_layer
    return total // tp_size


def estimate_start(engine: EngineConfig, model: ModelConfig, dtype: torch.dtype, *, device: torch.device,
                   tp_size: int = 1, num_kv_heads: int | None = None) -> StartEstimate:
    """What this rank will allocate before its first step (see the module docstring)."""
    from lowlat.runtime.kv_cache import KVPool
    from lowlat.runtime.model_runner import kv_heads_per_rank

    heads = num_kv_heads or kv_heads_per_rank(model.num_key_value_heads, tp_size)
    per_token = KVPool.bytes_per_token(model.num_hidden_layers, heads, model.head_dim, dtype)
    per_req = pages_per_request(engine.max_context_len, engine.page_size)
    pages = engine.max_batch_size * per_req + 1 if device.type != "cuda" else per_req + 1
    kv = pages * engine.page_size * per_token
    tables = 2 * engine.max_context_len * model.head_dim * 4 + (engine.max_batch_size + 1) * engine.max_context_len * 8
    return StartEstimate(weight_bytes(model, dtype, tp_size), kv, tables)


def free_bytes(device: torch.device) -> tuple[int, str]:
    """(free bytes, where the number comes from) for ``device``; CPU reads host RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable of host RAM (/proc/meminfo)"
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available host RAM (sysconf)"
    except (ValueError, OSError, AttributeError):
        return 1 << 62, "unknown (no limit checked)"


def check_start_memory(engine: EngineConfig, model: ModelConfig, dtype: torch.dtype, *, device: torch.device,
                       tp_size: int = 1, available: int | None = None) -> StartEstimate:
    """Raise InsufficientMemory when the start-up estimate exceeds the free memory; return the estimate.

    Args:
        available: free bytes to compare with (None reads them, see ``free_bytes``).
    Raises:
        InsufficientMemory: naming the estimate per part (GiB), the free bytes and the remedies.
    """
    est = estimate_start(engine, model, dtype, device=device, tp_size=tp_size)
    where = "given"
    if available is None:
        available, where = free_bytes(device)
    if est.total_bytes > available:
        gib = 2**30
        raise InsufficientMemory(
            f"{engine.model} needs about {est.total_bytes / gib:.2f} GiB on {device} per rank before its first step "
            f"(weights {est.weights_bytes / gib:.2f} GiB for {model.num_hidden_layers} layers in "
            f"{str(dtype).removeprefix('torch.')}, KV pool {est.kv_bytes / gib:.2f} GiB for max_batch_size="
            f"{engine.max_batch_size} x max_context_len={engine.max_context_len}, tables {est.table_bytes / gib:.2f} "
            f"GiB), but only {available / gib:.2f} GiB are free ({where}); nothing was allocated. Lower "
            "max_context_len or max_batch_size, use more tensor-parallel ranks, a smaller dtype, or check the "
            "checkpoint's num_hidden_layers"
        )
    return est
