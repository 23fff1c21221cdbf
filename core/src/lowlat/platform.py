"""What this machine is: cuda / rocm / cpu, device name, capability or gfx arch, device count.

The guard evaluates plugin requirements against a ``Platform``; tests build one by hand to
simulate machines they do not have.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

import torch
from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class Platform:
    """A description of the machine a model runs on.

    Attributes:
        kind: "cuda", "rocm" or "cpu".
        device_name: e.g. "NVIDIA H200"; "cpu" on a CPU.
        capability: CUDA compute capability (major, minor), None elsewhere.
        gfx_arch: ROCm architecture such as "gfx942", None elsewhere.
        device_count: visible GPUs (0 on a CPU).
        triton_interpreter: TRITON_INTERPRET=1 is set, so Triton kernels run on CPU tensors.
        triton_version: installed Triton version, None when Triton is absent.
        numpy_version: installed NumPy version, None when not detected (Triton's interpreter computes with NumPy).
    """

    kind: str
    device_name: str
    capability: tuple[int, int] | None = None
    gfx_arch: str | None = None
    device_count: int = 0
    triton_interpreter: bool = False
    triton_version: str | None = None
    numpy_version: str | None = None

    def describe(self) -> str:
        """One line such as "cuda (NVIDIA H200, capability 9.0, 1 device)" or "cpu (Triton interpreter on)"."""
        if self.kind == "cuda":
            cap = f"capability {self.capability[0]}.{self.capability[1]}" if self.capability else "capability ?"
            return f"cuda ({self.device_name}, {cap}, {self.device_count} device(s))"
        if self.kind == "rocm":
            return f"rocm ({self.device_name}, {self.gfx_arch}, {self.device_count} device(s))"
        return "cpu (Triton interpreter on)" if self.triton_interpreter else "cpu"


def triton_interpreter_enabled() -> bool:
    """Whether TRITON_INTERPRET is set to a true value."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def interpreter_problem(triton_version: str | None, numpy_version: str | None) -> str | None:
    """Why Triton's interpreter cannot run kernels with these versions, or None when it can.

    Triton 3.6's interpreter converts a scalar value to an index with ``int()`` of a one-element NumPy array, which
    NumPy 2.4 made an error (``TypeError: only 0-dimensional arrays can be converted to Python scalars``), so every
    kernel with a loop over a runtime bound (``range(start, end, STEP)``) fails. Triton 3.7 squeezes the array first
    (triton-lang/triton issue 9171, pull request 9172; checked in the 3.6.0, 3.7.0 and 3.8.0 wheels).
    """
    if not triton_version or not numpy_version:
        return None
    try:
        old_triton = Version(triton_version).release[:2] < (3, 7)
        new_numpy = Version(numpy_version).release[:2] >= (2, 4)
    except InvalidVersion:
        return None
    if not (old_triton and new_numpy):
        return None
    return (f"Triton {triton_version}'s interpreter cannot run with NumPy {numpy_version}: NumPy 2.4 refuses int() of "
            f"a one-element array, which Triton before 3.7 uses for loop bounds (triton-lang/triton#9171); install "
            f"'numpy<2.4' or 'triton>=3.7'")


def installed_interpreter_problem() -> str | None:
    """``interpreter_problem`` for the installed Triton and NumPy (for test harnesses that launch kernels directly)."""
    return interpreter_problem(_triton_version(), _dist_version("numpy"))


def no_cuda_message(flag: str = "device='cuda'", fix: str = "device='cpu'") -> str:
    """Why torch sees no CUDA device, for an error where ``flag`` asked for one; ``fix`` is the way out.

    E.g. ``no_cuda_message("--device cuda", "--device cpu")``. Names a CPU build of torch (``torch.version.cuda``
    and ``torch.version.hip`` None, or a ``+cpu`` version) outright: no driver or setting can help that one.
    """
    v = torch.__version__
    if torch.version.cuda is None and torch.version.hip is None or "+cpu" in v:
        return (f"{flag} but torch sees no CUDA device: the installed torch {v} is a CPU build (torch.version.cuda "
                f"is None); use {fix}, or install a CUDA build of torch")
    return (f"{flag} but torch sees no CUDA device: torch {v} is built for CUDA "
            f"{torch.version.cuda or torch.version.hip} but finds no usable GPU (driver? CUDA_VISIBLE_DEVICES?); "
            f"use {fix}")


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _triton_version() -> str | None:
    """The installed Triton's version: ``triton``, or ROCm's ``pytorch-triton-rocm``; None when neither is."""
    return _dist_version("triton") or _dist_version("pytorch-triton-rocm")


def detect_platform(device: str = "auto") -> Platform:
    """Detect the platform a model on ``device`` ("auto", "cuda" or "cpu") would run on.

    "auto" and "cuda" report the GPU when torch sees one; "cpu" reports the CPU even on a GPU machine.
    """
    interp = triton_interpreter_enabled()
    versions = (_triton_version(), _dist_version("numpy"))
    if device != "cpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        count = torch.cuda.device_count()
        if getattr(torch.version, "hip", None):
            arch = str(getattr(props, "gcnArchName", "")).split(":")[0] or None
            return Platform("rocm", props.name, None, arch, count, interp, *versions)
        return Platform("cuda", props.name, (props.major, props.minor), None, count, interp, *versions)
    return Platform("cpu", "cpu", None, None, 0, interp, *versions)
