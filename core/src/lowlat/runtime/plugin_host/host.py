"""PluginHost: the plugin stages of one ModelRunner, in DESIGN §4's order.

``PluginHost.select`` runs before any weight loads (discover -> guard); ``build`` runs after load
(check_model -> build with a PluginBinding -> release retained checkpoint tensors) and returns the
Dispatcher; ``attach_kv_pool`` publishes the pool once it is sized. Explicit requests never fall back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from lowlat import fast_interpreter
from lowlat.config import EngineConfig, ModelConfig
from lowlat.distributed import TPInfo
from lowlat.errors import LowlatPluginError, PluginBuildError, PluginModifiedParameters
from lowlat.platform import Platform, detect_platform, triton_interpreter_enabled
from lowlat.plugin.binding import PluginBinding, PluginForward
from lowlat.runtime.dispatch import Dispatcher
from lowlat.runtime.peer_reduce import peer_factory
from lowlat.runtime.plugin_host.agreement import agree_build, build_failure_text
from lowlat.runtime.plugin_host.discovery import discover, load_callable
from lowlat.runtime.plugin_host.param_guard import changed, fingerprint
from lowlat.runtime.plugin_host.selection import Selection, auto_candidates, select_plugin

log = logging.getLogger("lowlat.plugin")


class PluginHost:
    """Owns the selection, binding and dispatcher of one rank.

    Attributes:
        selection: the chosen plugin and its passing trace, or None (general path only).
        rejections: for "auto", one line per plugin skipped and why.
        binding: the PluginBinding handed to build (after ``build``).
        dispatcher: the Dispatcher built around the plugin (after ``build``), which the ModelRunner installs; the
            path state (latest path, paths of captured graphs, counters) lives in it, not here.
    """

    def __init__(self, selection: Selection | None, rejections: list[str] | None = None,
                 candidates: list[Selection] | None = None) -> None:
        self.selection = selection
        self.candidates = candidates if candidates is not None else ([selection] if selection else [])
        self.rejections = rejections or []
        self.binding: PluginBinding | None = None
        self.dispatcher: Dispatcher | None = None
        self._retained: dict[str, torch.Tensor] = {}

    @classmethod
    def select(cls, engine: EngineConfig, model: ModelConfig, platform: Platform | None = None) -> PluginHost:
        """Discover plugins and run the guard, before any weight loads.

        Raises:
            PluginNotFound, PluginLoadError, IncompatibleCoreVersion, UnsupportedConfiguration: for an
            explicit plugin name that cannot serve this configuration.
        """
        if engine.plugin == "none":
            return cls(None)
        platform = platform or detect_platform(engine.resolved_device)
        rejections: list[str] = []
        if engine.plugin == "auto":
            candidates = auto_candidates(discover(), platform, engine, model, rejections)
        else:
            one = select_plugin(discover(), engine.plugin, platform, engine, model, rejections)
            candidates = [one] if one is not None else []
        selection = candidates[0] if candidates else None
        if selection is not None:
            log.info("plugin %s selected: %s", selection.plugin.name, selection.reason)
        return cls(selection, rejections, candidates)

    @property
    def name(self) -> str | None:
        return self.selection.plugin.name if self.selection else None

    def describe(self, request: str) -> dict[str, Any]:
        """Which path serves the model, as ``lowlat run`` and ``lowlat serve`` print it (and /v1/models lists it).

        Args:
            request: the ``EngineConfig.plugin`` asked for (auto, none or a name).
        Returns:
            ``plugin``: the chosen plugin's name, None for the general path; ``summary``: one line, ``plugin NAME
            (DIST VERSION): why`` or ``plugin: none (REQUEST: every step on the general path)``; ``skipped``: for
            auto, one ``NAME: why`` per plugin it passed over (guard failing, unusable, failed to build).
        """
        sel = self.selection
        summary = (f"plugin {sel.plugin.name} ({sel.plugin.distribution} {sel.plugin.version}): {sel.reason}" if sel
                   else f"plugin: none ({request}: every step on the general path)")
        return {"plugin": self.name, "summary": summary, "skipped": list(self.rejections)}

    def retain(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass checkpoint tensors through, keeping a reference when the spec asks to retain them."""
        keep = self.selection is not None and self.selection.spec.retain_checkpoint
        for name, tensor in weights:
            if keep:
                self._retained[name] = tensor
            yield name, tensor

    def build(self, *, model: torch.nn.Module, engine: EngineConfig, model_config: ModelConfig,
              device: torch.device, dtype: torch.dtype, tp_rank: int, tp_size: int, tp_group: object,
              agree_group: object = None,
              general_forward, workspace_budget_bytes: int | None) -> Dispatcher | None:  # type: ignore[no-untyped-def]
        """check_model, then build the plugin and wrap it in a Dispatcher.

        ``tp_group`` goes to the binding (collectives on device tensors); ``agree_group`` (default: the same)
        carries the dispatcher's per-step agreement on a host tensor.

        Under tensor parallelism the ranks agree on each outcome (``lowlat.runtime.plugin_host.agreement``): a
        build that failed on one rank failed on all. ``auto`` tries its candidates in order, the next when one fails.

        Returns:
            The Dispatcher, or None when no plugin was selected — or, for ``plugin="auto"``, when every candidate
            failed to import or build (logged and recorded in ``rejections``; the general path serves).
        Raises:
            PluginBuildError / PluginLoadError: for an explicitly named plugin whose check_model or build raised
                (on any rank), returned something that is not a PluginForward, or allocated more than the memory left.
            PluginModifiedParameters: a plugin changed the general model's parameters in place (even for auto:
                the general path could no longer be trusted).
        """
        if self.selection is None:
            return None
        explicit = engine.plugin != "auto"
        tried: list[str] = []
        for sel in [self.selection] if explicit else list(self.candidates):
            self.selection = dataclasses.replace(sel, reason=sel.reason + (
                f" (tried after {', '.join(tried)} failed to build)" if tried else ""))
            err: BaseException | None = None
            try:
                self._build(model=model, engine=engine, model_config=model_config, device=device, dtype=dtype,
                            tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, agree_group=agree_group,
                            general_forward=general_forward, workspace_budget_bytes=workspace_budget_bytes)
            except LowlatPluginError as e:
                err = e
            reports = agree_build(sel.plugin.name, err, isinstance(err, PluginModifiedParameters), tp_size=tp_size,
                                  group=agree_group if agree_group is not None else tp_group)
            if reports is None:
                return self.dispatcher
            self.close()
            self.binding, self.dispatcher = None, None
            text = build_failure_text(sel.plugin.name, reports)
            if explicit or any(r["fatal"] for r in reports):  # an explicit request, or the model is corrupted
                if err is not None and tp_size == 1:
                    raise err
                cls = PluginModifiedParameters if any(r["fatal"] for r in reports) else PluginBuildError
                raise cls(f"plugin {sel.plugin.name!r} failed to build{text}; every rank stops") from err
            tried.append(sel.plugin.name)
            self.rejections.append(f"{sel.plugin.name}: its guard passed but build failed{text}")
            log.warning("auto: plugin %s could not be built%s; %s", sel.plugin.name, text,
                        "trying the next candidate" if sel is not self.candidates[-1]
                        else "every step takes the general path")
        self.selection = None
        return None

    def _build(self, *, model: torch.nn.Module, engine: EngineConfig, model_config: ModelConfig,
               device: torch.device, dtype: torch.dtype, tp_rank: int, tp_size: int, tp_group: object,
               agree_group: object, general_forward, workspace_budget_bytes: int | None  # type: ignore[no-untyped-def]
               ) -> Dispatcher:
        assert self.selection is not None
        name, spec = self.selection.plugin.name, self.selection.spec
        self.binding = PluginBinding(
            plugin=name, model_config=model_config, engine_config=engine, device=device, dtype=dtype,
            params=dict(model.named_parameters(remove_duplicate=False)), tp_rank=tp_rank, tp_size=tp_size,
            tp_group=tp_group, checkpoint_tensors=self._retained, workspace_budget_bytes=workspace_budget_bytes,
            peer_factory=peer_factory(TPInfo(tp_rank, tp_size, tp_group), engine, device) if tp_size > 1 else None)
        before = fingerprint(self.binding.params)
        if triton_interpreter_enabled():  # the plugin's kernels are about to run interpreted: at half the cost
            fast_interpreter.install()
        try:
            if spec.check_model:
                load_callable(spec.check_model, name)(self.binding)
            forward = load_callable(spec.build, name)(self.binding)
        except LowlatPluginError:
            raise
        except torch.OutOfMemoryError as e:
            raise PluginBuildError(f"plugin {name!r} ran out of device memory during build: {e}; lower "
                                   f"max_batch_size/max_context_len or use --plugin none") from e
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # sys.exit() in build is contained too
            raise PluginBuildError(f"plugin {name!r} failed to build for {model_config.architecture}: "
                                   f"{type(e).__name__}: {e}") from e
        finally:
            self.binding.release_checkpoint()
            self._retained = {}
            self._check_unchanged(name, before)
        if not isinstance(forward, PluginForward):
            raise PluginBuildError(f"plugin {name!r}: build returned {type(forward).__name__}, which lacks "
                                   f"supports(batch) and forward(batch)")
        self.dispatcher = Dispatcher(plugin=name, coverage=spec.coverage, plugin_forward=forward,
                                     general_forward=general_forward, vocab_size=model_config.vocab_size,
                                     tp_size=tp_size, tp_group=agree_group if agree_group is not None else tp_group)
        if self.binding.peers:
            self.dispatcher.explain_nonfinite = self.check_peers
        return self.dispatcher

    def _check_unchanged(self, name: str, before: dict[str, tuple[int, int]]) -> None:
        """Raise PluginModifiedParameters when check_model/build changed a parameter (even if build raised)."""
        assert self.binding is not None
        edited = changed(before, self.binding.params)
        if edited:
            raise PluginModifiedParameters(
                f"plugin {name!r} changed {len(edited)} parameter(s) of the general model in place during "
                f"check_model/build: {', '.join(edited[:5])}{' ...' if len(edited) > 5 else ''}; parameters are "
                "read-only to plugins (copy them into alloc_workspace buffers to transform them). The engine "
                "does not start, since the general path would use the changed weights: fix the plugin or use "
                "--plugin none")

    def check_peers(self) -> None:
        """Raise ``PeerWaitTimeout`` when a cross-rank wait of the plugin's kernels gave up (plugin API 4: reads
        the error record of every ``binding.peer_buffers``; a host sync, so the engine calls it after a step)."""
        for bufs in self.binding.peers if self.binding is not None else ():
            if not bufs.closed:
                bufs.check()

    def close(self) -> None:
        """Close the plugin's peer buffers (idempotent; their peers' mappings are released)."""
        for bufs in self.binding.peers if self.binding is not None else ():
            bufs.close()

    def attach_kv_pool(self, kv_pool: object) -> None:
        """Publish the sized KV pool to the plugin (runs its on_kv_pool_ready callbacks)."""
        if self.binding is not None:
            try:
                self.binding.attach_kv_pool(kv_pool)
            except (LowlatPluginError, KeyboardInterrupt):
                raise
            except BaseException as e:
                raise PluginBuildError(f"plugin {self.name!r} failed when the KV pool became ready: "
                                       f"{type(e).__name__}: {e}") from e
