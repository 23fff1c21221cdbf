"""What the memory contract measures on any device: the process's live tensors, found through the garbage
collector (``gc.get_objects``), not only those reachable from the plugin's forward object.

A tensor kept in a module-level cache, a class attribute, a closure or a ``functools`` cache is alive but not
reachable from the forward object's attributes; on CUDA ``torch.cuda.memory_allocated`` sees it, on a CPU
nothing else does. ``live_tensors(device)`` counts every live ``torch.Tensor`` object on that device type and
maps each distinct storage (data pointer) to its size in bytes, after a full collection. It costs one pass
over the interpreter's objects (tens of milliseconds), so the contracts call it at a few points only.
"""

from __future__ import annotations

import gc
from typing import Any

import torch


def live_tensors(device: Any, collect: bool = True) -> tuple[int, dict[int, int]]:
    """(live tensor objects, {storage data_ptr: nbytes}) on ``device``'s type, after ``gc.collect()`` (skipped
    with ``collect=False``: faster, but unreachable tensors in reference cycles still count).

    Args:
        device: a torch.device or a device string; only its type counts ("cpu", "cuda").
    """
    kind = torch.device(device).type
    if collect:
        gc.collect()
    count, storages = 0, {}
    tensor = torch.Tensor
    for obj in gc.get_objects():
        if not issubclass(type(obj), tensor):  # type(), not isinstance: no __class__ lookups on proxies
            continue
        try:
            if obj.device.type != kind or obj.is_meta:
                continue
            s = obj.untyped_storage()
        except Exception:  # a tensor subclass or a half-built object that cannot say
            continue
        count += 1
        if s.data_ptr():
            storages[s.data_ptr()] = s.nbytes()
    return count, storages


def new_bytes(before: dict[int, int], after: dict[int, int]) -> int:
    """Bytes of the storages in ``after`` that were not in ``before`` (memory allocated and kept in between)."""
    return sum(n for p, n in after.items() if p not in before)
