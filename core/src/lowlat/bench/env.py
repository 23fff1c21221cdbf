"""Where and with what a benchmark ran: commit, GPU, driver, library versions, command line and date."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch


def _run(cmd: list[str], cwd: Path | None = None) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return -1, ""
    return p.returncode, p.stdout.strip()


def git_commit() -> dict[str, Any]:
    """``git rev-parse HEAD`` of the lowlat sources' repository (an editable install), else of the working directory
    (an installed wheel run from a checkout), and whether tracked files differ. The sources come first: a benchmark
    started from another repository's directory would otherwise be labelled with that repository's commit.

    Read-only: ``git diff-index`` compares without touching the index. Values are None outside a repository.
    """
    for cwd in (Path(__file__).resolve().parent, Path.cwd()):
        rc, sha = _run(["git", "rev-parse", "HEAD"], cwd)
        if rc == 0 and sha:
            rc_dirty, _ = _run(["git", "diff-index", "--quiet", "HEAD", "--"], cwd)
            return {"commit": sha, "dirty": rc_dirty == 1 if rc_dirty in (0, 1) else None}
    return {"commit": None, "dirty": None}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def gpu_info(device: torch.device) -> dict[str, Any]:
    """GPU name, capability, memory, driver (nvidia-smi, else None) and CUDA/HIP runtime of torch."""
    if device.type != "cuda":
        return {"gpu": None, "driver": None, "cuda_runtime": torch.version.cuda}
    props = torch.cuda.get_device_properties(device)
    rc, driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                       f"--id={device.index or 0}"])
    return {
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "driver": driver.splitlines()[0] if rc == 0 and driver else None,
        "cuda_runtime": torch.version.cuda,
        "hip_runtime": getattr(torch.version, "hip", None),
    }


def environment(device: torch.device, command: list[str] | None) -> dict[str, Any]:
    """Everything a results JSON records about the run (``command``: argv, default ``sys.argv``), with the
    ``LOWLAT_*`` and ``TRITON_*`` environment variables set (the plugins' switches: an A/B run with a switch in the
    environment has the same command line as its baseline)."""
    cmd = list(sys.argv if command is None else command)
    return {
        **git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(cmd),
        "device": str(device),
        "figures": "cpu" if device.type == "cpu" else "gpu",
        **gpu_info(device),
        "torch": torch.__version__,
        "triton": _version("triton") or _version("pytorch-triton-rocm"),
        "transformers": _version("transformers"),
        "lowlat": _version("lowlat"),
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("LOWLAT_", "TRITON_"))},
    }
