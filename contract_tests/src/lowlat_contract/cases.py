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
from lowlat.plugin import tolerance as _tol

TINY_PRESETS = {"LlamaForCausalLM": "tiny-llama", "Qwen3ForCausalLM": "tiny-qwen3",
                "Qwen3MoeForCausalLM": "tiny-qwen3-moe"}
CONTEXT_LEN = 128  # max_context_len of the CPU contract engines: prefixes of 1..33 plus 16 new tokens fit
CUDA_CONTEXT_LEN = 4096 + 128  # on CUDA the case's engine also serves the shape sweep's contexts up to 4096
MAX_BATCH = 64  # never more requests than this in one engine, whatever the coverage
PREFIX_LENS = (1, 17, 33)  # odd context lengths the steps run on top of (request i gets PREFIX_LENS[i % 3] + i)


class ContractSetupError(Exception):
    """The command line or the plugin cannot produce a runnable case (becomes a pytest usage error)."""


# The bounds' values are core's (lowlat.plugin.tolerance: `lowlat run --compare` uses them too); re-exported here.
ROUNDINGS, UNIT_ROUNDOFF, FP32_REDUCTION = _tol.ROUNDINGS, _tol.UNIT_ROUNDOFF, _tol.FP32_REDUCTION


@dataclass(frozen=True)
class Tolerance:
    """How close plugin outputs must be to the general forward's, row by row (docs/contract.md, "Tolerances").

    A row is one token: its logits [vocab], or its K/V over all layers. With ``scale = max(1, max |want_row|)``
    each row must satisfy, in every element, ``|got - want| <= max_rel * scale`` and, on average over the row,
    ``mean |got - want| <= mean_rel * scale``. Derivation (``for_dtype``): the general path rounds each of its
    R = ROUNDINGS intermediates to the model dtype, a fused plugin may keep float32 instead; to first order
    each rounding moves the output by at most u (the unit roundoff) relative to its scale. Worst case the R
    errors add up (``max_rel = R * u``); on average they are independent with random sign and add in
    quadrature (``mean_rel = sqrt(R) * u``). float32: both paths compute in float32 and differ only by
    summation order: ``max_rel = R * sqrt(n) * u``, ``mean_rel = sqrt(R * n) * u`` with n = FP32_REDUCTION.
    That gives bfloat16 5.08e-2 / 9.96e-3, float16 1.27e-2 / 2.49e-3, float32 9.92e-5 / 1.95e-5
    (the values: ``lowlat.plugin.tolerance``, shared with ``lowlat run --compare``).

    No row is excused for being a row: the only exception (``low_precision`` dtypes only) is ``excused_rows``,
    the MoE rows whose expert selection differs between the two paths (``router_ties.routing_excuses``): one
    flipped expert moves a token by 6-30% of its scale. Dense models never pass any.
    """

    dtype: str
    max_rel: float
    mean_rel: float
    low_precision: bool

    @classmethod
    def for_dtype(cls, dtype: str) -> Tolerance:
        max_rel, mean_rel = _tol.bounds(dtype)
        return cls(dtype, max_rel, mean_rel, dtype != "float32")

    @property
    def allow_outlier_rows(self) -> bool:
        """Deprecated alias of ``low_precision`` (0.2): whether router-flip rows may be excused."""
        return self.low_precision

    def atol(self, want: torch.Tensor) -> float:
        """The absolute bound on one element for the reference row (or tensor) ``want``."""
        return self.max_rel * max(1.0, float(want.abs().max()) if want.numel() else 1.0)

    def check(self, got: torch.Tensor, want: torch.Tensor, what: str,
              tie_rows: frozenset[int] = frozenset(),
              floor: tuple[torch.Tensor, torch.Tensor] | None = None) -> str | None:
        """None when every row of ``got`` matches ``want`` (rows in ``tie_rows`` excused in low precision);
        else a message naming ``what``, the worst row, its errors and its bounds. ``floor``: per-row lower
        bounds (max, mean) [rows] on the two bounds, from a measured conditioning (``conditioning.Conditioned``)."""
        if got.shape != want.shape:
            return f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        if want.numel() == 0:
            return None
        g, w = got.float(), want.float()
        if not torch.isfinite(g).all():
            return f"{what}: plugin output holds NaN or inf"
        rows = w.shape[0]
        err = (g - w).abs().reshape(rows, -1)
        scale = w.abs().reshape(rows, -1).amax(dim=1).clamp_min(1.0)
        row_max, row_mean = err.amax(dim=1), err.mean(dim=1)
        bound_max, bound_mean = self.max_rel * scale, self.mean_rel * scale
        if floor is not None:
            bound_max, bound_mean = torch.maximum(bound_max, floor[0]), torch.maximum(bound_mean, floor[1])
        over = (row_max > bound_max) | (row_mean > bound_mean)
        excused = torch.zeros_like(over)
        if self.low_precision and tie_rows:
            excused[[r for r in tie_rows if r < rows]] = True
        bad = over & ~excused
        if not bool(bad.any()):
            return None
        ratio = torch.maximum(row_max / bound_max, row_mean / bound_mean)
        worst = int(torch.where(bad, ratio, torch.zeros_like(ratio)).argmax())
        n_exc = int((over & excused).sum())
        exc = f"; {n_exc} more at a routing difference (excused)" if n_exc else ""
        s = float(scale[worst])
        return (f"{what}: {int(bad.sum())} of {rows} row(s) out of bounds{exc}; worst row {worst}: max |plugin - "
                f"general| = {float(row_max[worst]):.4g}, mean {float(row_mean[worst]):.4g}; {self.dtype} allows "
                f"{self.max_rel:.3g} x scale = {self.max_rel * s:.4g} per element and {self.mean_rel:.3g} x scale = "
                f"{self.mean_rel * s:.4g} on average (scale = max(1, max |general row|) = {s:.4g})"
                + ("" if floor is None else f"; widened by this step's conditioning to {float(bound_max[worst]):.4g} "
                   f"and {float(bound_mean[worst]):.4g} (a multiple of the general path's own distance to its "
                   "float32 twin: lowlat_contract.conditioning)"))


TOLERANCES = {d: Tolerance.for_dtype(d) for d in ("float32", "bfloat16", "float16")}


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
                                  max_context_len=CUDA_CONTEXT_LEN if self.device == "cuda" else CONTEXT_LEN,
                                  max_verify_tokens=self.max_verify_tokens,
                                  cuda_graph=False, seed=0)
        if "general_impl" in EngineConfig.__dataclass_fields__:  # core >= 0.2.1: the oracle is the plain forward
            kw["general_impl"] = "reference"
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
    from lowlat.plugin import LowlatPluginError
    from lowlat.runtime.plugin_host import discover

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
