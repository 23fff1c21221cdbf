"""Programmatic dependent launch (PDL) helpers shared by every nvidia_mega kernel.

PDL (CUDA 12.3+, sm90+) lets kernel N+1 start while kernel N still runs. Two PTX instructions drive it
(``griddepcontrol``, exposed by Triton >= 3.5 as ``triton.language.extra.cuda.gdc_wait`` and
``gdc_launch_dependents``; see Triton's tutorial ``11-programmatic-dependent-launch.py``):

- ``gdc_launch_dependents``: a scheduling hint; once every program of this kernel has issued it (or exited),
  the next kernel, launched with ``launch_pdl=True``, may start.
- ``gdc_wait``: blocks until the previous kernel has *completed* and its writes are visible.

Rules every kernel here follows, so chains of PDL kernels stay correct:

1. Before ``gdc_wait`` a program may only read memory no earlier kernel of the step writes (weights, the
   batch's metadata, KV slots of past positions) and must not write global memory at all (a write could race
   with a reader in the previous kernel).
2. Every program calls ``gdc_wait`` before it exits, even one with no work. A kernel that finished without
   waiting could complete before its predecessor, and the kernel after it would then wait on the wrong grid.
3. ``gdc_launch_dependents`` is issued early (after the pre-wait loads), because it is only a hint.

The device helpers take a constexpr ``USE_PDL``; the launchers pass ``pdl_enabled()``, which is False under
``TRITON_INTERPRET=1`` (the interpreter raises on gdc calls), on GPUs before sm90, and when the environment
sets ``LOWLAT_MEGA_PDL=0`` (the switch the ablation benchmarks use).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV_SWITCH = "LOWLAT_MEGA_PDL"


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pdl_supported(device: torch.device | None = None) -> bool:
    """Whether the hardware and runtime can launch with PDL: a CUDA device of capability >= 9.0, not interpreting."""
    if interpreting() or not torch.cuda.is_available():
        return False
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        return False
    return _capability_major(torch.cuda.current_device() if dev.index is None else dev.index) >= 9


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_enabled(device: torch.device | None = None) -> bool:
    """PDL on for launches on ``device``: supported there and not switched off by ``LOWLAT_MEGA_PDL=0``.

    Read at each call (cheap), so a benchmark can flip the variable between builds of a CUDA graph.

    Raises:
        ValueError: a value of ``LOWLAT_MEGA_PDL`` other than an on or off word (``env_switch``); the guard and the
            build refuse it first (``build.check_switches``).
    """
    if not env_switch(ENV_SWITCH, True, "PDL where the GPU supports it"):
        return False
    return pdl_supported(device)


def env_switch(name: str, default: bool | None, meaning: str) -> bool | None:
    """An on/off environment variable read now: 1/true/on/yes or 0/false/off/no; unset, empty or "default" gives
    ``default`` (None: a third state the caller resolves, as ``norm_rows.prenorm_switch``).

    Raises:
        ValueError: any other value, naming the variable and what 1 means (a typo would measure the wrong variant).
    """
    v = os.environ.get(name, "").strip().lower()
    if v in ("", "default"):
        return default
    if v in ("1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name}={v!r}: use 1 ({meaning}) or 0")


def launch_kwargs(use_pdl: bool) -> dict[str, bool]:
    """Extra keyword arguments for ``kernel[grid](...)``: ``{"launch_pdl": True}`` when PDL is on, else none."""
    return {"launch_pdl": True} if use_pdl else {}


@triton.jit
def gdc_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's completion and memory flush (no-op when ``USE_PDL`` is False)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def gdc_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next PDL kernel start launching (a hint; no-op when ``USE_PDL`` is False)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
