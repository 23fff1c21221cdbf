"""What the suite runs: one ContractCase per (spec, model, dtype) of the plugin under test, and the tolerances.

A case is built from the plugin's registered ``ModelSpec``s and the command line (``--lowlat-plugin``,
``--lowlat-arch``, ``--lowlat-model``, ``--lowlat-device``, ``--lowlat-dtype``). Every architecture gets
its tiny preset (tiny-llama / tiny-qwen3 / tiny-qwen3-moe); ``--lowlat-model`` adds presets or checkpoint
directories of the architectures the plugin serves (meant for GPUs). The dtype is the one asked for, else
the spec's: float32 on CPU when allowed, bfloat16 on GPUs when allowed, else the first the spec lists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

TINY_PRESETS = {"LlamaForCausalLM": "tiny-llama", "Qwen3ForCausalLM": "tiny-qwen3",
                "Qwen3MoeForCausalLM": "tiny-qwen3-moe"}
CONTEXT_LEN = 128  # max_context_len of every contract engine: prefixes of 1..33 plus 16 new tokens fit
MAX_BATCH = 64  # never more requests than this in one engine, whatever the coverage
PREFIX_LENS = (1, 17, 33)  # odd context lengths the steps run on top of (request i gets PREFIX_LENS[i % 3] + i)


class ContractSetupError(Exception):
    """The command line or the plugin cannot produce a runnable case (becomes a pytest usage error)."""


@dataclass(frozen=True)
class Tolerance:
    """How close plugin outputs must be to the general forward's (docs/contract.md, "Tolerances").

    With ``scale = max(1, max |reference|)`` over the compared tensor:
    - every element: ``|got - want| <= max_rel * scale``, except that up to ``outlier_rows`` of the rows
      (1 in 8, at least 1) may exceed it, for low-precision dtypes only (a near-tie in a MoE router or a
      rounding-sensitive row legitimately moves one token's output);
    - the mean: ``mean |got - want| <= mean_rel * scale`` over the rows within the element bound (an excused row
      is left out of the mean as well: at 8 rows one router flip alone would otherwise exceed it).
    Rows in ``tie_rows`` (tokens whose MoE router had a near-tie on the general path, ``router_ties.tie_rows``)
    may exceed the element bound too, without using up the allowance, for low-precision dtypes only: a model
    with many MoE layers (qwen3-30b-a3b: 48) flips an expert in more than one row in eight.
    """

    dtype: str
    max_rel: float
    mean_rel: float
    allow_outlier_rows: bool

    def atol(self, want: torch.Tensor) -> float:
        """The absolute bound on one element for reference tensor ``want``."""
        return self.max_rel * max(1.0, float(want.abs().max()) if want.numel() else 1.0)

    def check(self, got: torch.Tensor, want: torch.Tensor, what: str,
              tie_rows: frozenset[int] = frozenset()) -> str | None:
        """None when ``got`` matches ``want``; else a message naming ``what``, the worst element and the bound."""
        if got.shape != want.shape:
            return f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        if want.numel() == 0:
            return None
        g, w = got.float(), want.float()
        if not torch.isfinite(g).all():
            return f"{what}: plugin output holds NaN or inf"
        scale = max(1.0, float(w.abs().max()))
        err = (g - w).abs().reshape(w.shape[0], -1) if w.dim() > 1 else (g - w).abs()[:, None]
        bound = self.max_rel * scale
        row_max = err.max(dim=1).values
        over = row_max > bound
        tied = torch.zeros_like(over)
        if self.allow_outlier_rows and tie_rows:
            tied[[r for r in tie_rows if r < w.shape[0]]] = True
        bad_rows = int((over & ~tied).sum())
        allowed = max(1, w.shape[0] // 8) if self.allow_outlier_rows else 0
        within = ~over
        mean = float(err[within].mean()) if bad_rows <= allowed and bool(within.any()) else float(err.mean())
        worst = int(row_max.argmax())
        if bad_rows > allowed or mean > self.mean_rel * scale:
            ties = f", {int((over & tied).sum())} more at router near-ties" if bool((over & tied).any()) else ""
            return (f"{what}: max |plugin - general| = {float(row_max.max()):.4g} (row {worst}), mean "
                    f"{mean:.4g}; {self.dtype} allows {self.max_rel:g} x scale = {bound:.4g} per element "
                    f"({bad_rows} row(s) over, {allowed} allowed{ties}) and a mean of {self.mean_rel:g} x scale = "
                    f"{self.mean_rel * scale:.4g} (scale = max(1, max |general|) = {scale:.4g})")
        return None


TOLERANCES = {
    "float32": Tolerance("float32", max_rel=1e-4, mean_rel=1e-5, allow_outlier_rows=False),
    "bfloat16": Tolerance("bfloat16", max_rel=5e-2, mean_rel=1e-2, allow_outlier_rows=True),
    "float16": Tolerance("float16", max_rel=1.25e-2, mean_rel=2.5e-3, allow_outlier_rows=True),
}


@dataclass(frozen=True)
class ContractCase:
    """One model configuration a plugin's spec is checked on.

    Attributes:
        plugin: the plugin's name; spec: its ModelSpec for ``architecture``.
        model: a preset name or a checkpoint directory; device: "cpu" or "cuda"; dtype: "float32" etc.
    """

    plugin: str
    spec: Any = field(compare=False)
    architecture: str
    model: str
    device: str
    dtype: str

    @property
    def id(self) -> str:
        return f"{self.architecture}-{os.path.basename(self.model.rstrip('/'))}-{self.dtype}"

    @property
    def is_tiny(self) -> bool:
        """Whether the model is one of the tiny presets (the contracts that rebuild the plugin many times run
        only on those)."""
        return self.model in TINY_PRESETS.values()

    @property
    def tolerance(self) -> Tolerance:
        return TOLERANCES[self.dtype]

    @property
    def page_size(self) -> int:
        sizes = self.spec.requirements.page_sizes
        return 16 if not sizes or 16 in sizes else min(sizes)

    @property
    def max_batch_size(self) -> int:
        """Room for one step above coverage (max_tokens + 1 one-token requests), at most MAX_BATCH."""
        return max(4, min(self.spec.coverage.max_tokens + 1, MAX_BATCH))

    @property
    def max_verify_tokens(self) -> int:
        return max(2, min(self.spec.coverage.max_tokens, 16))

    def engine_config(self, **overrides: Any) -> Any:
        """The EngineConfig every contract engine of this case uses (eager unless ``cuda_graph=True`` is passed)."""
        from lowlat.config import EngineConfig

        kw: dict[str, Any] = dict(model=self.model, device=self.device, dtype=self.dtype, plugin=self.plugin,
                                  tp_size=1, page_size=self.page_size, max_batch_size=self.max_batch_size,
                                  max_context_len=CONTEXT_LEN, max_verify_tokens=self.max_verify_tokens,
                                  cuda_graph=False, seed=0)
        kw.update(overrides)
        return EngineConfig(**kw)


def _pick_dtype(spec: Any, device: str, wanted: str | None) -> str:
    allowed = spec.requirements.dtypes
    if wanted:
        if wanted not in allowed:
            raise ContractSetupError(f"--lowlat-dtype {wanted}: the spec for {spec.architecture} allows "
                                     f"{', '.join(sorted(allowed))}")
        return wanted
    order = ("float32", "bfloat16", "float16") if device == "cpu" else ("bfloat16", "float16", "float32")
    return next(d for d in order if d in allowed)


def build_cases(plugin: str, archs: list[str] | None, models: list[str] | None, device: str,
                dtype: str | None) -> list[ContractCase]:
    """The cases for ``plugin`` (see the module docstring).

    Raises:
        ContractSetupError: the plugin is missing, broken or refused by this core; an --lowlat-arch or
            --lowlat-model it does not serve; an unknown model.
    """
    from lowlat.loader import resolve_model
    from lowlat.plugin import LowlatPluginError, discover

    try:
        info = discover().get(plugin)
    except LowlatPluginError as e:
        raise ContractSetupError(f"--lowlat-plugin {plugin}: {e}") from None
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    served = {s.architecture: s for s in info.specs}
    for a in archs or []:
        if a not in served:
            raise ContractSetupError(f"--lowlat-arch {a}: plugin {plugin!r} serves {', '.join(served)}")
    extra: dict[str, list[str]] = {}
    for m in models or []:
        try:
            arch = resolve_model(m).architecture
        except Exception as e:  # ConfigError / CheckpointError: name the option
            raise ContractSetupError(f"--lowlat-model {m}: {e}") from None
        if arch not in served:
            raise ContractSetupError(f"--lowlat-model {m} is a {arch}; plugin {plugin!r} serves {', '.join(served)}")
        extra.setdefault(arch, []).append(m)
    cases = []
    for arch, spec in served.items():
        if archs and arch not in archs:
            continue
        d = _pick_dtype(spec, device, dtype)
        for model in [TINY_PRESETS[arch], *extra.get(arch, [])]:
            cases.append(ContractCase(plugin, spec, arch, model, device, d))
    return cases
