"""EngineConfig (what the user asked for), and ModelConfig (what the checkpoint is: ``lowlat.model_config``).

Both are frozen dataclasses validated at construction, after mini-sglang's config style.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from lowlat.errors import ConfigError
from lowlat.model_config import SUPPORTED_ARCHITECTURES, ModelConfig  # noqa: F401 (re-exported)

# How the general forward may run (EngineConfig.general_impl; lowlat.models.general_impl has the three kinds).
GENERAL_IMPLS = ("auto", "reference", "fused", "compiled")
# How the general forward's row-parallel outputs are summed over TP ranks (EngineConfig.all_reduce).
ALL_REDUCES = ("nccl", "peer")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# The common short names of DTYPES' keys (torch's own aliases among them): accepted wherever a dtype name is.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "f16": "float16", "fp32": "float32",
                 "float": "float32", "f32": "float32"}


def dtype_name(name: str) -> str:
    """``name`` with an alias (DTYPE_ALIASES, any case) replaced by its DTYPES key; anything else unchanged
    (``"bf16"`` -> ``"bfloat16"``, ``"auto"`` -> ``"auto"``, ``"int8"`` -> ``"int8"``: the caller refuses it)."""
    return DTYPE_ALIASES.get(name.lower(), name.lower() if name.lower() in DTYPES else name)


@dataclass(frozen=True)
class SpeculativeMethod:
    """A parsed ``speculative_method``: ``kind`` "ngram", "draft" (``path``) or "simulated" (``mean``).

    ``mean`` is the simulated mean acceptance length: tokens appended per request per VERIFY step, the bonus
    token included (so 1.0 <= mean <= k + 1).
    """

    kind: str
    path: str | None = None
    mean: float | None = None


SPECULATIVE_FORMS = "ngram, draft:PATH (checkpoint directory or preset) or simulated:MEAN (mean acceptance length)"


def parse_method(method: str) -> SpeculativeMethod:
    """Parse ``lowlat run --speculative``'s value. Raises ConfigError naming the accepted forms."""
    kind, _, arg = method.strip().partition(":")
    if kind == "ngram" and not arg:
        return SpeculativeMethod("ngram")
    if kind == "draft" and arg:
        return SpeculativeMethod("draft", path=arg)
    if kind == "simulated" and arg:
        try:
            mean = float(arg)
        except ValueError:
            mean = float("nan")
        if not mean >= 1.0:
            raise ConfigError(f"simulated:MEAN needs a mean acceptance length >= 1 (tokens per VERIFY step, the "
                              f"bonus token included), got {arg!r}")
        return SpeculativeMethod("simulated", mean=mean)
    raise ConfigError(f"speculative method {method!r} is not one of {SPECULATIVE_FORMS}")


STEP_TIMEOUT_ENV = "LOWLAT_STEP_TIMEOUT"
DEFAULT_STEP_TIMEOUT_S = 60.0
_INT_FIELDS = ("tp_size", "page_size", "max_batch_size", "max_context_len", "max_verify_tokens",
               "chunked_prefill_size", "seed")
_BOOL_FIELDS = ("cuda_graph", "speculative")
_STR_FIELDS = ("model", "device", "dtype", "plugin", "all_reduce")


