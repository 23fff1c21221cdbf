"""The plugin interface (plugin API 4): everything a vendor imports, and nothing host-side.

A vendor imports from here only: specs and requirements (``ModelSpec``, ``Requirements``, ``Coverage``,
``PlatformRequirement``), the hook marker (``hookimpl``), what ``build`` gets and returns (``PluginBinding``,
``PluginForward``), the reference step to override stage by stage (``ReferenceStep``, ``STAGES``), the
parameter binder (``bind_params``, ``ModelParams``, ``LayerParams``), ``rope_tables``, the runtime types a step
sees (``ForwardBatch``, ``ForwardMode``, ``KVPool``, ``ModelConfig``, ``EngineConfig``), sampled ids
(``SamplingCoverage`` in a spec's coverage, ``SamplingInfo`` in a batch, ``sample_ids`` the torch reference)
and the errors. Cross-rank tiles for kernels at tp_size > 1 (plugin API 4: ``binding.peer_buffers``) are in
``lowlat.plugin.peer``.
Discovery, the guard and selection are ``lowlat.runtime.plugin_host``; the dispatcher ``lowlat.runtime.dispatch``.
Public names are re-exported here once; the modules beside this file are the implementation.
"""

from typing import Any

from lowlat.config import EngineConfig, ModelConfig
from lowlat.errors import (
    IncompatibleCoreVersion,
    KVPoolNotReady,
    LowlatPluginError,
    PluginBuildError,
    PluginLoadError,
    PluginNotFound,
    PluginStepError,
    SpecError,
    UnsupportedConfiguration,
)
from lowlat.forward_batch import ForwardBatch, ForwardMode, SamplingInfo
from lowlat.kv_cache import KVPool
from lowlat.plugin.binding import PluginBinding, PluginForward, rope_tables
from lowlat.plugin.hookspecs import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, hookimpl, hookspec
from lowlat.plugin.params import LayerParams, ModelParams, bind_params
from lowlat.plugin.reference_step import STAGES, LayerWeights, ReferenceStep
from lowlat.plugin.sampling import counter_uniform, sample_ids
from lowlat.plugin.spec import (
    Coverage,
    ModelSpec,
    PlatformRequirement,
    Requirements,
    SamplingCoverage,
    spec_from_mapping,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGIN_API_VERSION",
    "STAGES",
    "Coverage",
    "EngineConfig",
    "ForwardBatch",
    "ForwardMode",
    "IncompatibleCoreVersion",
    "KVPool",
    "KVPoolNotReady",
    "LayerParams",
    "LayerWeights",
    "LowlatPluginError",
    "ModelConfig",
    "ModelParams",
    "ModelSpec",
    "PlatformRequirement",
    "PluginBinding",
    "PluginBuildError",
    "PluginForward",
    "PluginLoadError",
    "PluginNotFound",
    "PluginStepError",
    "ReferenceStep",
    "Requirements",
    "SamplingCoverage",
    "SamplingInfo",
    "SpecError",
    "UnsupportedConfiguration",
    "bind_params",
    "counter_uniform",
    "hookimpl",
    "hookspec",
    "rope_tables",
    "sample_ids",
    "spec_from_mapping",
]


def __getattr__(name: str) -> Any:
    """API 2's host-side names (``discover``, ``evaluate``, ``select_plugin``, ...): deprecated, by name."""
    from lowlat.plugin._compat import host_name

    return host_name(name)
