"""The two-process TP check in both of its modes, on the reference plugin (gloo on CPU).

"tp" shards the model over the ranks like an Engine does; "replicas" is what plugins limited to TP size 1 get:
whole models per rank and a Dispatcher over the two-process group. In both, rank 1's refusal on the third step
must move both ranks to the general path, the VERIFY step after it must take the plugin's again, and the ranks'
logits must agree. A third rank (the 4-rank check the contract runs for specs allowing TP 4) agrees too.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from lowlat_contract.fixtures import install_fixture_plugins


@pytest.fixture(scope="module")
def reference_case(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from lowlat_contract.cases import build_cases

    site = tmp_path_factory.mktemp("site")
    install_fixture_plugins(site, ["reference"])
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(site))
    importlib.invalidate_caches()
    try:
        yield build_cases("reference", ["LlamaForCausalLM"], None, "cpu", "float32")[0]
    finally:
        mp.undo()


@pytest.mark.parametrize("mode", ["tp", "replicas"])
def test_ranks_agree_when_one_refuses(reference_case, mode: str) -> None:  # type: ignore[no-untyped-def]
    from lowlat_contract.tp_check import STEPS, run_tp_check

    reports = run_tp_check(reference_case, "cpu", mode)
    assert [r["error"] for r in reports] == [None, None], reports
    rank0, rank1 = reports[0]["steps"], reports[1]["steps"]
    assert [s["name"] for s in rank0] == list(STEPS)
    want = [("plugin", "plugin")] * 2 + [("general",) * 2] + [("plugin", "plugin")]  # the last: VERIFY 2 x 2
    assert [(a["path"], b["path"]) for a, b in zip(rank0, rank1)] == want
    assert (rank0[2]["local"], rank1[2]["local"]) == (True, False)  # without agreement they would diverge
    for a, b in zip(rank0, rank1):
        assert torch.equal(a["logits"], b["logits"])


def test_four_replicas_agree(reference_case) -> None:  # type: ignore[no-untyped-def]
    from lowlat_contract.tp_check import run_tp_check

    reports = run_tp_check(reference_case, "cpu", "replicas", world=4)
    assert [r["error"] for r in reports] == [None] * 4, reports
    paths = [[s["path"] for s in r["steps"]] for r in reports]
    assert all(p == paths[0] for p in paths) and paths[0][2] == "general", paths
