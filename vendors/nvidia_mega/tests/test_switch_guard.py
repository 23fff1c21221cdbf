"""nvidia_mega's switches are checked by the guard (``ModelSpec.check_environment``), before any weight loads.

A bad ``LOWLAT_MEGA_*`` value fails the guard with build's own message, so ``lowlat plugins`` shows it and
``lowlat run --plugin nvidia_mega`` stops before loading the checkpoint (build still refuses it too: test_forward).
"""

from __future__ import annotations

import os

import pytest
from lowlat.config import EngineConfig
from lowlat.errors import UnsupportedConfiguration
from lowlat.loader.presets import get_preset
from lowlat.platform import Platform
from lowlat.runtime.plugin_host import evaluate
from lowlat.runtime.plugin_host.discovery import discover
from lowlat.runtime.plugin_host.host import PluginHost

CPU_INTERP = Platform("cpu", "cpu", triton_interpreter=True)
ENGINE = EngineConfig(dtype="bfloat16", device="cpu", plugin="nvidia_mega")


def _env_result(arch: str = "LlamaForCausalLM"):
    info = discover().get("nvidia_mega")
    trace = evaluate(info.name, info.spec_for(arch), CPU_INTERP, ENGINE)
    return next(r for r in trace.results if r.requirement == "environment")


def test_every_spec_checks_the_switches_in_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [k for k in os.environ if k.startswith("LOWLAT_MEGA_")]:
        monkeypatch.delenv(var)
    info = discover().get("nvidia_mega")
    assert {s.check_environment for s in info.specs} == {"lowlat_nvidia_mega.build:check_switches"}
    assert _env_result().status == "pass"
    monkeypatch.setenv("LOWLAT_MEGA_MOE_CONFIG", "down_warps=4")  # a good value passes
    assert _env_result("Qwen3MoeForCausalLM").status == "pass"


@pytest.mark.parametrize(("var", "value", "says"), [
    ("LOWLAT_MEGA_MOE_CONFIG", "route_kyes=1", "LOWLAT_MEGA_MOE_CONFIG: 'route_kyes=1' must be FIELD=INT"),
    ("LOWLAT_MEGA_MOE_CONFIG", "route_keys=2", "route_keys is 1 (on) or 0 (off)"),
    ("LOWLAT_MEGA_LM_HEAD_CONFIG", "min_rows=3", "LOWLAT_MEGA_LM_HEAD_CONFIG='min_rows=3'"),
    ("LOWLAT_MEGA_PRENORM", "maybe", "LOWLAT_MEGA_PRENORM='maybe'"),
    ("LOWLAT_MEGA_PRENROM", "1", "LOWLAT_MEGA_PRENROM: did you mean LOWLAT_MEGA_PRENORM"),
    ("LOWLAT_MEGA_MOE_CONFIG", "route_kyes=1", "MoEKernelConfig field (did you mean route_keys?)"),
    ("LOWLAT_MEGA_MOE_CONFIG", "route_min_rows=99999999999999999999", "more than 18 digits"),
    ("LOWLAT_MEGA_MOE_CONFIG", "route_min_rows=1;down_warps=4", "separate items with ',' not ';'"),
    ("LOWLAT_MEGA_PDL", "of", "LOWLAT_MEGA_PDL='of': use 1"),  # a typo of "off" used to leave PDL on
])
def test_a_bad_switch_fails_the_guard_naming_it(monkeypatch: pytest.MonkeyPatch, var: str, value: str,
                                               says: str) -> None:
    monkeypatch.setenv(var, value)
    r = _env_result()
    assert r.status == "fail" and says in r.reason


def test_an_explicit_plugin_stops_before_weights_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWLAT_MEGA_MOE_CONFIG", "route_kyes=1")
    with pytest.raises(UnsupportedConfiguration, match="environment: PluginBuildError: LOWLAT_MEGA_MOE_CONFIG"):
        PluginHost.select(ENGINE, get_preset("tiny-llama"), CPU_INTERP)


def test_an_unknown_name_far_from_every_switch_gets_no_guess(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWLAT_MEGA_FOO", "1")  # the shared prefix alone once made it "close" to LOWLAT_MEGA_PDL
    r = _env_result()
    assert r.status == "fail" and "unknown nvidia_mega switch(es) LOWLAT_MEGA_FOO" in r.reason
    assert "did you mean" not in r.reason and "rename or unset the unknown one(s)" in r.reason
