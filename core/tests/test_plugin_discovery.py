"""Discovery against real dist-info metadata in a temporary site directory."""

from __future__ import annotations

import logging

import pytest
from lowlat.plugin import IncompatibleCoreVersion, PluginLoadError, PluginNotFound
from lowlat.runtime.plugin_host import discover
from plugin_dists import GOOD_SPEC, activate, make_plugin_dist

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def site(tmp_path, monkeypatch):
    s = tmp_path / "site"
    s.mkdir()
    activate(s, monkeypatch)
    return s


def test_good_plugin_is_discovered_with_its_distribution(site):
    make_plugin_dist(site, "good", GOOD_SPEC, version="2.3")
    reg = discover(["good"])
    info = reg.get("good")
    assert (info.distribution, info.version, info.status) == ("lowlat-test-good", "2.3", "ok")
    assert info.core_range == "<0.4,>=0.3"
    assert [s.architecture for s in info.specs] == ["LlamaForCausalLM"]


def test_broken_import_is_isolated_and_reported(site):
    make_plugin_dist(site, "good", GOOD_SPEC)
    make_plugin_dist(site, "boom", "raise ImportError('libfoo.so missing')\n", version="0.9")
    reg = discover(["good", "boom"])
    assert reg.plugins["good"].status == "ok"
    boom = reg.plugins["boom"]
    assert boom.status == "broken" and boom.version == "0.9" and boom.distribution == "lowlat-test-boom"
    assert "ImportError: libfoo.so missing" in boom.error and "Traceback" in boom.traceback
    with pytest.raises(PluginLoadError, match="boom.*lowlat-test-boom 0.9.*libfoo.so missing"):
        reg.get("boom")


def test_allowlist_unknown_name_is_an_error_naming_what_was_found(site, monkeypatch):
    make_plugin_dist(site, "good", GOOD_SPEC)
    monkeypatch.setenv("LOWLAT_PLUGINS", "good,nosuch")
    with pytest.raises(PluginNotFound, match="nosuch.*found:.*good"):
        discover()


def test_allowlist_env_limits_what_loads(site, monkeypatch):
    make_plugin_dist(site, "good", GOOD_SPEC)
    make_plugin_dist(site, "boom", "raise ImportError('x')\n")
    monkeypatch.setenv("LOWLAT_PLUGINS", "good")
    assert list(discover().plugins) == ["good"]


def test_missing_plugin_raises_with_install_hint(site):
    reg = discover([])
    with pytest.raises(PluginNotFound, match=r"no plugin named 'nvidia_mega'.*pip install 'lowlat\[nvidia-mega\]'"):
        reg.get("nvidia_mega")
    with pytest.raises(PluginNotFound, match="'foo'.*install the vendor distribution that provides it") as e:
        reg.get("foo")
    assert "lowlat[foo]" not in str(e.value), "no extra named foo exists"


def test_misspelled_plugin_gets_a_did_you_mean(site):
    make_plugin_dist(site, "good_one", GOOD_SPEC)
    with pytest.raises(PluginNotFound, match="no plugin named 'good-one'.*did you mean 'good_one'"):
        discover().get("good-one")


def test_auto_warns_once_about_broken_plugin_and_does_not_raise(site, caplog):
    make_plugin_dist(site, "good", GOOD_SPEC)
    make_plugin_dist(site, "boom", "raise ImportError('x')\n")
    reg = discover(["good", "boom"])
    with caplog.at_level(logging.WARNING, logger="lowlat.plugin"):
        assert [p.name for p in reg.usable()] == ["good"]
        assert [p.name for p in reg.usable()] == ["good"]
    assert sum("boom" in r.getMessage() for r in caplog.records) == 1


def test_core_range_excluding_running_core_is_refused_with_remedy(site):
    make_plugin_dist(site, "old", GOOD_SPEC, dist="lowlat-old", version="0.0.5", requires=("lowlat<0.1.0.dev0",))
    make_plugin_dist(site, "future", GOOD_SPEC, dist="lowlat-future", version="3.0", requires=("lowlat>=0.5",))
    reg = discover(["old", "future"])
    old, future = reg.plugins["old"], reg.plugins["future"]
    assert old.status == future.status == "incompatible"
    with pytest.raises(IncompatibleCoreVersion, match=r"lowlat-old 0.0.5.*requires lowlat<0.1.0.dev0.*lowlat 0.3"):
        reg.get("old")
    assert "install a newer lowlat-old" in old.error
    assert "pip install 'lowlat>=0.5'" in future.error
    assert reg.plugins["old"].module is None  # refused before import


def test_invalid_hookimpl_is_rejected_by_pluggy(site):
    src = "from lowlat.plugin import hookimpl\n@hookimpl\ndef lowlat_model_specs(engine):\n    return []\n"
    make_plugin_dist(site, "badhook", src)
    info = discover(["badhook"]).plugins["badhook"]
    assert info.status == "broken"
    assert "PluginValidationError" in info.error and "engine" in info.error


def test_unknown_hook_name_is_rejected(site):
    src = "from lowlat.plugin import hookimpl\n@hookimpl\ndef lowlat_model_spec():\n    return []\n"
    make_plugin_dist(site, "typo", src)
    info = discover(["typo"]).plugins["typo"]
    assert info.status == "broken"


SPEC_TEMPLATE = """
from lowlat.plugin import hookimpl

@hookimpl
def lowlat_model_specs():
    return [%s]
"""
BASE = ("dict(architecture='LlamaForCausalLM', build='m:build', "
        "coverage=dict(modes=['DECODE'], max_tokens=8), "
        "requirements=dict(platforms=[dict(kind='cpu')], dtypes=['float32'])%s)")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (", colour='red'", "unknown field.*colour"),
        ("", None),
    ],
)
def test_spec_mapping_unknown_field(site, extra, message):
    make_plugin_dist(site, "mapping", SPEC_TEMPLATE % (BASE % extra))
    info = discover(["mapping"]).plugins["mapping"]
    if message is None:
        assert info.status == "ok"
    else:
        assert info.status == "broken" and "mapping" in info.error
        assert __import__("re").search(message, info.error)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (BASE.replace("modes=['DECODE']", "modes=[]") % "", "coverage.modes is empty"),
        (BASE.replace("kind='cpu'", "kind='tpu'") % "", "platform kind 'tpu' is unknown"),
        (BASE.replace("'DECODE'", "'DECODING'") % "", "coverage.modes: unknown forward mode 'DECODING'"),
        (BASE.replace("dtypes=['float32']", "dtypes=['float32'], gpus=2") % "", "requirements has unknown field.*gpus"),
        (BASE.replace("architecture='LlamaForCausalLM'", "architecture='GPT2'") % "", "architecture 'GPT2'"),
        (BASE.replace("build='m:build'", "build='m.build'") % "", "build must be an import path"),
    ],
)
def test_malformed_spec_names_plugin_and_field(site, spec, message):
    make_plugin_dist(site, "malformed", SPEC_TEMPLATE % spec)
    info = discover(["malformed"]).plugins["malformed"]
    assert info.status == "broken"
    assert "invalid spec from plugin 'malformed'" in info.error
    assert __import__("re").search(message, info.error), info.error


def test_real_vendor_plugins_are_discovered():
    reg = discover()
    for name, dist in (("nvidia_mega", "lowlat-nvidia-mega"), ("amd_mono", "lowlat-amd-mono")):
        info = reg.get(name)
        assert info.distribution == dist
        assert {s.architecture for s in info.specs} == {
            "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}
