"""The guard: evaluate a spec's requirements before any weight loads, and keep a trace.

One predicate serves the engine (explicit plugins raise with the trace, ``auto`` picks the first
spec that passes), ``lowlat plugins --explain`` (prints the trace) and the contract suite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from lowlat.config import EngineConfig, ModelConfig
from lowlat.platform import Platform, interpreter_problem
from lowlat.plugin.spec import ModelSpec, PlatformRequirement

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass(frozen=True)
class RequirementResult:
    """One requirement's outcome: ``status`` is pass, fail or skip (context not given)."""

    requirement: str
    status: str
    reason: str


@dataclass(frozen=True)
class GuardTrace:
    """Every requirement of one spec evaluated against one context."""

    plugin: str
    architecture: str
    results: tuple[RequirementResult, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        """True when no requirement failed (skipped ones do not fail)."""
        return all(r.status != FAIL for r in self.results)

    @property
    def failures(self) -> tuple[RequirementResult, ...]:
        return tuple(r for r in self.results if r.status == FAIL)

    def summary(self) -> str:
        """The failing reasons joined, or "ok"."""
        return "; ".join(f"{r.requirement}: {r.reason}" for r in self.failures) or "ok"

    def format(self) -> str:
        """A multi-line trace, one requirement per line."""
        lines = [f"{self.plugin} / {self.architecture}: {'PASS' if self.passed else 'FAIL'}"]
        lines += [f"  [{r.status:4}] {r.requirement}: {r.reason}" for r in self.results]
        return "\n".join(lines)


def evaluate(
    plugin: str,
    spec: ModelSpec,
    platform: Platform,
    engine: EngineConfig | None = None,
    model: ModelConfig | None = None,
    architecture: str | None = None,
) -> GuardTrace:
    """Evaluate every requirement of ``spec``, and its ``check_environment`` where it names one.

    Args:
        plugin: the plugin's name, for the trace.
        spec: the spec to check.
        platform: the machine (``lowlat.platform.detect_platform()`` or one built by a test).
        engine: the engine configuration; requirements on it are skipped when None.
        model: the model configuration; requirements on it are skipped when None.
        architecture: without ``model``, the architecture asked about (``lowlat plugins --explain ARCH``).
    Returns:
        A GuardTrace; it never raises for a failing requirement.
    """
    req = spec.requirements
    results = [_platform(req.platforms, platform)]
    libraries = [_library(name, rng) for name, rng in req.libraries]
    results += libraries
    if spec.check_environment is not None:
        ok = all(r.status == PASS for r in libraries)
        results.append(_environment(plugin, spec.check_environment, libraries_ok=ok))
    arch = model.architecture if model is not None else architecture
    if arch is None:
        results.append(RequirementResult("architecture", SKIP, "no model given"))
    elif arch != spec.architecture:
        results.append(RequirementResult("architecture", FAIL, f"spec serves {spec.architecture}; the model is {arch}"))
    else:
        results.append(RequirementResult("architecture", PASS, arch))
    for name, allowed in req.model:
        if model is None:
            results.append(RequirementResult(f"model.{name}", SKIP, "no model given"))
            continue
        value = getattr(model, name)
        ok = value in allowed
        results.append(RequirementResult(
            f"model.{name}", PASS if ok else FAIL,
            f"{value}" if ok else f"needs one of {list(allowed)}; the model has {value}"))
    results += _engine(spec, platform, engine, model)
    return GuardTrace(plugin, spec.architecture, tuple(results))


def _platform(options: tuple[PlatformRequirement, ...], platform: Platform) -> RequirementResult:
    wanted = " or ".join(o.describe() for o in options)
    for o in options:
        if o.kind != platform.kind:
            continue
        if o.kind == "cuda" and o.min_capability and (platform.capability or (0, 0)) < o.min_capability:
            continue
        if o.kind == "rocm" and o.archs and platform.gfx_arch not in o.archs:
            continue
        if o.kind == "cpu" and o.triton_interpreter and not platform.triton_interpreter:
            continue
        if o.kind == "cpu" and o.triton_interpreter:
            problem = interpreter_problem(platform.triton_version, platform.numpy_version)
            if problem:
                return RequirementResult("platform", FAIL, problem)
        return RequirementResult("platform", PASS, f"{platform.describe()} matches {o.describe()}")
    reason = f"needs platform {wanted}; this machine: {platform.describe()}"
    if platform.kind == "cpu" and not platform.triton_interpreter and any(
            o.kind == "cpu" and o.triton_interpreter for o in options):
        reason += (" (Triton interpreter off): set TRITON_INTERPRET=1 in the environment before Python starts, "
                   "i.e. prefix the command, as in `TRITON_INTERPRET=1 lowlat run ...` or `TRITON_INTERPRET=1 lowlat "
                   "serve ...` (setting it later has no effect)")
    return RequirementResult("platform", FAIL, reason)


def _library(name: str, rng: str) -> RequirementResult:
    label = f"library {name}{rng}"
    try:
        spec = SpecifierSet(rng)
    except InvalidSpecifier:
        return RequirementResult(label, FAIL, f"the spec's range {rng!r} is not a valid version specifier")
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        return RequirementResult(label, FAIL, f"{name} is not installed; pip install '{name}{rng}'")
    if spec.contains(Version(have), prereleases=True):
        return RequirementResult(label, PASS, f"{name} {have}")
    return RequirementResult(label, FAIL, f"{name} {have} is installed; pip install '{name}{rng}'")


def _environment(plugin: str, path: str, *, libraries_ok: bool) -> RequirementResult:
    """Run the spec's ``check_environment`` (after its libraries are known to be installed: it may import them).

    Any exception fails the requirement with its message, a missing or broken module included: the guard never
    raises for a plugin's own check.
    """
    from lowlat.runtime.plugin_host.discovery import load_callable

    if not libraries_ok:
        return RequirementResult("environment", SKIP, "not checked: a required library is missing")
    try:
        load_callable(path, plugin)()
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - a plugin's check must not take the host down
        return RequirementResult("environment", FAIL, f"{type(e).__name__}: {e}")
    return RequirementResult("environment", PASS, f"{path} accepts the environment")


def _engine(
    spec: ModelSpec, platform: Platform, engine: EngineConfig | None, model: ModelConfig | None
) -> list[RequirementResult]:
    req = spec.requirements
    if engine is None:
        return [RequirementResult(n, SKIP, "no engine configuration given") for n in ("dtype", "tp_size", "page_size",
                                                                                      "features")]
    out = []
    fixed = engine.fixed_dtype(cpu=platform.kind == "cpu")
    if model is None and fixed is None:
        out.append(RequirementResult("dtype", SKIP, "dtype auto depends on the model"))
    else:
        dtype = _dtype_name(fixed if model is None else engine.resolved_dtype(model))
        auto = ", what --dtype auto computes in on a CPU" if engine.dtype == "auto" and model is None else ""
        ok = dtype in req.dtypes
        out.append(RequirementResult(
            "dtype", PASS if ok else FAIL, dtype + auto if ok else f"needs dtype {'/'.join(sorted(req.dtypes))}; "
            f"the engine runs {dtype}{auto} (pass --dtype {sorted(req.dtypes)[0]})"))
    for name, allowed in (("tp_size", req.tp_sizes), ("page_size", req.page_sizes)):
        value = getattr(engine, name)
        if allowed is None or value in allowed:
            out.append(RequirementResult(name, PASS, str(value)))
        else:
            out.append(RequirementResult(name, FAIL, f"needs {name} in {sorted(allowed)}; the engine has {value}"))
    active = {"cuda_graph"} if engine.cuda_graph and platform.kind in ("cuda", "rocm") else set()
    if engine.speculative:
        active.add("speculative")
    missing = req.features_required - active
    refused = req.features_refused & active
    if missing or refused:
        why = [f"needs feature {f} on" for f in sorted(missing)] + [f"refuses feature {f}" for f in sorted(refused)]
        out.append(RequirementResult("features", FAIL, "; ".join(why) + f"; active: {sorted(active) or 'none'}"))
    else:
        out.append(RequirementResult("features", PASS, f"active: {sorted(active) or 'none'}"))
    return out


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")
