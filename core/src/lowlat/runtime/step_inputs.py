"""Preallocated inputs of DECODE and VERIFY steps, built incrementally: one host->device copy per step.

A DECODE step differs little from the one before: every request's position and cache length grow by one, it gets
one new KV slot and one new input token. ``StepInputs`` holds all of a step's ForwardBatch tensors as views of one
packed int64 device buffer (each field 512-byte aligned, as a fresh CUDA allocation would be) with a host mirror
(pinned on CUDA; on CPU the mirror is the buffer itself). ``BatchBuilder`` writes a step's per-token entries into
the mirror with plain Python slice stores (no tensor is created), keeps the rows past the batch as CUDA-graph
padding (the dummy request row, positions 0..tpr-1, KV slot 0), sends the whole buffer in one non-blocking copy,
and writes the new KV slots into ``req_to_token`` with one ``index_copy_``. The CudaGraphRunner's fixed input
buffers are these same views, so a replay of a built batch finds its inputs, padding included, already in place.

A batch built here aliases the buffers: it is valid until the next batch is built into the same StepInputs.
``make_batch`` builds any batch (PREFILL too) from fresh tensors instead.
"""

from __future__ import annotations

import ctypes

import torch

from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.kv_cache import KVPool

_ALIGN = 64  # int64 elements = 512 bytes
_I64, _I32 = torch.int64, torch.int32
_CTYPE = {_I64: ctypes.c_int64, _I32: ctypes.c_int32}


class StepInputs:
    """Packed step inputs on ``device`` plus their host mirror.

    Args:
        device: where the step runs.
        max_batch_size: rows (requests) at most.
        max_tokens_per_req: tokens per request at most (VERIFY's k+1; 1 for DECODE only).
        dummy_row: the KV pool's padding row (its ``req_to_token`` entries are all slot 0).

    Attributes (device tensors, views of ``buffer``; ``T = max_batch_size * max_tokens_per_req``):
        input_ids, positions, out_cache_loc: [T] int64, as in ForwardBatch.
        req_pool_indices: [max_batch_size] int64; seq_lens, extend_lens, extend_start_loc: [max_batch_size] int32.
        kv_index: [T] int64 ``row * max_context_len + position`` of each token (its ``req_to_token`` entry).
        kv_slot: [T] int32 each token's KV slot (``out_cache_loc`` as int32, for ``req_to_token``).
        buffer / host_buffer: the packed int64 device buffer and its host mirror (the same tensor on CPU).
        layout: ``(batch_size, tokens_per_req)`` a BatchBuilder last wrote, or None once anything else wrote the
            buffers (``invalidate``); then the next build rewrites every row.
    """

    FIELDS = (("input_ids", _I64, "t"), ("positions", _I64, "t"), ("out_cache_loc", _I64, "t"),
              ("kv_index", _I64, "t"), ("kv_slot", _I32, "t"), ("req_pool_indices", _I64, "b"),
              ("seq_lens", _I32, "b"), ("extend_lens", _I32, "b"), ("extend_start_loc", _I32, "b"))

    def __init__(self, *, device: torch.device | str, max_batch_size: int, max_tokens_per_req: int,
                 dummy_row: int) -> None:
        if max_batch_size < 1 or max_tokens_per_req < 1:
            raise ValueError(f"max_batch_size and max_tokens_per_req must be >= 1, got {max_batch_size} and "
                             f"{max_tokens_per_req}")
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.max_tokens_per_req = max_tokens_per_req
        self.max_tokens = max_batch_size * max_tokens_per_req
        self.dummy_row = dummy_row
        fields, total = [], 0  # (name, dtype, elements, offset and size in int64 words)
        for name, dtype, kind in self.FIELDS:
            n = self.max_tokens if kind == "t" else max_batch_size
            words = n if dtype is _I64 else (n + 1) // 2
            fields.append((name, dtype, n, total, words))
            total += (words + _ALIGN - 1) // _ALIGN * _ALIGN
        self.buffer = torch.zeros(total, dtype=_I64, device=self.device)
        self.host_buffer = torch.zeros(total, dtype=_I64, pin_memory=True) if self.device.type == "cuda" \
            else self.buffer
        self._host: dict[str, ctypes.Array] = {}
        for name, dtype, n, off, words in fields:
            setattr(self, name, self.buffer[off:off + words].view(dtype)[:n])
            self._host[name] = (_CTYPE[dtype] * n).from_address(self.host_buffer.data_ptr() + 8 * off)
        self.layout: tuple[int, int] | None = None
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._in_flight = False

    def host(self, name: str) -> ctypes.Array:
        """The host mirror of field ``name`` as a ctypes array (slice stores of Python ints write the mirror)."""
        return self._host[name]

    def invalidate(self) -> None:
        """Mark the buffers as written by someone other than a BatchBuilder."""
        self.layout = None

    def wait_host(self) -> None:
        """Block until the last ``upload`` has read the host mirror (so it may be rewritten)."""
        if self._in_flight:
            self._copied.synchronize()
            self._in_flight = False

    def upload(self) -> None:
        """Copy the whole host mirror to the device buffer (non-blocking, on the current stream); CPU: nothing."""
        if self.host_buffer is not self.buffer:
            self.buffer.copy_(self.host_buffer, non_blocking=True)
            self._copied.record(torch.cuda.current_stream(self.device))
            self._in_flight = True


