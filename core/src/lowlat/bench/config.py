"""BenchConfig: what ``lowlat bench`` measures, with device-dependent defaults.

A row of the benchmark is one (model, path, Shape); a Shape is a forward mode, a batch size and the new
tokens per request (1 for DECODE, ``verify_tokens`` for VERIFY). Paths are "general" (the general forward,
``plugin="none"``, as the engine runs it by default: ``general_impl="auto"``, fused on CUDA; "general-reference",
"general-fused" and "general-compiled" pin ``general_impl``), a plugin
name (that plugin, ``plugin=NAME``) and "hf" (HF transformers with a static cache and
``torch.compile(mode="reduce-overhead")``); "plugins" expands to every discovered plugin.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lowlat.config import DTYPES, ConfigError
from lowlat.forward_batch import ForwardMode
from lowlat.runtime.cuda_graph_runner import GraphKey

GENERAL_PATH = "general"
# Paths that run the general forward (``plugin="none"``), by ``EngineConfig.general_impl``.
GENERAL_VARIANTS = {GENERAL_PATH: "auto", "general-reference": "reference", "general-fused": "fused",
                    "general-compiled": "compiled"}
HF_PATH = "hf"
ALL_PLUGINS = "plugins"

# Defaults per device kind. GPU figures are the real ones; CPU runs exist so the harness runs anywhere and
# is tested, and use tiny presets, short contexts and few repeats.
GPU_DEFAULTS = dict(models=("llama-3.2-1b",), paths=(GENERAL_PATH, ALL_PLUGINS, HF_PATH), batch_sizes=(1, 2, 4, 8),
                    context=1024, warmup=10, iters=100, copy_bytes=2 << 30, copy_reps=20)
CPU_DEFAULTS = dict(models=("tiny-llama",), paths=(GENERAL_PATH, HF_PATH), batch_sizes=(1, 2), context=64,
                    warmup=1, iters=3, copy_bytes=64 << 20, copy_reps=5)


class Shape(GraphKey):
    """One step shape (a GraphKey: ``mode``, ``batch_size``, ``tokens_per_req``) with a printable label."""

    __slots__ = ()

    @property
    def label(self) -> str:
        """e.g. "DECODE b=4" or "VERIFY b=1 k+1=6"."""
        extra = f" k+1={self.tokens_per_req}" if self.mode is ForwardMode.VERIFY else ""
        return f"{self.mode.name} b={self.batch_size}{extra}"


@dataclass(frozen=True)
class BenchConfig:
    """Everything one ``lowlat bench`` run measures.

    Attributes:
        models: preset names or checkpoint directories, measured one after another.
        paths: "general", plugin names, "plugins" (every discovered plugin) and/or "hf", in run order.
        batch_sizes: DECODE batch sizes (requests per step).
        modes: DECODE and/or VERIFY.
        verify_tokens: new tokens per request of a VERIFY row (k drafts + 1); 6 = a 5-draft verifier.
        verify_batch_sizes: VERIFY batch sizes.
        context: tokens already in each request's KV cache before the step.
        input_sets: distinct inputs (requests, KV slots, token ids) rotated through the timed steps.
        warmup, iters: untimed steps, then timed steps per timing run (each row is timed twice).
        device: "cuda" or "cpu"; dtype: weights, activations and KV ("bfloat16" by default; plugins need it).
        seed: weights, token ids and KV contents.
        page_size: KV page size (tokens).
        layer_depth: the second decoder-layer count for per-layer figures (default: half the model's layers).
        hf_batch_sizes: DECODE batch sizes the hf peer runs (None: all of ``batch_sizes``); each is one compile.
        hf_layer_batch_sizes: DECODE batch sizes the hf peer also runs at ``layer_depth`` (per-layer figures).
        hf_budget_s: seconds per model the hf peer may spend; shapes not started by then are skipped.
        copy_bytes, copy_reps: size (bytes) and repeats of the device-to-device copy that sets the bandwidth.
    """

    models: tuple[str, ...]
    paths: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    modes: tuple[ForwardMode, ...] = (ForwardMode.DECODE, ForwardMode.VERIFY)
    verify_tokens: int = 6
    verify_batch_sizes: tuple[int, ...] = (1,)
    context: int = 1024
    input_sets: int = 4
    warmup: int = 10
    iters: int = 100
    device: str = "cuda"
    dtype: str = "bfloat16"
    seed: int = 0
    page_size: int = 16
    layer_depth: int | None = None
    hf_batch_sizes: tuple[int, ...] | None = None
    hf_layer_batch_sizes: tuple[int, ...] = (1,)
    hf_budget_s: float = 150.0
    copy_bytes: int = 2 << 30
    copy_reps: int = 20

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("bench needs at least one --model")
        if not self.paths:
            raise ConfigError("bench needs at least one path in --paths (general, a plugin name, plugins, hf)")
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"bench device must be cuda or cpu, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not self.modes or any(m is ForwardMode.PREFILL for m in self.modes):
            raise ConfigError("--modes takes decode and/or verify")
        for name in ("batch_sizes", "verify_batch_sizes", "hf_layer_batch_sizes"):
            if any(b < 1 for b in getattr(self, name)):
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if ForwardMode.DECODE in self.modes and not self.batch_sizes:
            raise ConfigError("--batch-sizes is empty but decode rows were asked for")
        if ForwardMode.VERIFY in self.modes and not self.verify_batch_sizes:
            raise ConfigError("--verify-batch-sizes is empty but verify rows were asked for")
        if self.verify_tokens < 2:
            raise ConfigError(f"--verify-tokens is k+1 and must be >= 2, got {self.verify_tokens}")
        for name in ("context", "input_sets", "iters", "page_size", "copy_reps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.layer_depth is not None and self.layer_depth < 1:
            raise ConfigError(f"--layer-depth must be >= 1, got {self.layer_depth}")
        if self.copy_bytes < 1 << 20:
            raise ConfigError(f"--copy-bytes must be at least 1 MiB, got {self.copy_bytes}")

    @classmethod
    def with_defaults(cls, device: str, **overrides: object) -> BenchConfig:
        """A config with the ``device``'s defaults (GPU_DEFAULTS / CPU_DEFAULTS); None overrides are ignored."""
        base: dict[str, object] = dict(GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(device=device, **base)  # type: ignore[arg-type]

    def shapes(self) -> list[Shape]:
        """Every row shape: DECODE at ``batch_sizes``, then VERIFY at ``verify_batch_sizes``."""
        out: list[Shape] = []
        if ForwardMode.DECODE in self.modes:
            out += [Shape(ForwardMode.DECODE, b, 1) for b in self.batch_sizes]
        if ForwardMode.VERIFY in self.modes:
            out += [Shape(ForwardMode.VERIFY, b, self.verify_tokens) for b in self.verify_batch_sizes]
        return out

    @property
    def max_tokens_per_req(self) -> int:
        return self.verify_tokens if ForwardMode.VERIFY in self.modes else 1

    @property
    def max_batch_size(self) -> int:
        """The largest batch of any row."""
        return max(s.batch_size for s in self.shapes())

    def depths(self, num_layers: int) -> tuple[int, int] | None:
        """(full depth, second depth) for per-layer figures, or None when the model has one layer only."""
        second = self.layer_depth if self.layer_depth is not None else num_layers // 2
        second = min(second, num_layers)
        if second < 1 or second == num_layers:
            return None
        return num_layers, second

    def to_json(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["modes"] = [m.name for m in self.modes]
        return d


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    """"1,2,4" -> (1, 2, 4). Raises ConfigError naming ``what`` on anything that is not a list of integers."""
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers such as 1,2,4,8, got {text!r}") from None
    if not values:
        raise ConfigError(f"{what} is empty; give comma-separated integers such as 1,2,4,8")
    return values


def parse_modes(text: str) -> tuple[ForwardMode, ...]:
    """"decode,verify" -> (DECODE, VERIFY). Raises ConfigError on other modes."""
    modes = []
    for t in (t.strip() for t in text.split(",") if t.strip()):
        try:
            mode = ForwardMode.parse(t)
        except ValueError:
            mode = ForwardMode.PREFILL
        if mode is ForwardMode.PREFILL:
            raise ConfigError(f"--modes takes decode and verify, got {t!r}")
        modes.append(mode)
    if not modes:
        raise ConfigError("--modes is empty; give decode, verify or decode,verify")
    return tuple(dict.fromkeys(modes))
