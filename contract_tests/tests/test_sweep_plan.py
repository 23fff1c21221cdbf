"""The sweep plans (sweep.py) hit every boundary the issue lists, in both modes."""

from __future__ import annotations

import pytest
from lowlat_contract.sweep import contexts, plan, setting_plan


@pytest.mark.parametrize("mode", ["full", "covering"])
@pytest.mark.parametrize("m,page", [(8, 16), (16, 1), (16, 64), (3, 16)])
def test_every_boundary_is_hit(mode: str, m: int, page: int) -> None:
    steps = plan(m, 16, True, True, page, "cpu", mode, max_batch=m + 1)
    checked = [s for s in steps if s.expect == "plugin"]
    decode = {s.batch_size for s in checked if s.mode == "DECODE"}
    assert {1, m} <= decode and all(s.num_tokens <= m for s in checked)
    assert [s.batch_size for s in steps if s.expect == "general"] == [m + 1], "one step past coverage"
    verify = {(s.batch_size, s.tokens_per_req) for s in checked if s.mode == "VERIFY"}
    if m >= 2:
        assert {(1, 2), (1, min(m, 16))} <= verify
    if m >= 4:
        assert any(b == 2 for b, _ in verify) and any(b == m // 2 for b, _ in verify)
    for kind in ("DECODE", "VERIFY") if m >= 2 else ("DECODE",):
        reached = {c for s in checked if s.mode == kind for c in s.contexts}
        assert set(contexts(page, "cpu")) <= reached, f"{kind} misses contexts {set(contexts(page, 'cpu')) - reached}"
    assert {0, 1, page - 1, page, page + 1, 63, 64, 65, 255, 256, 1000} <= set(contexts(page, "cpu"))


def test_full_mode_runs_every_batch_size_and_verify_length() -> None:
    steps = plan(8, 16, True, True, 16, "cpu", "full", max_batch=9)
    assert {s.batch_size for s in steps if s.mode == "DECODE" and s.expect == "plugin"} == set(range(1, 9))
    assert {s.tokens_per_req for s in steps if s.mode == "VERIFY"} == set(range(2, 9))
    assert max(contexts(16, "cuda")) == 4096


def test_other_settings_straddle_their_page_boundary() -> None:
    steps = setting_plan(8, 16, True, True, 64, "cpu", "covering")
    assert {c for s in steps for c in s.contexts} >= {63, 64, 65}
    assert {s.mode for s in steps} == {"DECODE", "VERIFY"}
