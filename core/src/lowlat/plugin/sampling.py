"""Sampled ids in plain torch (plugin API 3): the reference a sampling plugin's kernel is checked against.

``sample_ids(logits, info)`` picks one token per row as ``lowlat.runtime.sampling.sample`` does (HF order:
temperature, then top-k keeping every token tied with the k-th, then top-p keeping each token whose strictly more
likely tokens' mass is below top_p; temperature 0 is argmax with the lowest index among equal maxima), but draws its
Gumbel noise from a counter-based hash of ``(seeds[r], offsets[r] + i)`` instead of a torch.Generator, so it reads
only device tensors and makes no host sync (CUDA-graph capturable). A row whose logits are not all finite gets id -1.
``ReferenceStep``'s ``sample`` stage is this function; a plugin with a fused LM head + sampling kernel replaces it.
"""

from __future__ import annotations

import torch

from lowlat.forward_batch import SamplingInfo

_M32 = 0xFFFF_FFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons' integer hash) of int64 values in [0, 2**32); products wrap in int64 and are masked."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniform floats in (0, 1), one per counter: a hash of (seed, counter), float32.

    Args:
        seeds: [R] int64 (>= 0). counters: [R, N] int64 (>= 0).
    Returns:
        [R, N] float32 in (0, 1); equal inputs give equal outputs on every device.
    """
    s = seeds.to(torch.int64)[:, None]
    h = _mix32((s >> 32) & _M32)
    h = _mix32(h ^ (s & _M32))
    h = _mix32(h ^ ((counters >> 32) & _M32))
    h = _mix32(h ^ (counters & _M32))
    return ((h.to(torch.float64) + 0.5) / 2.0**32).to(torch.float32)


def sample_ids(logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
    """One token per row of ``logits`` as ``info`` says (module docstring).

    Args:
        logits: [R, V] float (upcast to float32). info: the step's SamplingInfo (R rows).
    Returns:
        [R] int64 ids on ``logits.device``; -1 for a row holding NaN or inf.
    Raises:
        ValueError: logits is not 2-D or its rows differ from ``info``'s.
    """
    if logits.dim() != 2 or logits.shape[0] != info.temperature.shape[0]:
        raise ValueError(f"logits must be [R, V] with R = {info.temperature.shape[0]} rows of the SamplingInfo, "
                         f"got {tuple(logits.shape)}")
    logits = logits.float()
    finite = torch.isfinite(logits).all(dim=-1)
    ids = torch.argmax(logits, dim=-1)
    if not info.all_greedy:
        vocab = logits.shape[1]
        temp = info.temperature.float()
        hot = temp > 0
        z = logits / torch.where(hot, temp, torch.ones_like(temp))[:, None]
        k = info.top_k.to(torch.int64)
        if info.max_top_k > 0:
            desc = torch.sort(z, dim=-1, descending=True).values
            kth = desc.gather(1, (k.clamp(1, vocab) - 1)[:, None])
            z = z.masked_fill((k[:, None] > 0) & (z < kth), float("-inf"))
        if info.any_top_p:
            p = info.top_p.float()
            srt, order = torch.sort(z, dim=-1, descending=True)
            probs = torch.softmax(srt, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs
            drop = torch.zeros_like(before, dtype=torch.bool).scatter(1, order, (before >= p[:, None]) &
                                                                      (p[:, None] < 1.0))
            z = z.masked_fill(drop, float("-inf"))
        counters = info.offsets.to(torch.int64)[:, None] + torch.arange(vocab, device=logits.device)[None, :]
        u = counter_uniform(info.seeds, counters)
        drawn = torch.argmax(torch.log_softmax(z, dim=-1) - torch.log(-torch.log(u)), dim=-1)
        ids = torch.where(hot, drawn, ids)
    return torch.where(finite, ids, torch.full_like(ids, -1))