class BatchBuilder:
    """Builds DECODE and VERIFY ForwardBatches into a StepInputs, allocating their KV slots.

    Args:
        pool: the KV pool (same device as ``inputs``).
        inputs: the buffers to build into (the CudaGraphRunner's, so replays need no copies).
    """

    def __init__(self, pool: KVPool, inputs: StepInputs) -> None:
        a, b = pool.device, inputs.device
        if a.type != b.type or (a.index is not None and b.index is not None and a.index != b.index):
            raise ValueError(f"StepInputs on {inputs.device} cannot feed a KV pool on {pool.device}")
        self.pool = pool
        self.inputs = inputs
        self._ctx = pool.max_context_len
        self._h = {name: inputs.host(name) for name, _, _ in StepInputs.FIELDS}
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def fits(self, batch_size: int, tokens_per_req: int) -> bool:
        """Whether a batch of this shape fits the buffers (else build it with ``make_batch``)."""
        return 0 < batch_size <= self.inputs.max_batch_size and 0 < tokens_per_req <= self.inputs.max_tokens_per_req

    def build(self, mode: ForwardMode, rows: list[int], prefix_lens: list[int], tokens: list[int],
              tokens_per_req: int = 1) -> ForwardBatch:
        """Allocate KV slots for the new tokens and build the step's ForwardBatch (views of the buffers).

        Args:
            mode: DECODE (``tokens_per_req`` 1) or VERIFY.
            rows: B ``req_to_token`` rows; row i must hold exactly ``prefix_lens[i]`` positions.
            prefix_lens: B tokens already cached per request.
            tokens: B * tokens_per_req new token ids, request by request.
            tokens_per_req: new tokens per request.

        Returns:
            The same ForwardBatch as ``make_batch(pool, mode, rows, prefix_lens, token_lists)`` would build.

        Raises:
            ValueError: bad shape (see ``fits``), lengths that disagree, a DECODE step of more than one token per
                request; KVPoolExhausted / ValueError from ``KVPool.alloc_slot``.
        """
        b, tpr = len(rows), tokens_per_req
        if mode is ForwardMode.PREFILL or (mode is ForwardMode.DECODE and tpr != 1):
            raise ValueError(f"BatchBuilder builds DECODE (one token per request) and VERIFY steps, not {mode.name} "
                             f"with {tpr} tokens per request")
        if not (0 < b <= self.inputs.max_batch_size and 0 < tpr <= self.inputs.max_tokens_per_req
                and len(prefix_lens) == b and len(tokens) == b * tpr):
            raise ValueError(f"cannot build {b} requests of {tpr} tokens ({len(prefix_lens)} prefix lengths, "
                             f"{len(tokens)} tokens) into buffers of {self.inputs.max_batch_size} x "
                             f"{self.inputs.max_tokens_per_req}")
        alloc, ctx, h = self.pool.alloc_slot, self._ctx, self._h
        if tpr == 1:
            positions = prefix_lens
            slots = [alloc(r, p) for r, p in zip(rows, prefix_lens)]
            index = [r * ctx + p for r, p in zip(rows, prefix_lens)]
            seq = [p + 1 for p in prefix_lens]
        else:
            positions = [p + j for p in prefix_lens for j in range(tpr)]
            slots = [alloc(r, p + j) for r, p in zip(rows, prefix_lens) for j in range(tpr)]
            index = [r * ctx + p + j for r, p in zip(rows, prefix_lens) for j in range(tpr)]
            seq = [p + tpr for p in prefix_lens]
        inputs = self.inputs
        inputs.wait_host()
        layout = inputs.layout
        if layout is None or layout[1] != tpr:
            self._pad(0, inputs.max_batch_size, tpr)
        elif b < layout[0]:
            self._pad(b, layout[0], tpr)
        t = b * tpr
        h["input_ids"][:t] = tokens
        h["positions"][:t] = positions
        h["out_cache_loc"][:t] = slots
        h["kv_slot"][:t] = slots
        h["kv_index"][:t] = index
        h["seq_lens"][:b] = seq
        h["req_pool_indices"][:b] = rows
        inputs.upload()
        inputs.layout = (b, tpr)
        v = self._views.get((b, tpr)) or self._make_views(b, tpr)
        self.pool.write_slots(v[7], v[8])
        return ForwardBatch(mode, v[0], v[1], v[2], v[3], v[4], v[5], v[6], tokens_per_req=tpr,
                            seq_lens_cpu=seq, extend_lens_cpu=[tpr] * b)

    def _pad(self, lo: int, hi: int, tpr: int) -> None:
        """Write rows ``[lo, hi)`` of the host mirror as padding for ``tpr`` tokens per request.

        When the whole mirror is rewritten (``lo == 0``), also the per-row constants (extend lens, start offsets).
        """
        h, n, t0, t1 = self._h, hi - lo, lo * tpr, hi * tpr
        h["input_ids"][t0:t1] = [0] * (t1 - t0)
        h["positions"][t0:t1] = list(range(tpr)) * n
        h["out_cache_loc"][t0:t1] = [0] * (t1 - t0)
        h["seq_lens"][lo:hi] = [tpr] * n
        h["req_pool_indices"][lo:hi] = [self.inputs.dummy_row] * n
        if lo == 0:
            m = self.inputs.max_batch_size
            h["extend_lens"][:m] = [tpr] * m
            h["extend_start_loc"][:m] = list(range(0, m * tpr, tpr))

    def _make_views(self, b: int, tpr: int) -> tuple[torch.Tensor, ...]:
        i, t = self.inputs, b * tpr
        v = (i.input_ids[:t], i.positions[:t], i.seq_lens[:b], i.req_pool_indices[:b], i.out_cache_loc[:t],
             i.extend_lens[:b], i.extend_start_loc[:b], i.kv_index[:t], i.kv_slot[:t])
        self._views[(b, tpr)] = v
        return v


def make_batch(
    pool: KVPool,
    mode: ForwardMode,
    rows: list[int],
    prefix_lens: list[int],
    token_lists: list[list[int]],
) -> ForwardBatch:
    """Allocate KV slots for new tokens and build the step's ForwardBatch.

    Args:
        pool: the KV pool; each row must already hold ``prefix_lens[i]`` positions.
        mode: the step's mode.
        rows: B ``req_to_token`` rows.
        prefix_lens: B tokens already cached per request.
        token_lists: B lists of new token ids.

    Raises:
        KVPoolExhausted / ValueError: from ``KVPool.alloc_slots`` and ``ForwardBatch.build``.
    """
    extend = [len(t) for t in token_lists]
    locs = [pool.alloc_slots(r, p + e) for r, p, e in zip(rows, prefix_lens, extend)]
    out_cache_loc = torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64, device=pool.device)
    ids = [t for toks in token_lists for t in toks]
    return ForwardBatch.build(mode, ids, prefix_lens, extend, rows, out_cache_loc, pool.device)
