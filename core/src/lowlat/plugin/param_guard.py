"""Parameters are read-only to plugins: fingerprint them before check_model/build, verify after.

A fingerprint is two int64 sums over each parameter's bit pattern (the plain sum and a position-weighted
one), computed on the parameter's device in chunks of ``CHUNK`` elements (so the scratch memory stays
below ~100 MiB whatever the parameter size) and read back once. Any change of a value, including a
permutation of elements within a chunk or across chunks, changes the fingerprint short of a contrived collision.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 22
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint_one(p: torch.Tensor, weights: dict[torch.device, torch.Tensor]) -> torch.Tensor:
    flat = p.detach().reshape(-1)
    if flat.dtype.is_complex or flat.element_size() not in _INT_OF_SIZE:
        flat = flat.float()
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])
    w = weights.get(p.device)
    if w is None:
        w = weights[p.device] = torch.arange(CHUNK, device=p.device, dtype=torch.int64) % 65521 + 1
    s1 = torch.zeros((), dtype=torch.int64, device=p.device)
    s2 = torch.zeros((), dtype=torch.int64, device=p.device)
    for k, start in enumerate(range(0, bits.numel(), CHUNK)):
        c = bits[start:start + CHUNK].to(torch.int64)
        s1 += c.sum()
        s2 += (c * w[: c.numel()]).sum() * (k + 1)
    return torch.stack([s1, s2])


def fingerprint(params: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Fingerprints of ``params`` by name (tied parameters once, under their first name); one host read."""
    seen: dict[tuple[int, int], str] = {}
    names, sums = [], []
    weights: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in params.items():
            key = (p.data_ptr(), p.numel())
            if key in seen:
                continue
            seen[key] = name
            names.append(name)
            sums.append(_fingerprint_one(p, weights))
    if not sums:
        return {}
    dev = sums[0].device
    rows = torch.stack([s.to(dev) for s in sums]).tolist()
    return {n: (int(a), int(b)) for n, (a, b) in zip(names, rows)}


def changed(before: dict[str, tuple[int, int]], params: dict[str, torch.Tensor]) -> list[str]:
    """Names of parameters whose fingerprint differs from ``before`` (or that disappeared)."""
    after = fingerprint({n: params[n] for n in before if n in params})
    return [n for n in before if after.get(n) != before[n]]
