"""The Dispatcher: each step goes to the plugin forward or the general forward. Always installed.

A ModelRunner holds one Dispatcher from start to close; with no plugin it sends every step to the general
forward. It owns the path state: ``last_path`` (the latest step's path), ``graph_paths`` (the path recorded per
captured CUDA-graph shape) and ``stats`` (steps per path and mode). A step takes the plugin path when its mode
and token count are inside the spec's coverage and the plugin's ``supports(batch)`` agrees; under tensor
parallelism every rank takes the same path (a MIN all-reduce of the flag: if one rank cannot, none does). A
plugin that raises, returns the wrong shape or dtype, or returns non-finite logits is a PluginStepError naming
it: never a silent retry elsewhere. Graph capture asks ``function_for(key, batch)`` once per captured shape
(the path is chosen there, TP ranks agree there) and each replay reports to ``replayed(key, batch)``, so
replays run without Python dispatch.

Sampled ids (plugin API 3): a step whose batch ``wants_ids`` gets int64 ids [R] from the plugin path when the
spec's ``coverage.sampling`` covers its ``SamplingInfo`` (``serves_ids``); otherwise (the general path, or
parameters outside that coverage) the step returns logits and the caller samples. A plugin that is not asked
for ids sees ``logits_required=True``. Ids are checked for dtype and shape; on eager steps (``check_outputs``)
also for range, a -1 (the plugin's "non-finite logits" flag) being a PluginStepError as non-finite logits are.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from lowlat.errors import PluginStepError
from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.plugin.binding import PluginForward
from lowlat.plugin.spec import Coverage

PLUGIN, GENERAL = "plugin", "general"
ForwardFn = Callable[[ForwardBatch], torch.Tensor]


@dataclass
class PathStats:
    """Steps served per (path, mode), eager and replayed (step times live in the engine's StepStats)."""

    steps: dict[tuple[str, ForwardMode], int] = field(default_factory=lambda: defaultdict(int))

    def record(self, path: str, mode: ForwardMode) -> None:
        self.steps[(path, mode)] += 1


class Dispatcher:
    """Routes steps between a plugin's forward (when one is installed) and the general forward.

    Args:
        general_forward: ``fn(batch) -> float32 logits [R, V]``, the general path.
        vocab_size: V, for output checks.
        plugin: the plugin's name (for errors and reports); None: no plugin, every step is general.
        coverage: the spec's coverage (with a plugin).
        plugin_forward: what the plugin's build returned (with a plugin).
        tp_size: tensor-parallel ranks; above 1 the ranks agree on the path per step.
        tp_group: the process group of that agreement (None is torch.distributed's default group).
        check_outputs: verify shape, dtype and finiteness of plugin outputs on eager steps (one host sync).
    """

    def __init__(self, *, general_forward: ForwardFn, vocab_size: int, plugin: str | None = None,
                 coverage: Coverage | None = None, plugin_forward: PluginForward | None = None, tp_size: int = 1,
                 tp_group: Any = None, check_outputs: bool = True) -> None:
        if (plugin is None) != (plugin_forward is None) or (plugin_forward is not None and coverage is None):
            raise ValueError("a Dispatcher takes plugin, coverage and plugin_forward together, or none of them")
        self.plugin = plugin
        self.coverage = coverage
        self.plugin_forward = plugin_forward
        self.general_forward = general_forward
        self.vocab_size = vocab_size
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.check_outputs = check_outputs
        self.stats = PathStats()
        self.force_path: Callable[[ForwardBatch], str | None] | None = None  # tests force a path per step
        # Raises the precise cause of non-finite plugin output when there is one (the plugin's cross-rank waits:
        # PluginHost.check_peers, plugin API 4), called before the PluginStepError below.
        self.explain_nonfinite: Callable[[], None] | None = None
        self.last_path: str | None = None
        self.graph_paths: dict[Any, str] = {}

    @property
    def has_plugin(self) -> bool:
        return self.plugin_forward is not None

    def choose(self, batch: ForwardBatch) -> str:
        """The path for this step ("plugin" or "general"), agreed across TP ranks when a plugin is installed."""
        if self.plugin_forward is None:
            return GENERAL
        forced = self.force_path(batch) if self.force_path else None
        if forced is not None:
            ok = forced == PLUGIN
        else:
            ok = self.coverage.covers(batch.forward_mode, batch.num_tokens) and bool(self._supports(batch))
        if self.tp_size > 1:
            backend = str(dist.get_backend(self.tp_group))
            flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device="cpu" if "gloo" in backend else "cuda")
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.tp_group)
            ok = bool(flag.item())
        return PLUGIN if ok else GENERAL

    @property
    def samples(self) -> bool:
        """Whether the installed plugin's coverage declares sampled ids (``Coverage.sampling``), at tp_size 1 only:
        under TP every rank holds a vocabulary shard of the LM head, so its steps return gathered logits and the
        engine samples (one rank's ids would come from its shard alone)."""
        return self.coverage is not None and self.coverage.sampling is not None and self.tp_size == 1

    def serves_ids(self, batch: ForwardBatch, path: str = PLUGIN) -> bool:
        """Whether ``path`` returns sampled ids for ``batch``: the plugin path, the batch ``wants_ids`` and the
        spec's ``coverage.sampling`` covers its mode and SamplingInfo (host-side values only)."""
        if path != PLUGIN or not self.samples or not getattr(batch, "wants_ids", False):
            return False
        return self.coverage.sampling.covers(batch.forward_mode, batch.sampling)  # type: ignore[union-attr, arg-type]

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """Choose the path and run it (an eager step): float32 logits [R, V], or int64 ids [R] (``serves_ids``)."""
        return self.run(self.choose(batch), batch, check=self.check_outputs)

    def run(self, path: str, batch: ForwardBatch, *, check: bool = False, record: bool = True) -> torch.Tensor:
        """Run ``path`` for ``batch``; plugin errors become PluginStepError. ``record`` counts the step.

        Returns float32 logits [R, V], or int64 ids [R] when ``serves_ids(batch, path)``."""
        self.last_path = path
        if record:
            self.stats.record(path, batch.forward_mode)
        if path == GENERAL:
            return self.general_forward(batch)
        if self.plugin_forward is None:
            raise ValueError("the plugin path was asked for, but no plugin is installed")
        ids = self.serves_ids(batch, path)
        if not ids and getattr(batch, "wants_ids", False):  # outside coverage.sampling: ask the plugin for logits
            batch = replace(batch, logits_required=True)
        try:
            out = self.plugin_forward.forward(batch)
        except (PluginStepError, KeyboardInterrupt):
            raise
        except BaseException as e:  # SystemExit from plugin code is contained
            raise PluginStepError(f"plugin {self.plugin!r} failed during a {_describe(batch)}: "
                                  f"{type(e).__name__}: {e}") from e
        if ids:
            self.check_ids_shape(out, batch)
            if check:
                self.check_ids(out, batch)
            return out
        self.check_shape(out, batch)
        if check:
            self.check_finite(out, batch)
        return out

    # -- CUDA graphs -----------------------------------------------------------------------------------------

    def function_for(self, key: Any, batch: ForwardBatch) -> ForwardFn:
        """The function a CUDA graph of shape ``key`` captures: the path chosen now for ``batch`` (its static
        batch), recorded in ``graph_paths``; runs the plugin's ``prepare_for_capture`` for a plugin shape.
        A static batch that ``wants_ids`` (an ids graph, ``ids_variants``) captures the plugin's ids."""
        path = self.graph_paths[key] = self.choose(batch)
        if path == PLUGIN and hasattr(self.plugin_forward, "prepare_for_capture"):
            self.plugin_forward.prepare_for_capture(batch)  # type: ignore[union-attr]
        return lambda b: self.run(path, b, record=False)

    def ids_variants(self, key: Any) -> tuple[str, ...]:
        """The ``SamplingInfo.variant`` values to capture an ids graph for, beside the logits graph of ``key``
        (captured before): those of ``coverage.sampling`` when that graph took the plugin path in a sampled mode."""
        if not self.samples or self.graph_paths.get(key) != PLUGIN:
            return ()
        sc = self.coverage.sampling  # type: ignore[union-attr]
        return sc.variants() if key.mode in sc.modes else ()

    def replayed(self, key: Any, batch: ForwardBatch) -> None:
        """A graph of shape ``key`` is about to replay ``batch``: count it, and run ``prepare_for_replay``."""
        path = self.graph_paths.get(key, GENERAL)
        self.last_path = path
        self.stats.record(path, batch.forward_mode)
        if path == PLUGIN and hasattr(self.plugin_forward, "prepare_for_replay"):
            self.plugin_forward.prepare_for_replay(batch)  # type: ignore[union-attr]

    # -- checks ----------------------------------------------------------------------------------------------

    def _supports(self, batch: ForwardBatch) -> bool:
        try:
            return self.plugin_forward.supports(batch)  # type: ignore[union-attr]
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit from plugin code is contained
            raise PluginStepError(f"plugin {self.plugin!r} raised in supports() for a {_describe(batch)}: "
                                  f"{type(e).__name__}: {e}") from e

    def check_shape(self, out: Any, batch: ForwardBatch) -> None:
        """Raise PluginStepError unless ``out`` is float32 [R, V] on the batch's device."""
        want = (batch.num_logit_rows, self.vocab_size)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != torch.float32:
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise PluginStepError(f"plugin {self.plugin!r} returned {got} for a {_describe(batch)}; "
                                  f"the contract is float32 logits of shape {want}")

    def check_ids_shape(self, out: Any, batch: ForwardBatch) -> None:
        """Raise PluginStepError unless ``out`` is int64 ids [R] (a step that asked for sampled ids)."""
        want = (batch.num_logit_rows,)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != torch.int64:
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise PluginStepError(f"plugin {self.plugin!r} returned {got} for a {_describe(batch)} that asked for "
                                  f"sampled ids; the contract is int64 ids of shape {want}")

    def check_ids(self, out: torch.Tensor, batch: ForwardBatch) -> None:
        """Raise PluginStepError when an id is -1 (non-finite logits) or outside [0, vocab) (one host sync)."""
        lo, hi = (int(v) for v in torch.stack((out.min(), out.max())).tolist())
        if lo < 0 or hi >= self.vocab_size:
            if lo == -1 and self.explain_nonfinite is not None:
                self.explain_nonfinite()
            what = "flagged non-finite logits (id -1)" if lo == -1 else f"returned ids in [{lo}, {hi}]"
            raise PluginStepError(f"plugin {self.plugin!r} {what} for a {_describe(batch)}; ids must lie in "
                                  f"[0, {self.vocab_size}); the engine stopped rather than serve them")

    def check_finite(self, out: torch.Tensor, batch: ForwardBatch) -> None:
        """Raise PluginStepError when plugin logits hold NaN or inf (one host sync)."""
        if not bool(torch.isfinite(out).all()):
            if self.explain_nonfinite is not None:
                self.explain_nonfinite()  # e.g. PeerWaitTimeout naming the rank that never published
            raise PluginStepError(f"plugin {self.plugin!r} returned non-finite logits for a {_describe(batch)}; "
                                  f"the engine stopped rather than serve them")


def _describe(batch: ForwardBatch) -> str:
    return f"{batch.forward_mode.name} step of {batch.num_tokens} tokens over {batch.batch_size} requests"
