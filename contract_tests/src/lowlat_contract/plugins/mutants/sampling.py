"""Sampled ids (plugin API 3): the ``sample`` stage of a fused LM head + sampling kernel gone wrong."""

from __future__ import annotations

import dataclasses

import torch
from lowlat.forward_batch import SamplingInfo
from lowlat.plugin import sample_ids

from lowlat_contract.plugins.mutants._base import HookedReference


class IdsTieLastIndex(HookedReference):
    """ids_tie_last_index: the greedy merge keeps the later of two equal keys, so exact ties at the maximum
    resolve to the highest index instead of torch.argmax's lowest. Trigger: logits with an exact tie at the top."""

    def sample(self, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        ids = sample_ids(logits, info)
        last = logits.shape[1] - 1 - torch.argmax(logits.float().flip(-1), dim=-1)
        return torch.where(info.temperature > 0, ids, torch.where(ids < 0, ids, last))


class IdsTopKOffByOne(HookedReference):
    """ids_top_k_off_by_one: the candidate cut keeps the first top_k + 1 tokens (a ``<=`` for ``<``).
    Trigger: a sampled row with top_k > 0."""

    def sample(self, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        k = torch.where(info.top_k > 0, info.top_k + 1, info.top_k)
        return sample_ids(logits, dataclasses.replace(info, top_k=k, max_top_k=info.max_top_k + 1))


class IdsTemperatureIgnored(HookedReference):
    """ids_temperature_ignored: the kernel adds Gumbel noise to the raw logits (temperature 1 for every sampled
    row). Trigger: a sampled row with temperature != 1."""

    def sample(self, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        t = torch.where(info.temperature > 0, torch.ones_like(info.temperature), info.temperature)
        return sample_ids(logits, dataclasses.replace(info, temperature=t))


class IdsNonFiniteUnflagged(HookedReference):
    """ids_nonfinite_unflagged: rows with NaN/inf logits return an id (the argmax of garbage) instead of -1, so the
    engine's non-finite guard never fires on the ids path. Trigger: a NaN logit."""

    def sample(self, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        return sample_ids(torch.nan_to_num(logits, nan=0.0), info)


class IdsGreedyArgmaxPlusOne(HookedReference):
    """ids_greedy_argmax_plus_one: the greedy row's winning key is unpacked one index too far (argmax + 1, wrapping
    at the vocabulary), so every greedy id is a neighbour of the argmax. Trigger: any greedy row; the suite's
    ``test_greedy_ids_match_general`` must fail it on its own."""

    def sample(self, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        ids = sample_ids(logits, info)
        off = torch.where(ids < 0, ids, (ids + 1) % logits.shape[1])
        return torch.where(info.temperature > 0, ids, off)


class IdsTemperatureReciprocalInPlace(HookedReference):
    """ids_temperature_reciprocal_in_place: the kernel wants 1 / temperature and computes it in the runtime's
    buffer (``info.temperature.reciprocal_()``), then samples with the reciprocal of that: its own step is right,
    but the buffer now holds 1 / T (inf for a greedy row). The runtime rewrites a step's sampling rows only when
    they change (``lowlat.runtime.sampling_inputs``), so the edit stays for the next step with the same rows: a
    kernel that reads temperature per row then sees inf (a greedy row sampled uniformly) or 1 / T, where one that
    picks the greedy variant on the host is spared. Trigger: any call; only an input check sees it."""

    def sample(self, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        inv = info.temperature.reciprocal_()
        return sample_ids(logits, dataclasses.replace(info, temperature=inv.reciprocal()))
