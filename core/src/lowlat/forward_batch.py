"""ForwardMode and ForwardBatch: what one model step sees.

The layout follows SGLang's ``ForwardBatch`` (python/sglang/srt/model_executor/forward_batch_info.py),
trimmed to what a decode runtime and its plugins need. Every tensor lives on the model's device.
Shapes are in tokens: ``T`` = tokens in the step, ``B`` = requests in the step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

SAMPLING_VARIANTS = ("greedy", "sample", "filter")


class ForwardMode(enum.Enum):
    """The kind of step.

    PREFILL: each request appends ``extend_lens[i]`` prompt tokens (a whole prompt or a chunk).
    DECODE:  each request appends exactly one token.
    VERIFY:  each request appends the same number ``k+1`` of tokens on top of its cache, causal among
             themselves: the step a speculative-decoding verifier runs.
    """

    PREFILL = "PREFILL"
    DECODE = "DECODE"
    VERIFY = "VERIFY"

    @classmethod
    def parse(cls, name: str) -> ForwardMode:
        """Parse a mode by name, case-insensitively. Raises ValueError naming the valid modes."""
        try:
            return cls[name.upper()]
        except KeyError:
            valid = ", ".join(m.name for m in cls)
            raise ValueError(f"unknown forward mode {name!r}; valid modes: {valid}") from None


@dataclass
class SamplingInfo:
    """The sampling parameters of a step's logit rows as device tensors (plugin API 3), R rows.

    A plugin whose spec declares ``Coverage.sampling`` may return the step's sampled ids instead of logits
    (``ForwardBatch.wants_ids``); these are its inputs. Semantics are those of ``lowlat.runtime.sampling.sample``
    (HF order: temperature, top-k, top-p; docs/writing-a-plugin.md, "Sampled ids"):

    Attributes:
        temperature: [R] float32; 0 makes the row greedy (argmax, the lowest index among equal maxima).
        top_k: [R] int32; 0 is off (the runtime writes 0 for a top_k >= vocab).
        top_p: [R] float32 in (0, 1]; 1.0 is off.
        seeds: [R] int64, the request's seed (the same every step); 0 for a greedy row, which draws nothing.
        offsets: [R] int64 counter base: the draw for token i of row r uses the counter-based RNG stream
            (seeds[r], offsets[r] + i); the runtime writes ``position * vocab`` (0 for a greedy row), so every
            (request, position, token) draws its own number. All five are read-only: the runtime rewrites them
            only when a step's rows change. A plugin's draws need not equal the general path's (which come from the
            request's torch.Generator), only follow the same distribution and be reproducible for a seed.
        all_greedy / max_top_k / any_top_p / top_p_alone: host-side summary (no device read): every row greedy;
            the largest top_k of a sampled row (0: none uses top-k); some sampled row has top_p < 1; some
            sampled row has top_p < 1 and no top-k.

    A plugin picks its kernel variant from ``variant`` (host side) only, never from the tensors' values: a CUDA
    graph captured for a variant replays every step of that variant.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    offsets: torch.Tensor
    all_greedy: bool = True
    max_top_k: int = 0
    any_top_p: bool = False
    top_p_alone: bool = False

    @property
    def variant(self) -> str:
        """"greedy" (every row), "sample" (temperature only) or "filter" (some row uses top-k or top-p)."""
        if self.all_greedy:
            return "greedy"
        return "filter" if self.max_top_k > 0 or self.any_top_p else "sample"


