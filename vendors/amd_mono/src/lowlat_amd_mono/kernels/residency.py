"""The residency rule: a persistent grid whose workgroups spin on each other must fit on the device at once.

If a workgroup that must publish a tag is not yet resident while every resident workgroup spins waiting for
it, the launch never finishes. So before the first persistent launch of a kernel variant we ask how many of
its workgroups can be resident per SM/CU and refuse grids above ``per_sm * sm_count``.

The count comes from the driver's occupancy calculator for the compiled function
(``cuOccupancyMaxActiveBlocksPerMultiprocessor`` / ``hipModuleOccupancyMaxActiveBlocksPerMultiprocessor``),
which sees registers, shared memory / LDS and block size. When the driver call is not reachable we compute it
from Triton's compiled metadata (``n_regs``, ``metadata.shared``, ``num_warps``) and the device properties,
with the allocation rules of the CUDA occupancy calculator (registers per warp rounded to 256, 64K registers,
2048 threads and 32 blocks per SM) or CDNA's (512 VGPRs per SIMD lane, 8 waves per SIMD, 4 SIMDs per CU).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Any

import torch


class ResidencyError(RuntimeError):
    """A persistent grid would not fit on the device at once; launching it could hang, so it is refused."""


@dataclass(frozen=True)
class Occupancy:
    """How many workgroups of one compiled kernel fit at once.

    Attributes:
        per_sm: resident workgroups per SM (CUDA) or CU (ROCm).
        sm_count: SMs / CUs on the device.
        source: "driver" (occupancy API) or "metadata" (computed from registers / shared memory).
        detail: registers, shared bytes and warps the figure was computed from.
    """

    per_sm: int
    sm_count: int
    source: str
    detail: str

    @property
    def max_programs(self) -> int:
        return self.per_sm * self.sm_count


def _driver_occupancy(function: int, block: int, shared: int) -> int | None:
    """Ask the CUDA or HIP driver; None when the library or symbol is not reachable or the call fails."""
    if torch.version.hip is not None:
        lib_name, short, sym = "libamdhip64.so", "amdhip64", "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor"
    else:
        lib_name, short, sym = "libcuda.so.1", "cuda", "cuOccupancyMaxActiveBlocksPerMultiprocessor"
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library(short) or lib_name), sym)
    except (OSError, AttributeError):
        return None
    n = ctypes.c_int(0)
    err = fn(ctypes.byref(n), ctypes.c_void_p(function), ctypes.c_int(block), ctypes.c_size_t(shared))
    return int(n.value) if err == 0 else None


def _metadata_occupancy(props: Any, n_regs: int, shared: int, num_warps: int, is_hip: bool) -> int:
    """Resident workgroups per SM/CU from the kernel's resources (the occupancy calculator's rules)."""
    if is_hip:
        lds = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 65536)
        vgpr_alloc = max(8, -(-max(n_regs, 1) // 8) * 8)
        waves_per_simd = min(8, 512 // vgpr_alloc)
        by_waves = (4 * waves_per_simd) // num_warps
        by_lds = lds // shared if shared else by_waves
        return max(0, min(by_waves, by_lds))
    warp = 32
    max_threads = int(getattr(props, "max_threads_per_multi_processor", 2048))
    regs = int(getattr(props, "regs_per_multiprocessor", 65536))
    smem = int(getattr(props, "shared_memory_per_multiprocessor", 228 * 1024))
    regs_per_warp = -(-max(n_regs, 1) * warp // 256) * 256
    by_threads = max_threads // (num_warps * warp)
    by_regs = (regs // regs_per_warp) // num_warps
    by_smem = smem // (shared + 1024) if shared else 32  # 1 KB per block is reserved by the driver
    return max(0, min(by_threads, by_regs, by_smem, 32))


def kernel_occupancy(compiled: Any, device: torch.device) -> Occupancy:
    """Occupancy of a compiled Triton kernel (``JITFunction.warmup`` result) on ``device``.

    Raises:
        ResidencyError: when not even one workgroup fits on an SM/CU.
    """
    if getattr(compiled, "function", None) is None and hasattr(compiled, "_init_handles"):
        compiled._init_handles()
    md = compiled.metadata
    num_warps = int(md.num_warps)
    shared = int(getattr(md, "shared", 0))
    n_regs = int(getattr(compiled, "n_regs", 0) or 0)
    props = torch.cuda.get_device_properties(device)
    is_hip = torch.version.hip is not None
    warp = 64 if is_hip else 32
    detail = f"{n_regs} registers/thread, {shared} B shared memory, {num_warps} warps of {warp}"
    per_sm = _driver_occupancy(int(compiled.function), num_warps * warp, shared)
    source = "driver"
    if per_sm is None:
        per_sm, source = _metadata_occupancy(props, n_regs, shared, num_warps, is_hip), "metadata"
    if per_sm < 1:
        raise ResidencyError(
            f"{md.name}: no workgroup fits on one SM/CU ({detail}); lower num_warps or the tile sizes "
            "(BN/BK) or num_stages in the amd_mono options"
        )
    return Occupancy(per_sm=per_sm, sm_count=props.multi_processor_count, source=source, detail=detail)


def check_grid(name: str, grid: int, occ: Occupancy) -> None:
    """Refuse a persistent grid larger than what can be resident at once.

    Raises:
        ResidencyError: naming the kernel, the grid, the limit and how it was computed, and the fix.
    """
    if grid > occ.max_programs:
        raise ResidencyError(
            f"{name}: persistent grid of {grid} workgroups exceeds the {occ.max_programs} that can be resident "
            f"at once ({occ.per_sm} per SM/CU x {occ.sm_count}, from {occ.source}: {occ.detail}); a spinning "
            "grid that does not fit can hang. Lower amd_mono programs_per_sm, or set LOWLAT_MONO_STAGED=1 to run "
            "the stages as separate launches"
        )
