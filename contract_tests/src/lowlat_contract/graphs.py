"""CUDA graphs of one dispatcher path, for the graph-execution and performance contracts (CUDA only).

``PathGraphs(runner, path, shapes)`` captures ``dispatcher.run(path, batch)`` for exactly the given shapes with
core's ``CudaGraphRunner`` (fixed input buffers, padding rows on the pool's dummy row, one memory pool), calling
the plugin's ``prepare_for_capture(batch)`` / ``prepare_for_replay(batch)`` hooks when it has them, as the
runtime does. Two of them (plugin and general) on one runner time both paths side by side.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from lowlat.runtime.cuda_graph_runner import CudaGraphRunner, GraphKey

from lowlat_contract.harness import StepShape, dispatcher_of


class PathGraphs(CudaGraphRunner):
    """CUDA graphs of ``path`` ("plugin" or "general") for ``shapes`` (StepShapes) of ``runner``'s steps."""

    def __init__(self, runner: Any, path: str, shapes: list[StepShape]) -> None:
        super().__init__(device=runner.device, dummy_row=runner.dummy_row,
                         max_batch_size=max(s.batch_size for s in shapes),
                         max_verify_tokens=max(s.tokens_per_req for s in shapes),
                         vocab_size=runner.model_config.vocab_size)
        self._keys = [GraphKey(s.mode, s.batch_size, s.tokens_per_req) for s in shapes]
        d = dispatcher_of(runner)
        plugin = d.plugin_forward
        if path == "plugin":
            if hasattr(plugin, "prepare_for_capture"):
                self.capture_hooks.append(lambda key, batch: plugin.prepare_for_capture(batch))
            if hasattr(plugin, "prepare_for_replay"):
                self.replay_hooks.append(lambda key, batch: plugin.prepare_for_replay(batch))
        with torch.inference_mode():
            self.capture(lambda batch: d.run(path, batch))

    def keys(self) -> list[GraphKey]:
        """Only the shapes asked for, largest first (so smaller captures reuse the first one's memory)."""
        return sorted(self._keys, key=lambda k: (k.num_tokens, k.batch_size), reverse=True)


def replay_times_ms(graphs: PathGraphs, batch: Any, replays: int) -> list[float]:
    """Milliseconds of each of ``replays`` replays of ``batch`` (CUDA events around each replay call)."""
    out = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.replay(batch)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def side_by_side_ms(plugin: PathGraphs, general: PathGraphs, batch: Any, *, rounds: int = 5, replays: int = 20,
                    warmup: int = 3) -> tuple[float, float]:
    """(plugin median ms, general median ms): interleaved rounds of replays of the same batch, warm-up excluded."""
    with torch.inference_mode():
        replay_times_ms(plugin, batch, warmup)
        replay_times_ms(general, batch, warmup)
        p: list[float] = []
        g: list[float] = []
        for _ in range(rounds):
            p += replay_times_ms(plugin, batch, replays)
            g += replay_times_ms(general, batch, replays)
    return statistics.median(p), statistics.median(g)
