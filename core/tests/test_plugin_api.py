"""Plugin API 3: ``lowlat.plugin`` is the whole vendor API and nothing host-side; API 2 paths warn and still work."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import lowlat.plugin as api
import pytest

HOST_SIDE = ("discover", "PluginRegistry", "PluginInfo", "select_plugin", "Selection", "evaluate", "GuardTrace",
             "RequirementResult", "PluginHost", "Dispatcher")
VENDOR_NEEDS = ("ModelSpec", "Requirements", "Coverage", "PlatformRequirement", "hookimpl", "PluginBinding",
                "PluginForward", "ReferenceStep", "STAGES", "bind_params", "LayerParams", "ModelParams",
                "ForwardBatch", "ForwardMode", "KVPool", "ModelConfig", "EngineConfig", "rope_tables",
                "PluginBuildError", "PluginStepError", "UnsupportedConfiguration", "KVPoolNotReady",
                "LowlatPluginError", "SpecError", "PLUGIN_API_VERSION", "ENTRY_POINT_GROUP")


def test_api_version_is_3():
    assert api.PLUGIN_API_VERSION == 4


def test_every_vendor_name_is_importable_from_lowlat_plugin():
    assert set(VENDOR_NEEDS) <= set(api.__all__)
    for name in api.__all__:
        assert getattr(api, name) is not None, name


def test_nothing_host_side_is_in_the_vendor_api():
    assert not set(HOST_SIDE) & set(api.__all__)


def test_importing_the_vendor_api_loads_no_runtime_and_no_models():
    code = ("import sys, lowlat.plugin; "
            "print(sorted(m for m in sys.modules if m.startswith(("
            "'lowlat.runtime', 'lowlat.models', 'lowlat.serve'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"import lowlat.plugin loaded {out}"


@pytest.mark.parametrize("name", ["discover", "select_plugin", "evaluate", "PluginRegistry", "Selection"])
def test_api2_host_names_warn_and_name_the_new_home(name):
    host = importlib.import_module("lowlat.runtime.plugin_host")
    with pytest.warns(DeprecationWarning, match="lowlat.runtime.plugin_host"):
        got = getattr(api, name)
    assert got is getattr(host, name)


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        api.no_such_name  # noqa: B018


@pytest.mark.parametrize("old,new,name", [
    ("lowlat.runtime.forward_batch", "lowlat.forward_batch", "ForwardBatch"),
    ("lowlat.runtime.kv_cache", "lowlat.kv_cache", "KVPool"),
    ("lowlat.plugin.errors", "lowlat.errors", "PluginBuildError"),
    ("lowlat.plugin.discovery", "lowlat.runtime.plugin_host.discovery", "load_callable"),
    ("lowlat.plugin.dispatch", "lowlat.runtime.dispatch", "Dispatcher"),
])
def test_api2_module_paths_warn_and_are_the_new_modules(old, new, name):
    code = (f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"try:\n    import {old}\nexcept DeprecationWarning as w:\n    print('warned:', w)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("warned:") and new in out, out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)
