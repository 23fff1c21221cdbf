"""Acceptance of draft tokens from a VERIFY step's logits, on device tensors.

A VERIFY step scores k + 1 rows per request: row j holds the target model's distribution of the token after the
pending token and drafts ``d_0 .. d_{j-1}``. Two rules decide how many drafts ``n`` (0..k) a request keeps and
the one token it appends after them (so ``n + 1`` tokens are appended):

- ``greedy_accept``: keep drafts while they equal the row's argmax; the token after them is the argmax of row n.
  The appended tokens are exactly what k + 1 plain greedy DECODE steps would produce.
- ``rejection_sample``: speculative sampling (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers
  via Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with
  Speculative Sampling", Algorithm 2). Draft ``d_j`` drawn from the draft distribution ``q_j`` is kept with
  probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the token is drawn from the residual
  ``norm(max(p_j - q_j, 0))``; when all k are kept a bonus token is drawn from ``p_k``. Each appended token is
  then distributed exactly as under plain sampling from ``p``. For a deterministic drafter (n-gram) ``q_j`` is a
  point mass on ``d_j``: keep with probability ``p_j(d_j)``, else draw from ``p_j`` with ``d_j`` removed.

``p`` is the distribution plain sampling draws from: the same temperature / top-k / top-p transforms, in the same
order, as ``lowlat.runtime.sampling.sample``; a greedy request's ``p`` is a point mass on the argmax, which makes
``rejection_sample`` reduce to ``greedy_accept`` for it (so one batch may mix greedy and sampled requests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowlat.runtime.sampling import SamplingParams, _top_p_mask

_TINY = torch.finfo(torch.float32).tiny


def greedy_accept(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    Args:
        logits: [B, k+1, V] float (VERIFY rows, request-major).
        drafts: [B, k] int64 draft ids on the same device.

    Returns:
        ``(n, token)``: [B] int64 drafts kept per request, and [B] int64 the argmax of row n (the token appended
        after the kept drafts; it differs from ``drafts[:, n]`` when n < k).
    """
    picks = torch.argmax(logits, dim=-1)  # [B, k+1]
    k = drafts.shape[1]
    n = torch.cumprod((picks[:, :k] == drafts).to(torch.int64), dim=1).sum(dim=1)
    return n, picks.gather(1, n[:, None]).squeeze(1)


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution plain sampling draws each row from.

    Args:
        logits: [R, V] float32; params: R SamplingParams (one per row).

    Returns:
        [R, V] float32 probabilities: ``softmax(top_p(top_k(logits / temperature)))`` for sampled rows (the order
        of ``sampling.sample``), a one-hot of the argmax for greedy rows.
    """
    logits = logits.float()
    rows, vocab = logits.shape
    out = torch.nn.functional.one_hot(torch.argmax(logits, dim=-1), vocab).to(torch.float32)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return out
    idx = torch.tensor(sampled, device=logits.device)
    sub = logits.index_select(0, idx)
    temps = torch.tensor([params[i].temperature for i in sampled], device=logits.device, dtype=torch.float32)
    sub = sub / temps[:, None]
    top_ks = [params[i].top_k for i in sampled]
    if any(0 < k < vocab for k in top_ks):
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
        kth = torch.sort(sub, dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
        sub = sub.masked_fill(sub < kth, float("-inf"))
    top_ps = [params[i].top_p for i in sampled]
    if any(p < 1.0 for p in top_ps):
        sub = _top_p_mask(sub, torch.tensor(top_ps, device=logits.device, dtype=torch.float32))
    out[idx] = torch.softmax(sub, dim=-1)
    return out


def rejection_sample(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2) for a batch of requests.

    Args:
        probs: [B, k+1, V] float32 target distributions ``p`` (``target_probs`` of the VERIFY rows).
        drafts: [B, k] int64 draft ids.
        draft_probs: [B, k, V] float32 draft distributions ``q`` the drafts were drawn from, or None when every
            draft is a point mass (deterministic drafters: n-gram, greedy draft model).
        generators: B generators on ``probs.device``, each request's own; None only for a request whose ``p``
            rows are point masses (greedy), which needs no randomness. Each sampled request draws k uniforms
            (accept tests) and then V (Gumbel noise of the token after the kept drafts), in that order.

    Returns:
        ``(n, token)``: [B] int64 drafts kept, and [B] int64 the token appended after them (a residual draw when
        n < k, never equal to ``drafts[:, n]``; a draw from ``p_k`` when n == k).
    """
    b, k1, vocab = probs.shape
    k = k1 - 1
    dev = probs.device
    rows = torch.arange(b, device=dev)
    p_d = probs[:, :k].gather(2, drafts[..., None]).squeeze(-1)  # [B, k]
    q_d = draft_probs.gather(2, drafts[..., None]).squeeze(-1).clamp_min(_TINY) if draft_probs is not None else 1.0
    u = torch.zeros(b, k, device=dev, dtype=torch.float32)
    noise = torch.full((b, vocab), 0.5, device=dev, dtype=torch.float32)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(k, generator=g, device=dev, dtype=torch.float32)
            noise[i] = torch.rand(vocab, generator=g, device=dev, dtype=torch.float32)
    accept = u < p_d / q_d  # u in [0, 1): a draft with p/q >= 1 is always kept, with p == 0 never
    n = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)  # [B]
    p_n = probs[rows, n]  # [B, V]
    rejected = n < k
    if draft_probs is not None:
        q_n = torch.cat((draft_probs, torch.zeros_like(draft_probs[:, :1])), dim=1)[rows, n]
        resid = (p_n - q_n).clamp_min(0.0)
    else:
        resid = p_n.clone()
    # At a rejection p(d_n) < q(d_n), so the residual at d_n is 0: enforce it exactly (a point mass gives 1 - 1).
    d_n = drafts.gather(1, n.clamp(max=max(k - 1, 0))[:, None]).squeeze(1)
    at = resid.gather(1, d_n[:, None])
    resid.scatter_(1, d_n[:, None], torch.where(rejected[:, None], torch.zeros_like(at), at))  # no host sync
    empty = resid.sum(dim=-1) <= 0  # p == q on the support: fall back to p (measure zero, kept for safety)
    resid = torch.where(empty[:, None], p_n, resid)
    gumbel = -torch.log(-torch.log(noise.clamp_(min=_TINY, max=1.0 - 1e-7)))
    token = torch.argmax(torch.log(resid) + gumbel, dim=-1)
    return n, token
