"""The mutation probe's "ids" check: a plugin's ``sample`` stage on constructed logits, judged by ``ids_check``.

Three inputs, each the condition one kind of sampling bug needs: an exact tie at the maximum (greedy rows), a NaN
logit (the non-finite flag), and a peaked random row sampled with temperature 0.5, top-k 3, and top-p 0.7 (480
seeded draws each, against ``target_probs``); and after every call, whether it changed its SamplingInfo in place.
Returns the first problem, or None.
"""

from __future__ import annotations

from typing import Any

import torch

from lowlat_contract.ids_check import distribution_problem, greedy_problem, nonfinite_problem, temperature_for

VOCAB, DRAWS = 64, 480


def _sample(forward: Any, logits: torch.Tensor, info: Any) -> tuple[torch.Tensor, str | None]:
    """``forward.sample(logits, info)`` and the SamplingInfo fields it changed in place (None: none)."""
    from lowlat_contract.ids_check import sampling_edits, sampling_snapshot

    before = sampling_snapshot(info)
    ids = forward.sample(logits, info)
    edited = sampling_edits(info, before)
    return ids, (f"sample() changed its SamplingInfo in place: {', '.join(edited)}" if edited else None)


def probe_ids(forward: Any, device: torch.device) -> str | None:
    """The first ``ids_check`` problem of ``forward.sample`` on the constructed logits (module docstring), or
    the SamplingInfo fields a call changed in place."""
    from lowlat.runtime.sampling import SamplingParams
    from lowlat.runtime.sampling_inputs import SamplingInputs
    from lowlat.runtime.speculative.verify import target_probs

    gen = torch.Generator().manual_seed(3)
    row = torch.randn(VOCAB, generator=gen) * 3
    si = SamplingInputs(device=device, max_rows=DRAWS, vocab=VOCAB)
    tie = row.clone()
    tie[5] = tie[40] = float(row.max()) + 1.0
    ids, edit = _sample(forward, tie[None].to(device), si.fill([SamplingParams()], [0], [0]))
    if edit:
        return edit
    problem = greedy_problem(ids, tie[None], None, "greedy row with an exact tie at tokens 5 and 40", exact_ties=True)
    if problem:
        return problem
    nan = torch.stack([row, row])
    nan[0, 7] = float("nan")
    ids, edit = _sample(forward, nan.to(device), si.fill([SamplingParams(), SamplingParams(temperature=1.0)], [0, 1],
                                                        [0, 0]))
    problem = edit or nonfinite_problem(ids, nan, "a row with a NaN logit (row 0) beside a finite one")
    if problem:
        return problem
    t = temperature_for(row)
    for params in (SamplingParams(temperature=t / 2), SamplingParams(temperature=t, top_k=3),
                   SamplingParams(temperature=t, top_p=0.7)):
        info = si.fill([params] * DRAWS, list(range(1, DRAWS + 1)), [0] * DRAWS)
        ids, edit = _sample(forward, row[None].repeat(DRAWS, 1).to(device), info)
        problem = edit or distribution_problem(ids, target_probs(row[None], [params])[0], f"draws with {params}")
        if problem:
            return problem
    return None
