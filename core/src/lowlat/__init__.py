"""lowlat: low-latency LLM decoding with vendor kernel plugins.

Public API (import from here): Engine, EngineConfig, SamplingParams, Completion, ModelConfig, ForwardMode,
ForwardBatch. Submodules: ``lowlat.plugin`` (the plugin interface), ``lowlat.runtime``, ``lowlat.loader``.
Engine, Completion and SamplingParams load on first use, so ``import lowlat.plugin`` (what a vendor
imports) does not load the runtime.
"""

from typing import Any

from lowlat.config import EngineConfig, ModelConfig
from lowlat.forward_batch import ForwardBatch, ForwardMode

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("lowlat")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

__all__ = ["Completion", "Engine", "EngineConfig", "ForwardBatch", "ForwardMode", "ModelConfig", "SamplingParams",
           "__version__"]


def __getattr__(name: str) -> Any:
    """Engine, Completion and SamplingParams, imported on first use."""
    if name in ("Engine", "Completion"):
        from lowlat.runtime import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from lowlat.runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'lowlat' has no attribute {name!r}")
