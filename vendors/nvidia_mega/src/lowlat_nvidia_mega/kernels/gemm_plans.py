"""Launch plans of the small-row GEMM kernels and their host-side planners (no kernels here).

- ``GemmPlan``: tiles of one ``small_gemm`` shape (``block_n`` output columns per program, ``block_k`` K elements
  per step, ``split_k`` K slices of ``k_per_split`` elements, ``pre_k`` K elements loaded before ``gdc_wait``), with
  the one-row GEMV's ``GemvPlan`` as ``row1``.
- ``plan_gemm`` / ``make_plan`` / ``grow_split`` / ``programs_target`` / ``pre_wait_k`` / ``default_block_k``:
  the heuristics behind a plan (``tuned_plans`` holds the measured ones); ``num_sms`` the SM count they aim at.
- ``splitk_workspace_numel``: fp32 elements of split-K partials a launch needs; ``MAX_ROWS``: the most rows a
  launch serves.

This module sits below the kernels: it imports neither ``small_gemm`` nor ``gemv`` (only torch and triton), so
tables and tools can plan without loading a kernel module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

MAX_ROWS = 8


@dataclass(frozen=True)
class GemvPlan:
    """Launch configuration of a one-row kernel for one shape: the GEMV (``gemv.py``: rows per program, K chunk,
    never split) or qkv_rope's one-row loop (``block_n`` the head dim: a program owns one head, ``split_k`` splits
    K; below it: the row-pair form, ``qk_late.check_row1_rows``). ``per_sm`` (the GEMV only): 0 runs one program
    per tile, ``n`` > 0 the persistent weight stream of ``n`` programs per SM (``gemv._gemv_stream_kernel``).

    Raises:
        ValueError: a field that is not an int; ``block_n`` / ``block_k`` not a power of two; ``num_warps`` not a
            power of two in 1..32 (a CTA holds at most 1024 threads); ``num_stages`` or ``split_k`` below 1;
            ``per_sm`` below 0, or above 0 with ``split_k`` above 1 (the stream never splits K).
    """

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    per_sm: int = 0

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps", "num_stages", "split_k", "per_sm"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"GemvPlan.{name} must be an int, got {v!r}")
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1) or (name == "num_warps" and v > 32):
                raise ValueError(f"GemvPlan.{name} must be a power of two >= 1{' and <= 32' * (name == 'num_warps')}"
                                 f", got {v}")
        if self.num_stages < 1 or self.split_k < 1:
            raise ValueError(f"GemvPlan needs num_stages >= 1 and split_k >= 1, got {self.num_stages}, "
                             f"{self.split_k}")
        if self.per_sm < 0 or (self.per_sm and self.split_k > 1):
            raise ValueError(f"GemvPlan.per_sm must be 0 (a program per tile) or, with split_k 1, the programs per SM "
                             f"of the GEMV's weight stream; got per_sm {self.per_sm} with split_k {self.split_k}")


@dataclass(frozen=True)
class GemmPlan:
    """Launch configuration of one small GEMM shape (chosen by ``plan_gemm``, never autotuned at capture).

    ``row1``: the one-row GEMV's plan, used instead of this kernel when a step has one row (``gemv.gemm``);
    None: one row runs this kernel too."""

    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    num_warps: int
    num_stages: int
    pre_k: int  # K elements of the weight tile(s) loaded before gdc_wait (a multiple of block_k)
    row1: GemvPlan | None = None

    def n_tiles(self, n: int) -> int:
        return triton.cdiv(n, self.block_n)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 on CPU, so interpreter tests exercise split-K)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def plan_gemm(n: int, k: int, dtype: torch.dtype, sms: int, *, gated: bool = False,
              block_n: int | None = None, split_k: int | None = None, block_k: int | None = None) -> GemmPlan:
    """Pick tiles for ``[<=8, k] @ [n, k]^T`` so that about 1.75 x ``sms`` programs stream the weight.

    ``n`` is the output width (for ``gated`` the weight has 2n rows). BLOCK_N is 64 when that alone fills the
    GPU, else 32; split-K doubles while the grid is short and each split keeps >= 2 K-blocks. ``block_n``,
    ``split_k`` and ``block_k`` override the heuristic (tests, tuning). BLOCK_K = 128 elements for 2-byte dtypes
    (a warp's row of 16-byte loads).
    """
    bk = block_k or default_block_k(k, dtype)
    bn = block_n or (64 if triton.cdiv(n, 64) >= programs_target(sms) else 32)
    s = split_k if split_k is not None else grow_split(triton.cdiv(n, bn), k, bk, sms)
    iters = triton.cdiv(triton.cdiv(k, s), bk)
    return make_plan(k, block_n=bn, block_k=bk, split_k=s, num_warps=4,
                     num_stages=2 if iters <= 2 else (3 if gated else 4), weight_rows=(2 if gated else 1) * bn)


def programs_target(sms: int) -> int:
    """Programs a launch aims for: 1.75 x the SMs (a few per SM keep enough loads in flight)."""
    return max(1, (7 * sms) // 4)


def grow_split(tiles: int, k: int, block_k: int, sms: int) -> int:
    """Split-K for ``tiles`` output tiles: doubled while the grid is short of ``programs_target`` and each split
    keeps >= 2 K-blocks."""
    s = 1
    while tiles * s < programs_target(sms) and k // (2 * s) >= 2 * block_k:
        s *= 2
    return s


def make_plan(k: int, *, block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int,
              weight_rows: int) -> GemmPlan:
    """The plan for these tiles over a reduction of ``k``: K per split rounded up to whole blocks, no empty split;
    ``weight_rows`` = weight rows one program holds (sizes the tile loaded before the PDL wait)."""
    kps = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return GemmPlan(block_n=block_n, block_k=block_k, split_k=triton.cdiv(k, kps), k_per_split=kps,
                    num_warps=num_warps, num_stages=num_stages, pre_k=pre_wait_k(k, kps, block_k, weight_rows))


PRE_WAIT_ELEMENTS = 16384  # weight elements a program holds in registers while it waits (32 KB of bf16)


def pre_wait_k(k: int, k_per_split: int, block_k: int, rows: int) -> int:
    """K extent of the tile loaded before ``gdc_wait``: block_k times a power of two, at most 4 blocks, within
    ``PRE_WAIT_ELEMENTS`` for ``rows`` weight rows and within the shortest split (the last one)."""
    last = k - (triton.cdiv(k, k_per_split) - 1) * k_per_split
    pre = block_k
    while pre * 2 <= min(4 * block_k, last) and rows * pre * 2 <= PRE_WAIT_ELEMENTS:
        pre *= 2
    return pre


def default_block_k(k: int, dtype: torch.dtype) -> int:
    """128 elements for 2-byte dtypes, 64 for fp32, at most next_power_of_2(k)."""
    elt = torch.empty(0, dtype=dtype).element_size()
    return min(128 if elt <= 2 else 64, triton.next_power_of_2(k))


def splitk_workspace_numel(plan: GemmPlan, n: int, *, gated: bool, rows: int = MAX_ROWS) -> int:
    """fp32 elements of split-K partials a launch of ``plan`` needs (0 without split-K)."""
    return 0 if plan.split_k == 1 else plan.split_k * (2 if gated else 1) * rows * n
