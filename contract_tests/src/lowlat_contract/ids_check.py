"""Checks of sampled ids (plugin API 3), shared by the ``sampled_ids`` contract and the mutation probe.

- ``greedy_problem``: greedy ids against the general path's logits: each id must be ``torch.argmax`` of the row
  (the lowest index among equal maxima, as ``lowlat.runtime.sampling`` resolves ties) or, where the row's top
  logits lie within the dtype's bound (``Tolerance.atol``) of each other, a token within that bound of the maximum
  (a near-tie the plugin's own rounding may resolve either way). An exact tie (``exact_ties``) excuses nothing.
- ``nonfinite_problem``: a row whose logits hold NaN or inf must come back as -1.
- ``distribution_problem``: draws against the core sampler's probabilities ``probs`` of the same logits
  (``lowlat.runtime.speculative.verify.target_probs``): a draw outside the support (probability 0: cut by top-k or
  top-p) fails at once; otherwise Pearson's chi-square over the tokens of expected count >= 5 (the rest pooled)
  fails when its p-value is below ``ALPHA``. A correct sampler fails with probability at most ALPHA per test.
- ``sampling_edits``: the SamplingInfo fields a plugin call changed in place.
"""

from __future__ import annotations

from typing import Any

import torch

ALPHA = 1e-4
"""Failure probability of a correct sampler in one ``distribution_problem`` (the test's size)."""


def greedy_problem(ids: torch.Tensor, logits: torch.Tensor, atol: float | None, what: str,
                   exact_ties: bool = False) -> str | None:
    """None when every greedy id is the row's argmax (or a near-tie within ``atol``); else a message."""
    ids, logits = ids.cpu(), logits.float().cpu()
    want = torch.argmax(logits, dim=-1)
    for r in range(ids.shape[0]):
        got, top = int(ids[r]), int(want[r])
        if got == top:
            continue
        if not 0 <= got < logits.shape[1]:
            return f"{what}: row {r} got id {got}, outside [0, {logits.shape[1]}); argmax is {top}"
        gap = float(logits[r, top] - logits[r, got])
        if exact_ties and gap == 0.0:
            return (f"{what}: row {r} picked {got} of tokens tied exactly at the maximum; the core sampler "
                    f"(torch.argmax) picks the lowest index, {top}")
        if atol is None or gap > atol:
            return (f"{what}: row {r} picked {got}, whose logit is {gap:.4g} below the argmax {top}'s"
                    + (f" (bound {atol:.4g})" if atol is not None else ""))
    return None


def nonfinite_problem(ids: torch.Tensor, logits: torch.Tensor, what: str) -> str | None:
    """None when exactly the rows of ``logits`` holding NaN/inf have id -1."""
    bad = ~torch.isfinite(logits.float().cpu()).all(dim=-1)
    ids = ids.cpu()
    for r in range(ids.shape[0]):
        if bool(bad[r]) != (int(ids[r]) == -1):
            state = "holds NaN/inf" if bool(bad[r]) else "is finite"
            return (f"{what}: row {r} {state} but got id {int(ids[r])}; the contract is -1 exactly for rows whose "
                    f"logits are not all finite (the engine's non-finite guard reads it)")
    return None


def distribution_problem(draws: torch.Tensor, probs: torch.Tensor, what: str, alpha: float = ALPHA) -> str | None:
    """None when ``draws`` [N] (token ids) fit ``probs`` [V] (module docstring); else a message."""
    draws, probs = draws.cpu().long(), probs.double().cpu()
    n, vocab = draws.numel(), probs.numel()
    if ((draws < 0) | (draws >= vocab)).any():
        return f"{what}: an id outside [0, {vocab}) was drawn: {draws[(draws < 0) | (draws >= vocab)][:4].tolist()}"
    outside = draws[probs[draws] == 0]
    if outside.numel():
        return (f"{what}: drew token(s) {sorted(set(outside.tolist()))[:5]} that the core sampler never draws "
                f"(cut by top-k/top-p, or probability 0), {outside.numel()} of {n} draws")
    counts = torch.bincount(draws, minlength=vocab).double()
    expected = probs * n
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    rest_o, rest_e = counts[~big].sum(), expected[~big].sum()
    if rest_e >= 5 or (rest_e > 0 and obs.numel() < 2):
        obs, exp = torch.cat([obs, rest_o[None]]), torch.cat([exp, rest_e[None]])
    elif rest_e > 0 and obs.numel():  # too little pooled mass for its own bin: fold it into the smallest
        i = int(torch.argmin(exp))
        obs[i] += rest_o
        exp[i] += rest_e
    df = obs.numel() - 1
    if df < 1:
        return None  # one bin: nothing to test beyond the support
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    p = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                      torch.tensor(chi2 / 2.0, dtype=torch.float64)))
    if p < alpha:
        worst = int(torch.argmax((counts - expected).abs()))
        return (f"{what}: the draws do not follow the core sampler's distribution (chi-square {chi2:.1f} on {df} "
                f"degrees of freedom, p = {p:.2e} < {alpha:g}; {n} draws; token {worst}: drawn "
                f"{int(counts[worst])} times, expected {float(expected[worst]):.1f})")
    return None


def temperature_for(logits: torch.Tensor, top1: float = 0.3) -> float:
    """A temperature at which the row's most likely token has probability about ``top1`` (bisection on log T):
    a distribution spread over a handful of tokens, where a wrong temperature or filter shows in few draws."""
    row = logits.float().cpu()
    lo, hi = -6.0, 6.0
    for _ in range(40):
        mid = (lo + hi) / 2
        p = float(torch.softmax(row / (10.0 ** mid), dim=-1).max())
        lo, hi = (mid, hi) if p > top1 else (lo, mid)
    return float(10.0 ** ((lo + hi) / 2))


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seeds", "offsets")


def sampling_snapshot(info: Any) -> dict[str, torch.Tensor]:
    """Clones of a ``SamplingInfo``'s five tensors, for ``sampling_edits`` after the call."""
    return {n: getattr(info, n).clone() for n in SAMPLING_FIELDS}


def sampling_edits(info: Any, before: dict[str, torch.Tensor]) -> list[str]:
    """The ``SamplingInfo`` fields that differ from ``before`` (clones taken before the call), bitwise: a plugin
    must leave them as the runtime wrote them, since the runtime writes a step's rows only when they change
    (``lowlat.runtime.sampling_inputs``) and an edit would carry into the next steps."""
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype.is_floating_point else t

    return [n for n in SAMPLING_FIELDS if not torch.equal(bits(getattr(info, n)), bits(before[n]))]
