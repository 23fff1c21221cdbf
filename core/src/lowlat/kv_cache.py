"""The paged KV pool: one slot per token, pages of ``page_size`` slots, and ``req_to_token``.

Design after SGLang's ``ReqToTokenPool`` + ``MHATokenToKVPool`` (python/sglang/srt/mem_cache/memory_pool.py):
the K and V of token ``t`` of request ``r`` live at slot ``req_to_token[r, t]`` in every layer's buffers.
Slots are handed out a page at a time, so a request's slots are contiguous within each page.
Page 0 is reserved: slot 0 is the dummy slot that padded rows of a captured graph write to.
"""

from __future__ import annotations

import torch


class KVPoolExhausted(RuntimeError):
    """Raised when the pool has no free page or no free request row left."""


class KVPool:
    """KV buffers for all layers plus the request-to-slot map.

    Attributes:
        k_buffers, v_buffers: per layer ``[num_slots, num_kv_heads, head_dim]`` in ``dtype``.
        req_to_token: ``[max_reqs, max_context_len]`` int32, slot of each request's position.
        page_size: slots per page (tokens).
        num_slots: total slots including the reserved page 0.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_reqs: int,
        max_context_len: int,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"KV pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_layers = num_layers
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.num_slots = num_pages * page_size
        shape = (self.num_slots, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int32, device=self.device)
        self._free_pages: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._free_rows: list[int] = list(range(max_reqs - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}  # row -> pages owned, in position order
        self._lens: dict[int, int] = {}  # row -> positions with a slot
        self._flat = (self.req_to_token, self.req_to_token.view(-1))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K plus V for one token over all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_req(self) -> int:
        """Take a free ``req_to_token`` row. Raises KVPoolExhausted when none is left."""
        if not self._free_rows:
            raise KVPoolExhausted(f"all {self.max_reqs} request rows are in use; raise max_batch_size")
        row = self._free_rows.pop()
        self._pages[row] = []
        self._lens[row] = 0
        return row

    def num_allocated(self, row: int) -> int:
        """Positions of request ``row`` that hold a slot (tokens)."""
        return self._lens[row]

    def alloc_slots(self, row: int, new_len: int) -> torch.Tensor:
        """Give request ``row`` slots for positions ``[current_len, new_len)`` and write them to ``req_to_token``.

        Returns:
            [new_len - current_len] int64 slots on the pool's device (the step's ``out_cache_loc``).
        Raises:
            KVPoolExhausted: no free page; ValueError: ``new_len`` beyond ``max_context_len`` or shrinking.
        """
        cur = self._lens[row]
        self._grow(row, cur, new_len)
        pages = self._pages[row]
        ps = self.page_size
        if new_len - cur <= ps:  # a decode/verify-sized piece: plain Python, one host->device copy
            slots = torch.tensor([pages[p // ps] * ps + p % ps for p in range(cur, new_len)], dtype=torch.int64,
                                 device=self.device)
        else:
            pos = torch.arange(cur, new_len, dtype=torch.int64)
            slots = (torch.tensor(pages, dtype=torch.int64)[pos // ps] * ps + pos % ps).to(self.device)
        self.req_to_token[row, cur:new_len] = slots
        self._lens[row] = new_len
        return slots

    def alloc_slot(self, row: int, pos: int) -> int:
        """Give request ``row`` the slot of its next position ``pos`` (its current length): O(1) host work.

        Unlike ``alloc_slots`` this does not touch the device: the caller writes the slot to ``req_to_token``,
        e.g. for a whole batch at once with ``write_slots`` (``lowlat.runtime.step_inputs.BatchBuilder`` does).

        Returns:
            the slot (int). Raises: as ``alloc_slots``; ValueError when ``pos`` is not the row's current length.
        """
        if pos != self._lens[row]:
            raise ValueError(f"request row {row} holds {self._lens[row]} tokens; its next position is not {pos}")
        if pos >= self.max_context_len:
            raise ValueError(f"sequence of {pos + 1} tokens exceeds max_context_len={self.max_context_len}")
        page, off = divmod(pos, self.page_size)
        pages = self._pages[row]
        if page == len(pages):
            if not self._free_pages:
                self._grow(row, pos, pos + 1)  # raises KVPoolExhausted with the usual message
            pages.append(self._free_pages.pop())
        self._lens[row] = pos + 1
        return pages[page] * self.page_size + off

    def write_slots(self, flat_index: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``req_to_token.view(-1)[flat_index] = slots`` in one device op (slots from ``alloc_slot``).

        Args:
            flat_index: [N] int64 on the pool's device, ``row * max_context_len + position`` per token.
            slots: [N] int32 on the pool's device.
        """
        r2t = self.req_to_token
        if self._flat[0] is not r2t:  # cache the flat view (re-made if req_to_token is ever replaced)
            self._flat = (r2t, r2t.view(-1))
        self._flat[1].index_copy_(0, flat_index, slots)

    def _grow(self, row: int, cur: int, new_len: int) -> None:
        """Check a growth of ``row`` from ``cur`` to ``new_len`` positions and take the pages it needs."""
        if new_len > self.max_context_len:
            raise ValueError(f"sequence of {new_len} tokens exceeds max_context_len={self.max_context_len}")
        if new_len < cur:
            raise ValueError(f"request row {row} holds {cur} tokens; cannot shrink to {new_len} with alloc_slots")
        pages = self._pages[row]
        need = -(-new_len // self.page_size) - len(pages)
        if need > len(self._free_pages):
            raise KVPoolExhausted(
                f"KV pool out of pages: need {need}, {len(self._free_pages)} free of "
                f"{self.num_slots // self.page_size}; lower max_batch_size/max_context_len or raise kv_cache_fraction"
            )
        for _ in range(need):
            pages.append(self._free_pages.pop())

    def truncate(self, row: int, new_len: int) -> None:
        """Forget positions ``>= new_len`` of request ``row`` (rejected speculative tokens); frees whole pages."""
        keep = -(-new_len // self.page_size)
        pages = self._pages[row]
        while len(pages) > keep:
            self._free_pages.append(pages.pop())
        self._lens[row] = min(self._lens[row], new_len)

    def free_req(self, row: int) -> None:
        """Return request ``row`` and all its pages to the pool."""
        self._free_pages.extend(reversed(self._pages.pop(row)))
        self._lens.pop(row)
        self._free_rows.append(row)

    def slots_of(self, row: int, length: int) -> torch.Tensor:
        """[length] int64 slots of the first ``length`` positions of request ``row``."""
        return self.req_to_token[row, :length].to(torch.int64)
