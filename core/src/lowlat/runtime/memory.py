"""How many KV pages the pool gets.

The rule (after SGLang's ``profile_max_num_token`` in model_runner.py, simplified):

* Every request may hold ``max_context_len`` tokens, so ``max_batch_size`` requests need
  ``max_batch_size * ceil(max_context_len / page_size)`` pages, plus page 0, which the pool reserves
  for the dummy slot padded graph rows write to. That is the **cap**: a bigger pool could never be used.
* On CPU the pool is exactly the cap.
* On CUDA the pool takes ``kv_cache_fraction`` of the memory still free once the weights (and any plugin
  workspaces) are allocated, less ``reserved_bytes`` (memory promised to later users such as lazily
  allocated workspaces), and never more than the cap. What is left over is headroom for activations and
  CUDA graphs. Too little memory for even one full-length request is an error naming the remedies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVMemoryError(RuntimeError):
    """The device cannot hold a KV pool for even one request of max_context_len tokens."""


@dataclass(frozen=True)
class KVPoolPlan:
    """The sizing decision, kept for reports.

    Attributes:
        num_pages: pages in the pool, including the reserved page 0.
        page_size: slots (tokens) per page.
        bytes_per_page: K plus V bytes of one page over all layers.
        cap_pages: pages that ``max_batch_size`` full-length requests need (+1 reserved).
        budget_bytes: bytes the pool was allowed (None on CPU, where it is sized by the cap alone).
    """

    num_pages: int
    page_size: int
    bytes_per_page: int
    cap_pages: int
    budget_bytes: int | None

    @property
    def num_tokens(self) -> int:
        """Token slots usable by requests (page 0 excluded)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page


def pages_per_request(max_context_len: int, page_size: int) -> int:
    """Pages one request of ``max_context_len`` tokens can hold."""
    return -(-max_context_len // page_size)


def plan_kv_pool(
    *,
    bytes_per_token: int,
    page_size: int,
    max_batch_size: int,
    max_context_len: int,
    device: torch.device,
    kv_cache_fraction: float,
    reserved_bytes: int = 0,
    free_bytes: int | None = None,
) -> KVPoolPlan:
    """Decide the number of pages (see the module docstring for the rule).

    Args:
        bytes_per_token: K plus V bytes of one token over all layers on this rank (``KVPool.bytes_per_token``).
        page_size, max_batch_size, max_context_len: from EngineConfig.
        device: the pool's device; CUDA devices are sized from free memory.
        kv_cache_fraction: share of the free memory (after ``reserved_bytes``) the pool may take.
        reserved_bytes: bytes to hold back on top of what is already allocated.
        free_bytes: free device bytes; None reads ``torch.cuda.mem_get_info(device)``.

    Raises:
        KVMemoryError: on CUDA, the budget holds fewer pages than one full-length request needs.
    """
    per_req = pages_per_request(max_context_len, page_size)
    cap = max_batch_size * per_req + 1
    bytes_per_page = bytes_per_token * page_size
    if device.type != "cuda":
        return KVPoolPlan(cap, page_size, bytes_per_page, cap, None)
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
    budget = int(max(0, free_bytes - reserved_bytes) * kv_cache_fraction)
    pages = min(cap, budget // bytes_per_page)
    if pages < per_req + 1:
        raise KVMemoryError(
            f"the KV pool fits {max(pages - 1, 0)} pages of {page_size} tokens ({budget / 2**30:.2f} GiB budget: "
            f"{free_bytes / 2**30:.2f} GiB free, {reserved_bytes / 2**30:.2f} GiB reserved, fraction "
            f"{kv_cache_fraction}), but one request of max_context_len={max_context_len} needs {per_req}; "
            "lower max_context_len, raise kv_cache_fraction, or use more tensor-parallel ranks"
        )
    return KVPoolPlan(pages, page_size, bytes_per_page, cap, budget)


def workspace_budget(device: torch.device) -> int:
    """Bytes a plugin's build may allocate through ``PluginBinding.alloc_workspace``.

    CUDA: free device memory now (after the weights) less 1 GiB kept for the KV pool's minimum and the
    graphs. CPU: available physical memory (``os.sysconf``), so a plugin asking for more fails at build.
    """
    import os

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(0, free - (1 << 30))
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # platforms without these names: no limit known
        return 1 << 62
