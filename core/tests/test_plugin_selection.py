"""Selecting a plugin: none, auto and explicit names; explicit requests never fall back silently."""

from __future__ import annotations

import pytest
from lowlat.config import EngineConfig
from lowlat.loader.presets import get_preset
from lowlat.platform import Platform
from lowlat.plugin import PluginLoadError, UnsupportedConfiguration
from lowlat.runtime.plugin_host import discover, select_plugin
from plugin_dists import GOOD_SPEC, activate, make_plugin_dist

CPU = Platform("cpu", "cpu")


@pytest.fixture
def registry(tmp_path, monkeypatch):
    site = tmp_path / "site"
    activate(site, monkeypatch)
    make_plugin_dist(site, "good", GOOD_SPEC)
    make_plugin_dist(site, "boom", "raise ImportError('x')\n")
    return discover(["good", "boom"])


def test_none_selects_nothing(registry):
    assert select_plugin(registry, "none", CPU, EngineConfig(), get_preset("tiny-llama")) is None


def test_auto_picks_first_passing_and_says_why(registry):
    sel = select_plugin(registry, "auto", CPU, EngineConfig(dtype="float32"), get_preset("tiny-llama"))
    assert sel is not None and sel.plugin.name == "good" and "auto" in sel.reason


def test_auto_returns_none_when_no_guard_passes(registry):
    assert select_plugin(registry, "auto", CPU, EngineConfig(dtype="bfloat16"), get_preset("tiny-llama")) is None


def test_explicit_failing_guard_raises_with_trace(registry):
    with pytest.raises(UnsupportedConfiguration, match="dtype: needs dtype float32") as e:
        select_plugin(registry, "good", CPU, EngineConfig(dtype="bfloat16"), get_preset("tiny-llama"))
    assert e.value.trace is not None and not e.value.trace.passed


def test_explicit_unserved_architecture_raises(registry):
    with pytest.raises(UnsupportedConfiguration, match="does not serve Qwen3ForCausalLM"):
        select_plugin(registry, "good", CPU, EngineConfig(dtype="float32"), get_preset("tiny-qwen3"))


def test_explicit_broken_raises(registry):
    with pytest.raises(PluginLoadError, match="boom"):
        select_plugin(registry, "boom", CPU, EngineConfig(dtype="float32"), get_preset("tiny-llama"))
