"""Sampling parameters and a batched sampler over float32 logits.

Order of the transforms follows HF transformers' logits processors: temperature, then top-k, then top-p
(nucleus sampling, Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"). A temperature of 0
means greedy (argmax). Sampling draws one categorical sample per row with the Gumbel-max trick
(``argmax(log p - log(-log u))``, u ~ U(0,1)), where each row's uniform noise comes from that request's own
``torch.Generator``: the same seed gives the same tokens whatever else runs in the batch, and identical
logits on every tensor-parallel rank give identical tokens there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token of one request.

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1).
        temperature: 0 for greedy; > 0 divides the logits before sampling.
        top_p: keep the smallest set of tokens whose probability sums to at least top_p, in (0, 1].
        top_k: keep the k most likely tokens; 0 keeps all.
        seed: seed of the request's generator; None derives one from EngineConfig.seed and the request id.
        stop_at_eos: stop when the model emits an end-of-sequence token (it is kept in the output).

    Raises:
        ValueError: a value is out of range; the message names the field.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``."""
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: [R, V] float32 (any float dtype is upcast).
        params: R sampling parameters, one per row (rows of one request repeat its parameters).
        generators: R generators on ``logits.device``; a row's generator may be None only when it is greedy.
            Rows sharing a generator consume its stream in row order.

    Returns:
        [R] int64 token ids on ``logits.device``.

    Raises:
        ValueError: ``params``/``generators`` do not have one entry per row, or a sampled row lacks a generator.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if len(params) != rows or len(generators) != rows:
        raise ValueError(f"need one SamplingParams and generator per logits row ({rows}), "
                         f"got {len(params)} and {len(generators)}")
    logits = logits.float()
    greedy_ids = torch.argmax(logits, dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return greedy_ids
    idx = _to_device(sampled_rows, torch.int64, logits.device)
    sub = logits.index_select(0, idx)
    temps = _to_device([params[i].temperature for i in sampled_rows], torch.float32, logits.device)
    sub = sub / temps[:, None]
    top_ks = [params[i].top_k for i in sampled_rows]
    if any(0 < k < vocab for k in top_ks):
        ks = _to_device([k if 0 < k < vocab else vocab for k in top_ks], torch.int64, logits.device)
        kth = torch.sort(sub, dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
        sub = sub.masked_fill(sub < kth, float("-inf"))
    top_ps = [params[i].top_p for i in sampled_rows]
    if any(p < 1.0 for p in top_ps):
        sub = _top_p_mask(sub, _to_device(top_ps, torch.float32, logits.device))
    log_probs = torch.log_softmax(sub, dim=-1)
    noise = []
    for i in sampled_rows:
        g = generators[i]
        if g is None:
            raise ValueError(f"row {i} samples with temperature {params[i].temperature} but has no generator")
        noise.append(torch.rand(vocab, generator=g, device=logits.device, dtype=torch.float32))
    u = torch.stack(noise).clamp_(min=torch.finfo(torch.float32).tiny, max=1.0 - 1e-7)
    gumbel = -torch.log(-torch.log(u))
    picked = torch.argmax(log_probs + gumbel, dim=-1)
    out = greedy_ids.clone()
    out[idx] = picked
    return out


def _to_device(values: list[float] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without a host sync: ``torch.tensor(..., device=cuda)`` copies with
    ``non_blocking=False``, which waits for the stream (the whole forward) before the sampler's kernels are queued.
    A non-blocking copy from pageable memory is staged by the driver before it returns, so the list may go."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's nucleus; [N, V] float32 in and out, top_p [N].

    A token is kept when the probability mass of the strictly more likely tokens is below top_p,
    so the most likely token is always kept.
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    remove_sorted = mass_before >= top_p[:, None]
    remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))
