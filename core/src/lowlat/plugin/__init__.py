"""The plugin interface: everything a vendor imports.

Public names are re-exported here once; the modules beside this file are the implementation.
"""

from lowlat.config import EngineConfig, ModelConfig
from lowlat.plugin.binding import KVPoolNotReady, PluginBinding, PluginForward, rope_tables
from lowlat.runtime.plugin_host.discovery import PluginInfo, PluginRegistry, discover
from lowlat.errors import (
    IncompatibleCoreVersion,
    LowlatPluginError,
    PluginBuildError,
    PluginLoadError,
    PluginNotFound,
    PluginStepError,
    SpecError,
    UnsupportedConfiguration,
)
from lowlat.runtime.plugin_host.guard import GuardTrace, RequirementResult, evaluate
from lowlat.plugin.hookspecs import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, hookimpl, hookspec
from lowlat.plugin.params import LayerParams, ModelParams, bind_params
from lowlat.plugin.reference_step import STAGES, LayerWeights, ReferenceStep
from lowlat.runtime.plugin_host.selection import Selection, select_plugin
from lowlat.plugin.spec import Coverage, ModelSpec, PlatformRequirement, Requirements, spec_from_mapping
from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.kv_cache import KVPool

__all__ = [
    "Coverage",
    "ENTRY_POINT_GROUP",
    "EngineConfig",
    "ForwardBatch",
    "ForwardMode",
    "GuardTrace",
    "IncompatibleCoreVersion",
    "KVPool",
    "KVPoolNotReady",
    "LayerParams",
    "LayerWeights",
    "LowlatPluginError",
    "ModelConfig",
    "ModelParams",
    "ModelSpec",
    "PLUGIN_API_VERSION",
    "PlatformRequirement",
    "PluginBinding",
    "PluginBuildError",
    "PluginForward",
    "PluginInfo",
    "PluginLoadError",
    "PluginNotFound",
    "PluginRegistry",
    "PluginStepError",
    "ReferenceStep",
    "RequirementResult",
    "Requirements",
    "STAGES",
    "Selection",
    "SpecError",
    "UnsupportedConfiguration",
    "bind_params",
    "discover",
    "evaluate",
    "hookimpl",
    "hookspec",
    "rope_tables",
    "select_plugin",
    "spec_from_mapping",
]