@dataclass
class ForwardBatch:
    """One step's inputs.

    Attributes:
        forward_mode: PREFILL, DECODE or VERIFY.
        input_ids: [T] int64 token ids, requests concatenated in order.
        positions: [T] int64 position of each token in its sequence (0-based).
        seq_lens: [B] int32 tokens in each request's cache *after* this step (prefix + new).
        req_pool_indices: [B] int64 row of each request in the KV pool's ``req_to_token``.
        out_cache_loc: [T] int64 KV slot each new token's K and V are written to.
        extend_lens: [B] int32 new tokens per request (1 for DECODE, k+1 for VERIFY).
        extend_start_loc: [B] int32 offset of each request's first new token in ``input_ids``.
        tokens_per_req: new tokens per request when uniform (DECODE: 1, VERIFY: k+1); None for PREFILL.
        seq_lens_cpu: host copy of ``seq_lens`` (list of ints), None inside a captured graph.
        extend_lens_cpu: host copy of ``extend_lens``, None inside a captured graph.
        sampling: the rows' sampling parameters on the device (plugin API 3), None when the runtime samples
            itself (PREFILL, VERIFY, tests and the contract suite's logits checks).
        logits_required: the caller needs this step's logits (an observer, logprobs); with ``sampling`` set and
            this False a sampling plugin returns ids (``wants_ids``).

    Output convention of every forward (general or plugin): float32 logits ``[R, vocab]`` where
    R = T for DECODE and VERIFY (one row per new token) and R = B for PREFILL (last token of each
    request). When ``wants_ids`` and the plugin's ``Coverage.sampling`` covers ``sampling``, a plugin forward
    returns int64 ids ``[R]`` instead: row r's sampled token, or -1 when row r's logits were not all finite.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    tokens_per_req: int | None = None
    seq_lens_cpu: list[int] | None = None
    extend_lens_cpu: list[int] | None = None
    sampling: SamplingInfo | None = None
    logits_required: bool = True

    @property
    def wants_ids(self) -> bool:
        """Whether the step asks for sampled ids (``sampling`` set and ``logits_required`` False)."""
        return self.sampling is not None and not self.logits_required

    @property
    def batch_size(self) -> int:
        """B, the number of requests in the step."""
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """T, the number of new tokens in the step."""
        return int(self.input_ids.shape[0])

    @property
    def num_logit_rows(self) -> int:
        """R, rows of logits the step returns (T for DECODE/VERIFY, B for PREFILL)."""
        return self.batch_size if self.forward_mode is ForwardMode.PREFILL else self.num_tokens

    @classmethod
    def build(
        cls,
        forward_mode: ForwardMode,
        input_ids: list[int] | torch.Tensor,
        prefix_lens: list[int],
        extend_lens: list[int],
        req_pool_indices: list[int],
        out_cache_loc: torch.Tensor,
        device: torch.device | str,
    ) -> ForwardBatch:
        """Build a batch from host-side lists.

        Args:
            forward_mode: the step's mode.
            input_ids: T token ids.
            prefix_lens: B tokens already in each request's cache before the step.
            extend_lens: B new tokens per request; sum must equal T.
            req_pool_indices: B rows in ``req_to_token``.
            out_cache_loc: [T] int64 slots, usually from ``KVPool.alloc_slots``.
            device: where the tensors go.

        Raises:
            ValueError: when the lengths disagree, or a DECODE/VERIFY step is not uniform.
        """
        n_tok = sum(extend_lens)
        ids = torch.as_tensor(input_ids, dtype=torch.int64)
        if not (len(prefix_lens) == len(extend_lens) == len(req_pool_indices)):
            raise ValueError("prefix_lens, extend_lens and req_pool_indices must have one entry per request")
        if ids.numel() != n_tok or out_cache_loc.numel() != n_tok:
            raise ValueError(
                f"input_ids has {ids.numel()} tokens and out_cache_loc {out_cache_loc.numel()}, "
                f"but extend_lens sum to {n_tok}"
            )
        tokens_per_req = None
        if forward_mode is not ForwardMode.PREFILL:
            if len(set(extend_lens)) != 1:
                raise ValueError(f"{forward_mode.name} needs the same new-token count per request, got {extend_lens}")
            tokens_per_req = extend_lens[0]
            if forward_mode is ForwardMode.DECODE and tokens_per_req != 1:
                raise ValueError(f"DECODE appends one token per request, got {tokens_per_req}")
        positions = torch.cat(
            [torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix_lens, extend_lens)]
        ) if n_tok else torch.zeros(0, dtype=torch.int64)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        starts = [0]
        for e in extend_lens[:-1]:
            starts.append(starts[-1] + e)
        dev = torch.device(device)
        return cls(
            forward_mode=forward_mode,
            input_ids=ids.to(dev),
            positions=positions.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64, device=dev),
            out_cache_loc=out_cache_loc.to(device=dev, dtype=torch.int64),
            extend_lens=torch.tensor(extend_lens, dtype=torch.int32, device=dev),
            extend_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            tokens_per_req=tokens_per_req,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(extend_lens),
        )
