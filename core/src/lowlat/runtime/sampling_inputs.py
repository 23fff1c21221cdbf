"""Preallocated sampling inputs of DECODE steps (plugin API 3): each step's ``SamplingInfo`` in fixed device buffers.

A sampling plugin (``Coverage.sampling``) reads a step's temperature, top-k, top-p, seed and RNG offset per row from
device tensors (``lowlat.forward_batch.SamplingInfo``). ``SamplingInputs`` keeps them as views of one packed int64
device buffer with a host mirror (pinned on CUDA, the buffer itself on CPU), fills the mirror with slice stores and
sends it in one non-blocking copy, as ``lowlat.runtime.step_inputs.StepInputs`` does for the batch. The buffers have
fixed addresses, so the CUDA graphs of the ids path read them in place. Rows past the step are greedy padding.

The offsets follow ``SamplingInfo``'s rule: ``position * vocab`` for the token sampled at ``position`` (the row's
new token), so a request's draws are reproducible for its seed and fresh at every position. A greedy row
(temperature 0) draws nothing: it carries seed 0 and offset 0, so a greedy batch writes the same rows every step,
and a fill whose rows the buffers already hold sends nothing (a greedy decode uploads once, not once per step: the
copy was 8-12 µs of device time per overlapped step at batch 1 on the H200,
bench/results/2026-12-01-h200-e2e-gptfast-drift).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from lowlat.forward_batch import SamplingInfo

_FIELDS = (("temperature", torch.float32, ctypes.c_float), ("top_k", torch.int32, ctypes.c_int32),
           ("top_p", torch.float32, ctypes.c_float), ("seeds", torch.int64, ctypes.c_int64),
           ("offsets", torch.int64, ctypes.c_int64))
_ALIGN = 64  # int64 words (512 bytes)


class SamplingInputs:
    """Fixed device buffers of ``max_rows`` rows for ``SamplingInfo`` and their host mirror.

    Args:
        device: where the steps run. max_rows: rows at most (max_batch_size * tokens per request).
        vocab: the model's vocabulary size (top_k >= vocab is written as 0, off; offsets are position * vocab).
    """

    def __init__(self, *, device: torch.device | str, max_rows: int, vocab: int) -> None:
        if max_rows < 1 or vocab < 1:
            raise ValueError(f"SamplingInputs needs max_rows >= 1 and vocab >= 1, got {max_rows} and {vocab}")
        self.device, self.max_rows, self.vocab = torch.device(device), max_rows, vocab
        words = (max_rows + _ALIGN - 1) // _ALIGN * _ALIGN
        self.buffer = torch.zeros(len(_FIELDS) * words, dtype=torch.int64, device=self.device)
        cuda = self.device.type == "cuda"
        self.host_buffer = torch.zeros_like(self.buffer, device="cpu", pin_memory=True) if cuda else self.buffer
        self._views: dict[str, torch.Tensor] = {}
        self._host: dict[str, Any] = {}
        for i, (name, dtype, ctype) in enumerate(_FIELDS):
            self._views[name] = self.buffer[i * words:(i + 1) * words].view(dtype)[:max_rows]
            self._host[name] = (ctype * max_rows).from_address(self.host_buffer.data_ptr() + 8 * i * words)
        self._shadow = {name: [0] * max_rows for name, _, _ in _FIELDS}  # what the buffers hold (after the copy)
        self._top_p_one()
        self._copied = torch.cuda.Event() if cuda else None
        self._in_flight = False

    def _top_p_one(self) -> None:
        self._host["top_p"][:] = self._shadow["top_p"][:] = [1.0] * self.max_rows
        if self.host_buffer is not self.buffer:
            self.buffer.copy_(self.host_buffer)

    def info(self, rows: int, *, all_greedy: bool = True, max_top_k: int = 0, any_top_p: bool = False,
             top_p_alone: bool = False) -> SamplingInfo:
        """A SamplingInfo of the first ``rows`` rows of the buffers with this host summary (no copy)."""
        v = self._views
        return SamplingInfo(v["temperature"][:rows], v["top_k"][:rows], v["top_p"][:rows], v["seeds"][:rows],
                            v["offsets"][:rows], all_greedy=all_greedy, max_top_k=max_top_k, any_top_p=any_top_p,
                            top_p_alone=top_p_alone)

    def fill(self, params: Sequence[Any], seeds: Sequence[int], positions: Sequence[int],
             pad_to: int | None = None) -> SamplingInfo:
        """Write one row per entry (a SamplingParams, its request's seed, the position sampled) and upload; a fill
        whose rows the buffers already hold writes and sends nothing.

        Args:
            params / seeds / positions: R entries each. pad_to: rows written (default R): rows R..pad_to-1 are
                greedy padding (a CUDA graph of a larger batch reads them).
        Returns:
            The SamplingInfo of the R rows (views of the buffers, valid until the next ``fill``).
        Raises:
            ValueError: more rows than ``max_rows`` or entries of unequal length.
        """
        n = len(params)
        m = n if pad_to is None else pad_to
        if not (len(seeds) == len(positions) == n) or not n <= m <= self.max_rows:
            raise ValueError(f"SamplingInputs.fill got {n} params, {len(seeds)} seeds, {len(positions)} positions "
                             f"for {m} of {self.max_rows} rows")
        vocab = self.vocab
        temps = [p.temperature for p in params]
        ks = [p.top_k if 0 < p.top_k < vocab and p.temperature > 0 else 0 for p in params]
        ps = [p.top_p if p.temperature > 0 else 1.0 for p in params]
        pad = m - n
        rows = {"temperature": temps + [0.0] * pad, "top_k": ks + [0] * pad, "top_p": ps + [1.0] * pad,
                "seeds": [int(s) & 0x7FFF_FFFF_FFFF_FFFF if t > 0 else 0 for s, t in zip(seeds, temps)] + [0] * pad,
                "offsets": [int(q) * vocab if t > 0 else 0 for q, t in zip(positions, temps)] + [0] * pad}
        if any(self._shadow[name][:m] != v for name, v in rows.items()):
            if self._in_flight:  # the last upload must have read the mirror before it is rewritten
                self._copied.synchronize()  # type: ignore[union-attr]
                self._in_flight = False
            for name, v in rows.items():
                self._host[name][:m] = self._shadow[name][:m] = v
            if self.host_buffer is not self.buffer:
                self.buffer.copy_(self.host_buffer, non_blocking=True)
                self._copied.record(torch.cuda.current_stream(self.device))  # type: ignore[union-attr]
                self._in_flight = True
        sampled = [i for i, t in enumerate(temps) if t > 0]
        return self.info(n, all_greedy=not sampled, max_top_k=max((ks[i] for i in sampled), default=0),
                         any_top_p=any(ps[i] < 1.0 for i in sampled),
                         top_p_alone=any(ps[i] < 1.0 and ks[i] == 0 for i in sampled))

    def static(self, rows: int, variant: str, max_top_k: int) -> SamplingInfo:
        """The SamplingInfo a CUDA graph of ``variant`` is captured with (values of that variant in the buffers).

        Args:
            rows: the graph's rows. variant: "greedy", "sample" or "filter". max_top_k: the plugin's, for "filter".
        """
        filt = variant == "filter"
        k = max(1, min(max_top_k, self.vocab - 1)) if filt and max_top_k else 0

        class _P:  # a stand-in for SamplingParams (frozen dataclass with validation is not needed here)
            temperature = 0.0 if variant == "greedy" else 1.0
            top_k = k
            top_p = 0.9 if filt else 1.0

        info = self.fill([_P()] * rows, [0] * rows, [0] * rows)
        if self._in_flight:
            self._copied.synchronize()  # type: ignore[union-attr]
            self._in_flight = False
        return info
