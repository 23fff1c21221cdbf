"""The dispatcher: each step goes to the plugin forward or the general forward.

A step takes the plugin path when its mode and token count are inside the spec's coverage and the
plugin's ``supports(batch)`` agrees; under tensor parallelism every rank takes the same path (a MIN
all-reduce of the flag: if one rank cannot, none does). A plugin that raises, returns the wrong shape
or dtype, or returns non-finite logits is a PluginStepError naming it: never a silent retry elsewhere.
CUDA graphs call ``choose`` once per captured shape, record the path, and replay without Python dispatch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lowlat.plugin.binding import PluginForward
from lowlat.plugin.errors import PluginStepError
from lowlat.plugin.spec import Coverage
from lowlat.runtime.forward_batch import ForwardBatch, ForwardMode

PLUGIN, GENERAL = "plugin", "general"


@dataclass
class PathStats:
    """Steps served per (path, mode), eager and replayed (step times live in the engine's StepStats)."""

    steps: dict[tuple[str, ForwardMode], int] = field(default_factory=lambda: defaultdict(int))

    def record(self, path: str, mode: ForwardMode) -> None:
        self.steps[(path, mode)] += 1


class Dispatcher:
    """Routes steps between a plugin's forward and the general forward.

    Args:
        plugin: the plugin's name (for errors and reports).
        coverage: the spec's coverage.
        plugin_forward: what the plugin's build returned.
        general_forward: ``fn(batch) -> float32 logits [R, V]``, the general path.
        vocab_size: V, for output checks.
        tp_size: tensor-parallel ranks; above 1 the ranks agree on the path per step.
        tp_group: the tensor-parallel process group (None is torch.distributed's default group).
        check_outputs: verify shape, dtype and finiteness of plugin outputs on eager steps (one host sync).
    """

    def __init__(
        self,
        *,
        plugin: str,
        coverage: Coverage,
        plugin_forward: PluginForward,
        general_forward: Callable[[ForwardBatch], torch.Tensor],
        vocab_size: int,
        tp_size: int = 1,
        tp_group: Any = None,
        check_outputs: bool = True,
    ) -> None:
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
        self.last_path: str | None = None

    def choose(self, batch: ForwardBatch) -> str:
        """The path for this step ("plugin" or "general"), agreed across TP ranks."""
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

    def _supports(self, batch: ForwardBatch) -> bool:
        try:
            return self.plugin_forward.supports(batch)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit from plugin code is contained
            raise PluginStepError(f"plugin {self.plugin!r} raised in supports() for a {_describe(batch)}: "
                                  f"{type(e).__name__}: {e}") from e

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """Choose the path and run it (eager steps)."""
        return self.run(self.choose(batch), batch, check=self.check_outputs)

    def run(self, path: str, batch: ForwardBatch, *, check: bool = False, record: bool = True) -> torch.Tensor:
        """Run ``path`` for ``batch``; plugin errors become PluginStepError. ``record`` counts the step."""
        self.last_path = path
        if record:
            self.stats.record(path, batch.forward_mode)
        if path == GENERAL:
            return self.general_forward(batch)
        try:
            out = self.plugin_forward.forward(batch)
        except (PluginStepError, KeyboardInterrupt):
            raise
        except BaseException as e:  # SystemExit from plugin code is contained
            raise PluginStepError(f"plugin {self.plugin!r} failed during a {_describe(batch)}: "
                                  f"{type(e).__name__}: {e}") from e
        self.check_shape(out, batch)
        if check:
            self.check_finite(out, batch)
        return out

    def check_shape(self, out: Any, batch: ForwardBatch) -> None:
        """Raise PluginStepError unless ``out`` is float32 [R, V] on the batch's device."""
        want = (batch.num_logit_rows, self.vocab_size)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != torch.float32:
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise PluginStepError(f"plugin {self.plugin!r} returned {got} for a {_describe(batch)}; "
                                  f"the contract is float32 logits of shape {want}")

    def check_finite(self, out: torch.Tensor, batch: ForwardBatch) -> None:
        """Raise PluginStepError when plugin logits hold NaN or inf (one host sync)."""
        if not bool(torch.isfinite(out).all()):
            raise PluginStepError(f"plugin {self.plugin!r} returned non-finite logits for a {_describe(batch)}; "
                                  f"the engine stopped rather than serve them")


def _describe(batch: ForwardBatch) -> str:
    return f"{batch.forward_mode.name} step of {batch.num_tokens} tokens over {batch.batch_size} requests"
