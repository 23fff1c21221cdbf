"""The mutation probe's "ids" check: a plugin's ``sample`` stage on constructed logits, judged by ``ids_check``.

Three inputs, each the condition one kind of sampling bug needs: an exact tie at the maximum (greedy rows), a NaN
logit (the non-finite flag), and a peaked random row sampled with temperature 0.5, top-k 3, and top-p 0.7 (480
seeded draws each, against ``target_probs``). Returns the first problem, or None.
"""

from __future__ import annotations

from typing import Any

import torch

from lowlat_contract.ids_check import distribution_problem, greedy_problem, nonfinite_problem, temperature_for

VOCAB, DRAWS = 64, 480


def probe_ids(forward: Any, device: torch.device) -> str | None:
    """The first ``ids_check`` problem of ``forward.sample`` on the constructed logits (module docstring)."""
    from lowlat.runtime.sampling import SamplingParams
    from lowlat.runtime.sampling_inputs import SamplingInputs
    from lowlat.runtime.speculative.verify import target_probs

    gen = torch.Generator().manual_seed(3)
    row = torch.randn(VOCAB, generator=gen) * 3
    si = SamplingInputs(device=device, max_rows=DRAWS, vocab=VOCAB)
    tie = row.clone()
    tie[5] = tie[40] = float(row.max()) + 1.0
    ids = forward.sample(tie[None].to(device), si.fill([SamplingParams()], [0], [0]))
    problem = greedy_problem(ids, tie[None], None, "greedy row with an exact tie at tokens 5 and 40", exact_ties=True)
    if problem:
        return problem
    nan = torch.stack([row, row])
    nan[0, 7] = float("nan")
    ids = forward.sample(nan.to(device), si.fill([SamplingParams(), SamplingParams(temperature=1.0)], [0, 1], [0, 0]))
    problem = nonfinite_problem(ids, nan, "a row with a NaN logit (row 0) beside a finite one")
    if problem:
        return problem
    t = temperature_for(row)
    for params in (SamplingParams(temperature=t / 2), SamplingParams(temperature=t, top_k=3),
                   SamplingParams(temperature=t, top_p=0.7)):
        info = si.fill([params] * DRAWS, list(range(1, DRAWS + 1)), [0] * DRAWS)
        ids = forward.sample(row[None].repeat(DRAWS, 1).to(device), info)
        problem = distribution_problem(ids, target_probs(row[None], [params])[0], f"draws with {params}")
        if problem:
            return problem
    return None
