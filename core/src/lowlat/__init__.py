"""lowlat: low-latency LLM decoding with vendor kernel plugins.

Public API (import from here): Engine, EngineConfig, SamplingParams, Completion, ModelConfig, ForwardMode,
ForwardBatch. Submodules: ``lowlat.plugin`` (the plugin interface), ``lowlat.runtime``, ``lowlat.loader``.
"""

from lowlat.config import EngineConfig, ModelConfig
from lowlat.runtime.engine import Completion, Engine
from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.runtime.sampling import SamplingParams

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("lowlat")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

__all__ = ["Completion", "Engine", "EngineConfig", "ForwardBatch", "ForwardMode", "ModelConfig", "SamplingParams",
           "__version__"]
