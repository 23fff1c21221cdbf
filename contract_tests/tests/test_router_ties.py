"""Router near-ties excuse one greedy divergence in a low-precision MoE run, and nothing else (router_ties.py)."""

from __future__ import annotations

import torch
from lowlat_contract.cases import TOLERANCES
from lowlat_contract.harness import GreedyRun, compare_greedy
from lowlat_contract.router_ties import near_tie_rows

V = 16


def test_near_tie_rows_are_gaps_of_at_most_four_ulps_at_the_top_k_boundary() -> None:
    lg = torch.tensor([[1.3125, 1.3125, 1.3047, 0.5],    # 2nd and 3rd are 1 bf16 ulp apart (0.0078 at 1.3)
                       [1.3125, 1.3125, 1.28125, 0.5],   # 4 ulps: the bound
                       [1.3125, 1.3125, 1.2734375, 0.5],  # 5 ulps: no tie
                       [2.0, 1.0, 1.0, 0.0],             # exact tie at the boundary
                       [1.5, -0.0371, -0.0410, -1.0],    # 0.0039 apart: 16 ulps at 0.04, half an ulp at 1.5
                       [0.05, -0.0371, -0.0410, 0.0]], dtype=torch.bfloat16)  # 0.037 apart, 150 ulps at 0.05
    assert near_tie_rows(lg, top_k=2) == [0, 1, 3, 4]
    assert near_tie_rows(lg.float(), top_k=2) == [], "float32 routers are not excused"
    assert near_tie_rows(lg[:, :2], top_k=2) == [], "no (k+1)-th expert, no tie"


def _run(tokens: list[list[int]], paths: list[str], ties: dict[int, list[int]] | None = None) -> GreedyRun:
    steps = len(tokens[0])
    logits = []
    for s in range(steps):
        row = torch.zeros(len(tokens), V)
        for i, t in enumerate(tokens):
            row[i, t[s]] = 5.0  # the picked token leads by 5: far beyond any tolerance
        logits.append(row)
    return GreedyRun(tokens, logits, paths, ties or {})


PATHS = ["general", "plugin", "general", "plugin"]


def test_one_divergence_after_a_router_tie_is_excused_in_bf16_only() -> None:
    want = _run([[1, 2, 3, 4], [5, 6, 7, 8]], PATHS, {1: [2]})
    got = _run([[1, 2, 3, 4], [5, 6, 9, 9]], PATHS)
    assert compare_greedy(got, want, TOLERANCES["bfloat16"]) == []
    assert compare_greedy(got, want, TOLERANCES["float32"]), "float32 gets no router excuse"


def test_divergences_without_a_preceding_tie_or_a_second_one_fail() -> None:
    bf16 = TOLERANCES["bfloat16"]
    want = _run([[1, 2, 3, 4], [5, 6, 7, 8]], PATHS, {1: [3]})
    got = _run([[1, 2, 3, 4], [5, 6, 9, 9]], PATHS)
    assert "no MoE router near-tie" in compare_greedy(got, want, bf16)[0], "the tie comes after the divergence"
    want = _run([[1, 2, 3, 4], [5, 6, 7, 8]], PATHS, {1: [0]})
    assert compare_greedy(got, want, bf16), "a tie in the prefill, before any plugin step, cannot have flipped"
    want = _run([[1, 2, 3, 4], [5, 6, 7, 8]], PATHS, {0: [1], 1: [1]})
    both = _run([[1, 9, 9, 9], [5, 6, 9, 9]], PATHS)
    problems = compare_greedy(both, want, bf16)
    assert len(problems) == 1 and "already excused" in problems[0]
