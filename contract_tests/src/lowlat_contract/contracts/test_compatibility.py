"""Compatibility: the guard accepts the declared configuration and names each violated requirement; core
refuses the plugin when its declared core range excludes the running core.

Violations are built from the spec itself: a dtype it does not list, a TP size and a page size outside its
sets, machines none of its platforms match, a required feature turned off or a refused one on, a model field
outside the accepted values, another architecture. Each must fail the guard on exactly that requirement, with
a reason, and an explicit request must raise UnsupportedConfiguration naming it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import pytest

PROMISE = ("The guard accepts the declared configuration and rejects each violated requirement with a reason; "
           "core refuses a plugin whose core range excludes it.")
pytestmark = pytest.mark.lowlat_contract("compatibility", PROMISE)

MACHINES = (  # (kind, name, capability, gfx arch, triton interpreter): machines to try against the platforms
    ("cpu", "cpu", None, None, False),
    ("cpu", "cpu", None, None, True),
    ("cuda", "simulated sm70", (7, 0), None, False),
    ("cuda", "simulated sm90", (9, 0), None, False),
    ("rocm", "simulated gfx90a", None, "gfx90a", False),
    ("rocm", "simulated gfx942", None, "gfx942", False),
)


def _machine(kind: str, name: str, cap: Any, gfx: Any, interp: bool) -> Any:
    from lowlat.platform import Platform

    return Platform(kind, name, cap, gfx, 0 if kind == "cpu" else 1, interp, None)


def _platform_ok(spec: Any, platform: Any) -> bool:
    from lowlat.runtime.plugin_host import evaluate

    trace = evaluate("probe", spec, platform)
    return next(r for r in trace.results if r.requirement == "platform").status == "pass"


def _base(case: Any) -> tuple[Any, Any, Any]:
    """A (platform, engine, model) the spec accepts: this machine if declared, else a simulated declared one."""
    from lowlat.loader import resolve_model
    from lowlat.platform import detect_platform

    spec = case.spec
    platform = detect_platform(case.device)
    if not _platform_ok(spec, platform):
        platform = next(p for p in (_machine(*m) for m in MACHINES) if _platform_ok(spec, p))
    req = spec.requirements.features_required
    engine = case.engine_config(cuda_graph="cuda_graph" in req, speculative="speculative" in req)
    return platform, engine, resolve_model(case.model)


def _violations(case: Any) -> list[tuple[str, str, Any, Any, Any]]:
    """(requirement, what was violated, platform, engine, model) for every requirement the spec lets us break."""
    from lowlat.config import DTYPES, ConfigError
    from lowlat.loader import get_preset

    from lowlat_contract.cases import TINY_PRESETS

    spec, req = case.spec, case.spec.requirements
    platform, engine, model = _base(case)
    out = []
    for d in sorted(set(DTYPES) - set(req.dtypes))[:1]:
        out.append(("dtype", f"dtype {d}", platform, dataclasses.replace(engine, dtype=d), model))
    for field, allowed in (("tp_size", req.tp_sizes), ("page_size", req.page_sizes)):
        if allowed is not None:
            value = next(v for v in range(1, max(allowed) + 2) if v not in allowed)
            out.append((field, f"{field} {value}", platform, dataclasses.replace(engine, **{field: value}), model))
    for m in MACHINES:
        p = _machine(*m)
        if not _platform_ok(spec, p):
            out.append(("platform", f"machine {p.describe()}", p, engine, model))
    gpu = next((p for p in (_machine(*m) for m in MACHINES) if p.kind != "cpu" and _platform_ok(spec, p)), None)
    for feat in sorted(req.features_required):
        out.append(("features", f"feature {feat} off", platform, dataclasses.replace(engine, **{feat: False}), model))
    for feat in sorted(req.features_refused):
        if feat == "speculative":
            out.append(("features", "feature speculative on", platform,
                        dataclasses.replace(engine, speculative=True), model))
        elif gpu is not None:
            out.append(("features", "feature cuda_graph on", gpu, dataclasses.replace(engine, cuda_graph=True), model))
    for field, allowed in req.model:
        bad = _outside(allowed)
        if bad is not None:
            try:
                out.append((f"model.{field}", f"model {field}={bad}", platform, engine,
                            dataclasses.replace(model, **{field: bad})))
            except ConfigError:
                pass  # the value makes no valid model: nothing to check
    other = next(a for a in TINY_PRESETS if a != spec.architecture)
    out.append(("architecture", f"a {other} model", platform, engine, get_preset(TINY_PRESETS[other])))
    return out


def _outside(allowed: tuple[Any, ...]) -> Any:
    if all(isinstance(v, bool) for v in allowed):
        return next((b for b in (True, False) if b not in allowed), None)
    if all(isinstance(v, int) for v in allowed):
        return max(allowed) + 1
    return None


def test_guard_accepts_the_declared_configuration(case: Any, case_trace: Any) -> None:
    """Every requirement passes for the configuration the suite runs (this machine, the spec's dtype)."""
    assert case_trace.passed, f"the guard refuses the configuration the spec declares:\n{case_trace.format()}"


def test_guard_names_each_violated_requirement(case: Any) -> None:
    """Each single violation fails the guard on exactly that requirement, with a reason, and an explicit request
    for the plugin raises UnsupportedConfiguration that names it."""
    from lowlat.plugin import UnsupportedConfiguration
    from lowlat.runtime.plugin_host import discover, evaluate, select_plugin

    platform, engine, model = _base(case)
    base = evaluate(case.plugin, case.spec, platform, engine, model)
    if base.failures and all(r.requirement.startswith("model.") for r in base.failures):
        pytest.skip(f"{case.model} fails the spec's model requirements: {base.summary()}")
    assert base.passed, f"the spec refuses its own declared configuration:\n{base.format()}"
    registry = discover(allowlist=[case.plugin])
    problems = []
    for requirement, what, p, e, m in _violations(case):
        trace = evaluate(case.plugin, case.spec, p, e, m)
        failed = {r.requirement: r.reason for r in trace.failures}
        if set(failed) != {requirement} or not failed[requirement].strip():
            problems.append(f"{what}: expected the guard to fail on {requirement!r} alone, got {failed or 'a pass'}")
            continue
        if requirement == "architecture":
            continue  # the registry answers that one with the spec lookup
        with pytest.raises(UnsupportedConfiguration) as err:
            select_plugin(registry, case.plugin, p, e, m)
        if requirement not in str(err.value):
            problems.append(f"{what}: UnsupportedConfiguration does not name {requirement!r}: {err.value}")
    assert not problems, "\n".join(problems)


def test_declares_a_core_range(case: Any) -> None:
    """The plugin's distribution declares which cores it supports (Requires-Dist: lowlat>=X,<Y)."""
    from lowlat.runtime.plugin_host import discover

    info = discover(allowlist=[case.plugin]).get(case.plugin)
    assert info.core_range, (f"{info.distribution} {info.version} declares no core range; add a dependency such as "
                             f"'lowlat>=0.3,<0.4' to its pyproject.toml (docs/contract.md)")


@pytest.mark.parametrize("side", ["below", "above"])
def test_core_refuses_an_excluding_range(case: Any, side: str, tmp_path: Any, monkeypatch: Any) -> None:
    """A copy of the plugin's entry point whose distribution requires a core below (or above) the running one
    is refused with IncompatibleCoreVersion naming both versions."""
    from importlib import metadata

    from lowlat.plugin import ENTRY_POINT_GROUP, IncompatibleCoreVersion
    from lowlat.runtime.plugin_host import discover
    from lowlat.runtime.plugin_host.discovery import core_version

    ep = next(ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == case.plugin)
    core = core_version()
    excluding = f"<{core}" if side == "below" else f">{core}"
    name = f"{case.plugin}_contract_copy_{side}"
    dist = f"lowlat_contract_copy_{side}"
    version = ep.dist.version if ep.dist else "0"
    info = tmp_path / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
                                   f"Requires-Dist: lowlat{excluding}\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{name} = {ep.value}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    registry = discover(allowlist=[name])
    with pytest.raises(IncompatibleCoreVersion) as err:
        registry.get(name)
    msg = str(err.value)
    assert core in msg and excluding in msg, f"the refusal should name lowlat {core} and lowlat{excluding}: {msg}"
