"""Errors of the plugin interface. Every message names the plugin and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lowlat.plugin.guard import GuardTrace


class LowlatPluginError(RuntimeError):
    """Base class of every plugin error."""


class PluginNotFound(LowlatPluginError):
    """An explicitly requested plugin (or an allowlisted name) matches no installed plugin."""


class PluginLoadError(LowlatPluginError):
    """A plugin is installed but broken: its import raised, its hooks are invalid or a spec is malformed."""


class IncompatibleCoreVersion(LowlatPluginError):
    """A plugin's declared core range (its Requires-Dist on lowlat) excludes the running core."""


class SpecError(ValueError):
    """A ModelSpec is malformed (unknown field, empty coverage, unknown platform or mode)."""


class UnsupportedConfiguration(LowlatPluginError):
    """A plugin was asked for explicitly but its guard fails; ``trace`` holds every requirement's result."""

    def __init__(self, message: str, trace: GuardTrace | None = None) -> None:
        super().__init__(message)
        self.trace = trace


class PluginBuildError(LowlatPluginError):
    """A plugin's build raised or asked for more memory than is left."""


class PluginStepError(LowlatPluginError):
    """A plugin failed during a step (raised, returned a bad shape or dtype, or produced NaN)."""


class RankDisagreement(LowlatPluginError):
    """Tensor-parallel ranks did not reach the same plugin decision; raised on every rank with each one's reason."""


class PluginModifiedParameters(PluginBuildError):
    """A plugin changed the general model's parameters in place (they are read-only to plugins); never falls back."""
