"""One dispatch path: the Dispatcher is always installed and owns the path state (eager steps and graph shapes)."""

from __future__ import annotations

import pytest
import torch
from lowlat import EngineConfig, ForwardMode
from lowlat.plugin import Coverage
from lowlat.runtime.cuda_graph_runner import GraphKey
from lowlat.runtime.dispatch import GENERAL, PLUGIN, Dispatcher
from lowlat.runtime.model_runner import ModelRunner

V = 8


class FakeBatch:
    def __init__(self, mode: ForwardMode, t: int) -> None:
        self.forward_mode, self.num_tokens, self.num_logit_rows, self.batch_size = mode, t, t, t


class FakePlugin:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def supports(self, batch) -> bool:  # type: ignore[no-untyped-def]
        return True

    def forward(self, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
        self.calls.append("forward")
        return torch.ones(batch.num_tokens, V)

    def prepare_for_capture(self, batch) -> None:  # type: ignore[no-untyped-def]
        self.calls.append("capture")

    def prepare_for_replay(self, batch) -> None:  # type: ignore[no-untyped-def]
        self.calls.append("replay")


def general(batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.zeros(batch.num_tokens, V)


def with_plugin() -> tuple[Dispatcher, FakePlugin]:
    plugin = FakePlugin()
    cov = Coverage(modes=frozenset({ForwardMode.DECODE}), max_tokens=4)
    return Dispatcher(general_forward=general, vocab_size=V, plugin="fake", coverage=cov, plugin_forward=plugin), plugin


def test_without_a_plugin_every_step_is_general():
    d = Dispatcher(general_forward=general, vocab_size=V)
    assert not d.has_plugin
    assert d.choose(FakeBatch(ForwardMode.DECODE, 1)) == GENERAL
    assert d(FakeBatch(ForwardMode.DECODE, 1)).sum() == 0 and d.last_path == GENERAL
    with pytest.raises(ValueError, match="no plugin is installed"):
        d.run(PLUGIN, FakeBatch(ForwardMode.DECODE, 1))


def test_a_plugin_needs_its_coverage_and_forward_together():
    with pytest.raises(ValueError, match="together"):
        Dispatcher(general_forward=general, vocab_size=V, plugin="x")


def test_eager_steps_record_their_path_and_counts():
    d, plugin = with_plugin()
    assert d(FakeBatch(ForwardMode.DECODE, 2)).sum() == 2 * V and d.last_path == PLUGIN
    assert d(FakeBatch(ForwardMode.DECODE, 5)).sum() == 0 and d.last_path == GENERAL  # above max_tokens
    assert d(FakeBatch(ForwardMode.PREFILL, 1)).sum() == 0 and d.last_path == GENERAL
    assert dict(d.stats.steps) == {(PLUGIN, ForwardMode.DECODE): 1, (GENERAL, ForwardMode.DECODE): 1,
                                   (GENERAL, ForwardMode.PREFILL): 1}


def test_graph_capture_asks_for_the_function_of_each_shape_and_replays_report_back():
    d, plugin = with_plugin()
    small, big = GraphKey(ForwardMode.DECODE, 2, 1), GraphKey(ForwardMode.DECODE, 8, 1)
    fn_small = d.function_for(small, FakeBatch(ForwardMode.DECODE, 2))
    fn_big = d.function_for(big, FakeBatch(ForwardMode.DECODE, 8))
    assert d.graph_paths == {small: PLUGIN, big: GENERAL}
    assert plugin.calls == ["capture"]  # prepare_for_capture for the plugin shape only
    assert fn_small(FakeBatch(ForwardMode.DECODE, 2)).sum() == 2 * V
    assert fn_big(FakeBatch(ForwardMode.DECODE, 8)).sum() == 0
    assert not d.stats.steps, "captured runs are not steps"
    d.replayed(small, FakeBatch(ForwardMode.DECODE, 1))
    assert d.last_path == PLUGIN and plugin.calls[-1] == "replay"
    d.replayed(big, FakeBatch(ForwardMode.DECODE, 7))
    assert d.last_path == GENERAL and plugin.calls.count("replay") == 1
    assert dict(d.stats.steps) == {(PLUGIN, ForwardMode.DECODE): 1, (GENERAL, ForwardMode.DECODE): 1}


def test_the_runner_always_holds_a_dispatcher_and_reads_its_path_from_it():
    r = ModelRunner(EngineConfig(model="tiny-llama", device="cpu", dtype="float32", plugin="none",
                                 max_batch_size=2, max_context_len=32))
    try:
        assert isinstance(r.dispatcher, Dispatcher) and not r.dispatcher.has_plugin
        row = r.kv_pool.alloc_req()
        out = r.forward(r.prepare_batch(ForwardMode.PREFILL, [row], [0], [[1, 2, 3]]))
        assert out.shape == (1, r.model_config.vocab_size) and r.last_path == GENERAL
        assert r.dispatcher.stats.steps[(GENERAL, ForwardMode.PREFILL)] == 1
        assert r.forward_fn is r.dispatcher
    finally:
        r.close()