def _check_types(cfg: EngineConfig) -> None:
    """Raise ConfigError naming the field when a value has the wrong type ("8" for an int, say)."""
    def bad(name: str, want: str) -> ConfigError:
        value = getattr(cfg, name)
        return ConfigError(f"EngineConfig.{name} must be {want}, got {value!r} ({type(value).__name__})")

    for name in _INT_FIELDS:
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise bad(name, "an int")
    if cfg.num_layers is not None and (not isinstance(cfg.num_layers, int) or isinstance(cfg.num_layers, bool)):
        raise bad("num_layers", "an int or None")
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(cfg, name), bool):
            raise bad(name, "a bool")
    if cfg.overlap is not None and not isinstance(cfg.overlap, bool):
        raise bad("overlap", "a bool or None")
    for name in _STR_FIELDS:
        if not isinstance(getattr(cfg, name), str):
            raise bad(name, "a str")
    for name in ("kv_cache_fraction", "step_timeout_s"):
        v = getattr(cfg, name)
        if (v is not None or name == "kv_cache_fraction") and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise bad(name, "a number")


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked the engine for.

    Attributes:
        model: a checkpoint directory or a preset name (``lowlat.loader.presets``).
        device: "cpu", "cuda" or "auto" (cuda when available).
        dtype: "bfloat16", "float16", "float32" or "auto" (the checkpoint's dtype on a GPU; always float32 on CPU);
            the aliases of DTYPE_ALIASES ("bf16", "fp16", "half", "fp32", "float", ...) become those names.
        tp_size: tensor-parallel ranks.
        page_size: KV slots per page (tokens).
        max_batch_size: requests that run together (and the largest CUDA graph captured).
        max_context_len: tokens per request, prompt plus completion.
        kv_cache_fraction: fraction of device memory left after weights and plugin workspaces
            that the KV pool may take (CUDA); on CPU the pool is sized for max_batch_size x max_context_len.
        cuda_graph: capture DECODE and VERIFY steps in CUDA graphs (CUDA only).
        overlap: run DECODE steps overlapped (``lowlat.runtime.overlap``: the host schedules step N+1 while the
            device runs step N; sampled ids stay on the device and are read one step late); None (default):
            on for CUDA, off for CPU. Speculative engines never overlap. ``resolved_overlap`` is the decision.
        max_verify_tokens: largest k+1 a VERIFY step may carry (graphs are captured for it).
        chunked_prefill_size: prompts longer than this are prefilled in chunks (tokens).
        plugin: "none", "auto" or a plugin name.
        seed: seed for presets' random weights and for sampling.
        speculative: the engine runs a speculative verifier (a feature plugins may require or refuse); True
            with no ``speculative_method`` means "ngram". A ``speculative_method`` sets it (so turning
            speculation off takes ``speculative=False, speculative_method=None``).
        speculative_method: the drafter, as ``lowlat run --speculative`` takes it: "ngram", "draft:PATH" (a
            smaller checkpoint or preset with the same vocabulary) or "simulated:MEAN" (benchmarks only: a
            random acceptance of mean acceptance length MEAN, not the model's text); None: no speculation.
            Setting it sets ``speculative``. See ``lowlat.runtime.speculative``.
        num_draft_tokens: draft tokens k per request and VERIFY step (k + 1 <= max_verify_tokens); None:
            ``min(5, max_verify_tokens - 1)`` (6 verified rows per step, as in the reference design's results);
            ``draft_tokens`` is the resolved k.
        ngram_n / ngram_window: the n-gram drafter matches the last ``ngram_n`` tokens (then shorter suffixes,
            down to 1) within the last ``ngram_window`` tokens of prompt plus output.
        speculative_adaptive: fall back to plain DECODE steps while the measured acceptance makes speculation
            slower than plain decoding (``lowlat.runtime.speculative.controller``).
        num_layers: run only the first N decoder layers (benchmarks use two depths to get per-layer latency).
        strict_max_position: refuse a ``max_context_len`` above the model's ``max_position_embeddings``
            (default: warn; positions past it are outside what the model was trained on).
        step_timeout_s: deadline of one step, and of each cross-rank wait within it, in seconds; None reads
            LOWLAT_STEP_TIMEOUT, else 60 (below a typical serving watchdog). A missed deadline raises
            StepDeadlineExceeded and leaves the engine unusable (``lowlat.runtime.deadline``).
        general_impl: how the general forward runs (``lowlat.models.general_impl``): "auto" (the default:
            "fused" on CUDA, "reference" elsewhere; ``resolved_general_impl``), "reference" (plain torch, the
            oracle the differential tests and the contract suite use), "fused" (core Triton kernels for norm,
            RoPE + KV write, SiLU-and-mul, decode MoE) or "compiled" (torch.compile of the same pieces, before
            CUDA-graph capture). Why fused on CUDA: it measured fastest of the three on the H200 (llama-3.2-1b
            and qwen3-30b-a3b, every batch 1-8 and VERIFY x6; bench/results/2026-12-01-h200-general-speed).
        all_reduce: how the general forward sums its row-parallel outputs (o_proj, down_proj, MoE experts) over
            TP ranks: "nccl" (the default: ``torch.distributed``, NCCL on GPUs, gloo on CPU) or "peer" (the
            one-shot peer all-reduce, ``lowlat.runtime.peer_reduce``, for steps of at most max_batch_size x
            max_verify_tokens rows; larger ones still take NCCL). "peer" has not been measured on a machine of
            two GPUs yet, hence not the default. Ignored at tp_size 1.
    """

    model: str = "tiny-llama"
    device: str = "auto"
    dtype: str = "auto"
    tp_size: int = 1
    page_size: int = 16
    max_batch_size: int = 8
    max_context_len: int = 2048
    kv_cache_fraction: float = 0.85
    cuda_graph: bool = True
    overlap: bool | None = None
    max_verify_tokens: int = 8
    chunked_prefill_size: int = 4096
    plugin: str = "auto"
    seed: int = 0
    speculative: bool = False
    speculative_method: str | None = None
    num_draft_tokens: int | None = None
    ngram_n: int = 3
    ngram_window: int = 1024
    speculative_adaptive: bool = True
    num_layers: int | None = None
    strict_max_position: bool = False
    step_timeout_s: float | None = None
    general_impl: str = "auto"
    all_reduce: str = "nccl"
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        _check_types(self)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", dtype_name(self.dtype))  # "bf16" -> "bfloat16"
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)} (or {', '.join(DTYPE_ALIASES)}), "
                              f"got {self.dtype!r}")
        for name in ("tp_size", "page_size", "max_batch_size", "max_context_len", "max_verify_tokens",
                     "chunked_prefill_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1 or None, got {self.num_layers}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ConfigError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if not self.plugin:
            raise ConfigError("plugin must be 'none', 'auto' or a plugin name")
        if self.general_impl not in GENERAL_IMPLS:
            raise ConfigError(f"general_impl must be one of {', '.join(GENERAL_IMPLS)}, got {self.general_impl!r}")
        if self.all_reduce not in ALL_REDUCES:
            raise ConfigError(f"all_reduce must be one of {', '.join(ALL_REDUCES)} (--all-reduce), got "
                              f"{self.all_reduce!r}")
        if self.speculative_method is not None or self.speculative:
            self._check_speculative()
        if self.step_timeout_s is not None and not 0 < self.step_timeout_s < float("inf"):
            raise ConfigError(f"step_timeout_s must be a finite number of seconds > 0 or None, "
                              f"got {self.step_timeout_s}")

    def _check_speculative(self) -> None:
        method = self.speculative_method or "ngram"
        object.__setattr__(self, "speculative", True)  # a method turns the feature on (plugins see it)
        for name in ("num_draft_tokens", "ngram_n", "ngram_window"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_verify_tokens < 2:
            raise ConfigError("speculative decoding needs max_verify_tokens >= 2 (one draft token per step)")
        if self.num_draft_tokens is not None and self.num_draft_tokens + 1 > self.max_verify_tokens:
            raise ConfigError(f"num_draft_tokens={self.num_draft_tokens} makes {self.num_draft_tokens + 1} tokens "
                              f"per VERIFY step, above max_verify_tokens={self.max_verify_tokens}; lower "
                              "num_draft_tokens or raise max_verify_tokens")
        sm = parse_method(method)
        if sm.kind == "simulated" and sm.mean is not None and sm.mean > self.draft_tokens + 1:
            raise ConfigError(f"simulated:{sm.mean:g} is above the longest possible acceptance "
                              f"num_draft_tokens + 1 = {self.draft_tokens + 1}")

    @property
    def draft_tokens(self) -> int:
        """The draft tokens k per VERIFY step: ``num_draft_tokens``, or min(5, max_verify_tokens - 1)."""
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens
        return max(1, min(5, self.max_verify_tokens - 1))

    @property
    def speculative_spec(self) -> SpeculativeMethod | None:
        """The parsed ``speculative_method`` ("ngram" when only ``speculative`` is set; None when off)."""
        return parse_method(self.speculative_method or "ngram") if self.speculative else None

    def check_model(self, model: ModelConfig) -> None:
        """Check this engine config against the model's: ``max_context_len`` <= ``max_position_embeddings``.

        Warns (UserWarning) when it is larger; raises ConfigError instead with ``strict_max_position``.
        """
        if self.max_context_len <= model.max_position_embeddings:
            return
        msg = (f"max_context_len={self.max_context_len} exceeds the model's max_position_embeddings="
               f"{model.max_position_embeddings} (config.json): positions past it were never trained")
        if self.strict_max_position:
            raise ConfigError(msg + f"; pass max_context_len <= {model.max_position_embeddings}")
        warnings.warn(msg + "; outputs there may be poor (strict_max_position=True refuses this)", stacklevel=2)

    def resolved_general_impl(self, device: torch.device) -> str:
        """``general_impl`` with "auto" made concrete for ``device``: "fused" on CUDA, else "reference" (a CPU has
        no compiled Triton, and the interpreter is far slower than plain torch there)."""
        if self.general_impl != "auto":
            return self.general_impl
        return "fused" if device.type == "cuda" else "reference"

    @property
    def resolved_step_timeout_s(self) -> float:
        """The step deadline in seconds: ``step_timeout_s``, else LOWLAT_STEP_TIMEOUT, else 60.

        Raises:
            ConfigError: LOWLAT_STEP_TIMEOUT is not a positive finite number.
        """
        if self.step_timeout_s is not None:
            return float(self.step_timeout_s)
        raw = os.environ.get(STEP_TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_STEP_TIMEOUT_S
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise ConfigError(f"{STEP_TIMEOUT_ENV}={raw!r} must be a finite number of seconds > 0")
        return value

    @property
    def resolved_overlap(self) -> bool:
        """Whether DECODE steps run overlapped: ``overlap``, or (None) on CUDA only; never when speculative."""
        if self.speculative:
            return False
        return self.resolved_device == "cuda" if self.overlap is None else bool(self.overlap)

    @property
    def resolved_device(self) -> str:
        """"cuda" or "cpu" after resolving "auto"."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def fixed_dtype(self, cpu: bool | None = None) -> torch.dtype | None:
        """The compute dtype where it does not depend on the model (explicit, or float32 on CPU); else None.
        ``cpu``: whether the engine runs on a CPU (default: ``resolved_device``; the plugin guard, without a model,
        passes the platform it evaluates for)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        on_cpu = self.resolved_device == "cpu" if cpu is None else cpu
        return torch.float32 if on_cpu else None

    def resolved_dtype(self, model: ModelConfig) -> torch.dtype:
        """The compute dtype: explicit, else float32 on CPU (whatever the checkpoint's), else the checkpoint's."""
        return self.fixed_dtype() or DTYPES.get(model.torch_dtype, torch.bfloat16)
