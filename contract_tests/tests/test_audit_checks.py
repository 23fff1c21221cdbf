"""The outside audit's checkers, each fed an input it must reject and one it must accept: the oracle's
ParamWatch, the process-wide live-tensor count, the attention-score stress and the sweep's top-rows steps."""

from __future__ import annotations

import pytest
import torch
from lowlat_contract.memory import live_tensors, new_bytes
from lowlat_contract.oracle import ParamWatch
from lowlat_contract.stress import scale_attention_scores
from lowlat_contract.sweep import plan

_KEPT: list[torch.Tensor] = []


@pytest.mark.parametrize("exact", [True, False], ids=["bitwise", "chunk-sums"])
def test_param_watch_sees_a_tiny_in_place_edit(exact: bool) -> None:
    m = torch.nn.Linear(64, 64)
    m.register_buffer("table", torch.ones(8))
    w = ParamWatch(m)
    w.exact, w.CHUNK = exact, 1000  # several chunks per tensor in the sum mode
    w.reset()
    assert w.changed() == []
    with torch.no_grad():
        m.weight.mul_(1 + 2 ** -20)
    assert w.changed() == ["weight"]
    w.reset()
    m.table[3] += 1e-3
    assert w.changed() == ["table"]


def test_live_tensors_see_a_module_level_leak() -> None:
    n0, s0 = live_tensors("cpu")
    _KEPT.append(torch.zeros(4096))
    try:
        n1, s1 = live_tensors("cpu", collect=False)
        assert n1 == n0 + 1
        assert new_bytes(s0, s1) == 4096 * 4
    finally:
        _KEPT.clear()
    assert live_tensors("cpu")[0] == n0


def _runner(model: str):  # noqa: ANN202
    from lowlat.config import EngineConfig
    from lowlat.runtime import ModelRunner

    return ModelRunner(EngineConfig(model=model, device="cpu", dtype="float32", plugin="none", cuda_graph=False,
                                    max_batch_size=4, max_context_len=64), show_progress=False)


@pytest.mark.parametrize("model, changed", [("tiny-llama", "qkv_proj"), ("tiny-qwen3", "q_norm")])
def test_scale_attention_scores(model: str, changed: str) -> None:
    r = _runner(model)
    try:
        params = {n: p.detach().clone() for n, p in r.model.named_parameters()}
        names = scale_attention_scores(r.model, r.model_config, 4.0)
        assert names and all(changed in n or "k_norm" in n for n in names)
        c = r.model_config
        qk = (c.num_attention_heads + c.num_key_value_heads) * c.head_dim
        for n, p in r.model.named_parameters():
            if n.endswith("qkv_proj.weight") and changed == "qkv_proj":
                assert torch.equal(p[:qk], params[n][:qk] * 4.0) and torch.equal(p[qk:], params[n][qk:])  # v kept
            elif n not in names:
                assert torch.equal(p, params[n]), n
    finally:
        r.close()


def test_scale_attention_scores_refuses_an_unknown_layout() -> None:
    from lowlat.loader.presets import get_preset

    with pytest.raises(ValueError, match="q/k norms or qkv_proj"):
        scale_attention_scores(torch.nn.Linear(4, 4), get_preset("tiny-llama"), 2.0)


def test_plan_has_top_rows_steps_only_where_rows_exceed_coverage() -> None:
    for mode in ("full", "covering"):
        steps = plan(16, 16, True, True, 16, "cpu", mode, 33)
        top = [s for s in steps if s.high_rows]
        assert top and all(s.expect == "plugin" for s in top), mode
        assert "top rows" in top[0].name
        assert not [s for s in plan(16, 16, True, True, 16, "cpu", mode, 16) if s.high_rows]
