"""ModelSpec: what a plugin serves for one architecture, and what it needs to run.

A plugin's hook returns one ``ModelSpec`` per architecture it serves (or a plain mapping with the same
fields, which is checked key by key). Specs are data: the guard (``lowlat.runtime.plugin_host.guard``) evaluates their
requirements, the dispatcher their coverage, and the runtime imports ``build`` lazily.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from lowlat.config import DTYPES, SUPPORTED_ARCHITECTURES
from lowlat.errors import SpecError
from lowlat.forward_batch import ForwardMode, SamplingInfo

PLATFORM_KINDS = ("cuda", "rocm", "cpu")
FEATURES = ("cuda_graph", "speculative")
TOP_P_SUPPORT = ("none", "with_top_k", "any")


@dataclass(frozen=True)
class PlatformRequirement:
    """One platform a spec runs on; a spec lists several and any one may match.

    Attributes:
        kind: "cuda", "rocm" or "cpu".
        min_capability: CUDA only, the lowest compute capability, e.g. (9, 0).
        archs: ROCm only, the gfx architectures accepted, e.g. ("gfx942", "gfx950").
        triton_interpreter: CPU only, the platform counts only under TRITON_INTERPRET=1.
    """

    kind: str
    min_capability: tuple[int, int] | None = None
    archs: tuple[str, ...] = ()
    triton_interpreter: bool = False

    def __post_init__(self) -> None:
        if self.kind not in PLATFORM_KINDS:
            raise SpecError(f"platform kind {self.kind!r} is unknown; use one of {', '.join(PLATFORM_KINDS)}")
        if self.min_capability is not None and self.kind != "cuda":
            raise SpecError(f"min_capability applies to platform cuda, not {self.kind}")
        if self.archs and self.kind != "rocm":
            raise SpecError(f"archs applies to platform rocm, not {self.kind}")
        if self.triton_interpreter and self.kind != "cpu":
            raise SpecError(f"triton_interpreter applies to platform cpu, not {self.kind}")

    def describe(self) -> str:
        if self.kind == "cuda":
            cap = self.min_capability
            return f"cuda with capability >= {cap[0]}.{cap[1]}" if cap else "cuda"
        if self.kind == "rocm":
            return f"rocm {'/'.join(self.archs)}" if self.archs else "rocm"
        return "cpu under the Triton interpreter (TRITON_INTERPRET=1)" if self.triton_interpreter else "cpu"


@dataclass(frozen=True)
class SamplingCoverage:
    """The steps in which a plugin returns sampled ids instead of logits (plugin API 3; ``ForwardBatch.sampling``).

    Greedy rows are always served. A step is served only when every row of it is:

    Attributes:
        modes: the forward modes it samples in (the runtime asks for ids in DECODE steps today).
        temperature: rows with temperature > 0 (plain softmax sampling) are served.
        max_top_k: rows with ``0 < top_k <= max_top_k`` are served exactly (0: rows using top-k need logits).
        top_p: rows with top_p < 1: "none" (need logits), "with_top_k" (served when the row's top_k is served
            too: the nucleus is then drawn from at most max_top_k tokens), "any".

    Raises:
        SpecError: an unknown mode or top_p value, a negative max_top_k, or filtering without temperature.
    """

    modes: frozenset[ForwardMode] = frozenset({ForwardMode.DECODE})
    temperature: bool = True
    max_top_k: int = 0
    top_p: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.modes, frozenset) or not all(isinstance(m, ForwardMode) for m in self.modes):
            raise SpecError(f"coverage.sampling.modes must be a frozenset of ForwardMode, got {self.modes!r}")
        if not self.modes or ForwardMode.PREFILL in self.modes:
            raise SpecError("coverage.sampling.modes must name DECODE and/or VERIFY")
        if not isinstance(self.temperature, bool):
            raise SpecError(f"coverage.sampling.temperature must be True or False, got {self.temperature!r}")
        if not isinstance(self.max_top_k, int) or isinstance(self.max_top_k, bool):
            raise SpecError(f"coverage.sampling.max_top_k must be an int >= 0, got {self.max_top_k!r}")
        if self.top_p not in TOP_P_SUPPORT:
            raise SpecError(f"coverage.sampling.top_p is {self.top_p!r}; use one of {', '.join(TOP_P_SUPPORT)}")
        if self.max_top_k < 0:
            raise SpecError(f"coverage.sampling.max_top_k must be >= 0, got {self.max_top_k}")
        if not self.temperature and (self.max_top_k or self.top_p != "none"):
            raise SpecError("coverage.sampling serves top-k/top-p only with temperature=True")

    def covers(self, mode: ForwardMode, info: SamplingInfo) -> bool:
        """Whether ids may be asked for a ``mode`` step with these rows (host-side summary only, no device read)."""
        if mode not in self.modes:
            return False
        if info.all_greedy:
            return True
        if not self.temperature or info.max_top_k > self.max_top_k:
            return False
        if info.any_top_p and (self.top_p == "none" or (self.top_p == "with_top_k" and info.top_p_alone)):
            return False
        return True

    def variants(self) -> tuple[str, ...]:
        """The ``SamplingInfo.variant`` values it can serve (a CUDA graph is captured for each)."""
        out = ["greedy"]
        if self.temperature:
            out.append("sample")
        if self.max_top_k or self.top_p != "none":
            out.append("filter")
        return tuple(out)

    def describe(self) -> str:
        parts = ["greedy"] + (["temperature"] if self.temperature else [])
        if self.max_top_k:
            parts.append(f"top_k <= {self.max_top_k}")
        if self.top_p != "none":
            parts.append("top_p" + (" with top_k" if self.top_p == "with_top_k" else ""))
        return f"sampled ids in {','.join(sorted(m.name for m in self.modes))} ({', '.join(parts)})"


@dataclass(frozen=True)
class Coverage:
    """The steps a spec serves: forward modes, and tokens per step T (all requests together).

    ``sampling`` (plugin API 3, optional): the steps in which the plugin returns sampled ids instead of logits.
    """

    modes: frozenset[ForwardMode]
    max_tokens: int
    min_tokens: int = 1
    sampling: SamplingCoverage | None = None

    def __post_init__(self) -> None:
        if not self.modes:
            raise SpecError("coverage.modes is empty: a spec must serve at least one forward mode")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise SpecError(f"coverage needs 1 <= min_tokens <= max_tokens, got {self.min_tokens}..{self.max_tokens}")
        if self.sampling is not None and not isinstance(self.sampling, SamplingCoverage):
            raise SpecError(f"coverage.sampling must be a SamplingCoverage or a mapping of its fields, got "
                            f"{type(self.sampling).__name__}")
        if self.sampling is not None and not self.sampling.modes <= self.modes:
            raise SpecError("coverage.sampling.modes must be among coverage.modes")

    def covers(self, mode: ForwardMode, num_tokens: int) -> bool:
        """Whether a step of ``mode`` with ``num_tokens`` tokens is inside coverage."""
        return mode in self.modes and self.min_tokens <= num_tokens <= self.max_tokens

    def describe(self) -> str:
        modes = ",".join(sorted(m.name for m in self.modes))
        extra = f"; {self.sampling.describe()}" if self.sampling is not None else ""
        return f"{modes} with {self.min_tokens}..{self.max_tokens} tokens per step{extra}"


@dataclass(frozen=True)
class Requirements:
    """What a spec needs from the platform, the engine configuration and the model.

    Attributes:
        platforms: any one must match.
        dtypes: accepted model dtypes by name ("bfloat16", ...).
        tp_sizes: accepted tensor-parallel sizes; None accepts any.
        page_sizes: accepted KV page sizes (tokens); None accepts any.
        features_required / features_refused: engine features ("cuda_graph", "speculative").
        libraries: (distribution, PEP 440 specifier) pairs, e.g. ("triton", ">=3.6,<3.10").
        model: (ModelConfig field, accepted values) pairs, e.g. ("head_dim", (64, 128)).
        made_for: platform kinds the plugin is made for (optional); ``--plugin auto`` takes a plugin on these
            kinds only, and one that merely runs elsewhere (for development, or under the CPU interpreter) runs
            there when asked for by name. Empty: its first-listed platform.
    """

    platforms: tuple[PlatformRequirement, ...]
    dtypes: frozenset[str]
    tp_sizes: frozenset[int] | None = None
    page_sizes: frozenset[int] | None = None
    features_required: frozenset[str] = frozenset()
    features_refused: frozenset[str] = frozenset()
    libraries: tuple[tuple[str, str], ...] = ()
    model: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    made_for: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.made_for, str):
            raise SpecError(f"requirements.made_for must be a tuple of platform kinds, got {self.made_for!r}")
        for kind in self.made_for:
            if kind not in PLATFORM_KINDS:
                raise SpecError(f"requirements.made_for names {kind!r}; use platform kinds "
                                f"{', '.join(PLATFORM_KINDS)}")
        if not self.platforms:
            raise SpecError("requirements.platforms is empty: name at least one platform")
        bad = set(self.dtypes) - set(DTYPES)
        if not self.dtypes or bad:
            raise SpecError(f"requirements.dtypes must be a non-empty subset of {', '.join(DTYPES)}; got {sorted(bad)}")
        for feat in self.features_required | self.features_refused:
            if feat not in FEATURES:
                raise SpecError(f"feature {feat!r} is unknown; use one of {', '.join(FEATURES)}")
        from lowlat.config import ModelConfig

        known = {f.name for f in fields(ModelConfig)}
        for name, _ in self.model:
            if name not in known:
                raise SpecError(f"requirements.model names {name!r}, which is not a ModelConfig field")


@dataclass(frozen=True)
class ModelSpec:
    """What a plugin serves for one HF architecture.

    Attributes:
        architecture: HF architecture name, e.g. "Qwen3MoeForCausalLM".
        requirements: checked before weights load (the guard).
        coverage: the steps the plugin's forward serves; others take the general path.
        build: lazy import path "package.module:function" of ``build(binding) -> PluginForward``.
        check_model: optional lazy path of ``check_model(binding) -> None`` run after load (raise to refuse).
        check_environment: optional lazy path of ``check_environment() -> None`` that the guard runs before any
            weight loads (and ``lowlat plugins`` runs too): it raises, naming the variable and the fix, when the
            plugin's own environment switches hold a value its build would refuse (plugin API 4).
        retain_checkpoint: keep the original checkpoint tensors until build (released after).
        min_speedup: optional performance floor the contract suite enforces on a GPU
            (plugin step time must be at most general step time / min_speedup).
    """

    architecture: str
    requirements: Requirements
    coverage: Coverage
    build: str
    check_model: str | None = None
    check_environment: str | None = None
    retain_checkpoint: bool = False
    min_speedup: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise SpecError(
                f"architecture {self.architecture!r} is not one core runs; "
                f"use one of {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("build", "check_model", "check_environment"):
            path = getattr(self, name)
            if path is not None and (not isinstance(path, str) or path.count(":") != 1):
                raise SpecError(f"{name} must be an import path 'package.module:function', got {path!r}")


def spec_from_mapping(data: Mapping[str, Any]) -> ModelSpec:
    """Build a ModelSpec from a plain mapping, rejecting unknown keys at every level.

    Raises:
        SpecError: naming the unknown or invalid field.
    """
    top = _check_keys(data, ModelSpec, "spec")
    req = _check_keys(top.pop("requirements"), Requirements, "requirements")
    req["platforms"] = tuple(
        PlatformRequirement(**_check_keys(p, PlatformRequirement, "requirements.platforms[]")) for p in req["platforms"]
    )
    for key in ("dtypes", "tp_sizes", "page_sizes", "features_required", "features_refused"):
        if req.get(key) is not None:
            req[key] = frozenset(req[key])
    req["libraries"] = tuple(tuple(x) for x in req.get("libraries", ()))
    req["made_for"] = tuple(req.get("made_for", ()))
    req["model"] = tuple((k, tuple(v)) for k, v in dict(req.get("model", ())).items())
    cov = _check_keys(top.pop("coverage"), Coverage, "coverage")
    cov["modes"] = _modes(cov["modes"], "coverage.modes")
    if isinstance(cov.get("sampling"), Mapping):
        samp = _check_keys(cov["sampling"], SamplingCoverage, "coverage.sampling")
        if "modes" in samp:
            samp["modes"] = _modes(samp["modes"], "coverage.sampling.modes")
        cov["sampling"] = SamplingCoverage(**samp)
    return ModelSpec(requirements=Requirements(**req), coverage=Coverage(**cov), **top)


def _modes(names: Any, where: str) -> frozenset[ForwardMode]:
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise SpecError(f"{where} must be a list of mode names such as ['DECODE'], got {names!r}")
    try:
        return frozenset(m if isinstance(m, ForwardMode) else ForwardMode.parse(str(m)) for m in names)
    except ValueError as e:
        raise SpecError(f"{where}: {e}") from None


def _check_keys(data: Any, cls: type, where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise SpecError(f"{where} must be a mapping, got {type(data).__name__}")
    allowed = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise SpecError(f"{where} has unknown field(s) {', '.join(unknown)}; known: {', '.join(allowed)}")
    missing = sorted(
        n for n, f in allowed.items() if n not in data and f.default is MISSING and f.default_factory is MISSING
    )
    if missing:
        raise SpecError(f"{where} lacks required field(s) {', '.join(missing)}")
    return dict(data)


def coerce_spec(obj: Any) -> ModelSpec:
    """Accept a ModelSpec or a mapping; anything else is a SpecError."""
    if isinstance(obj, ModelSpec):
        return obj
    if isinstance(obj, Mapping):
        return spec_from_mapping(obj)
    raise SpecError(f"a spec must be a ModelSpec or a mapping, got {type(obj).__name__}")
