"""CUDA graphs emulated on CPU: a CudaGraphRunner whose every key "replays" the eager forward on its fixed buffers.

The input copies, padding, key lookup and replay hooks run as on a GPU; only the replay itself is the eager
forward (test_runtime_overlap.py, test_host_inputs.py).
"""

from __future__ import annotations

from typing import Any

from lowlat.runtime.cuda_graph_runner import CudaGraphRunner


class EagerGraph:
    """A CUDAGraph stand-in on CPU: replay reruns the forward on the static (fixed-buffer) batch."""

    def __init__(self, forward_fn: Any, batch: Any, out: Any) -> None:
        self.forward_fn, self.batch, self.out = forward_fn, batch, out

    def replay(self) -> None:
        self.out.copy_(self.forward_fn(self.batch))


def emulated_graphs(runner: Any, max_batch_size: int, max_verify_tokens: int) -> CudaGraphRunner:
    """A CudaGraphRunner over ``runner``'s step inputs with every key "captured" as an EagerGraph; installed as
    ``runner.graph_runner`` (the caller sets it back to None)."""
    graphs = CudaGraphRunner(device=runner.device, dummy_row=runner.dummy_row, max_batch_size=max_batch_size,
                             max_verify_tokens=max_verify_tokens, vocab_size=runner.model_config.vocab_size,
                             inputs=runner.step_inputs)
    for key in graphs.keys():
        batch = graphs._fill_dummy(key)
        out = runner.forward_fn(batch).clone()
        graphs.graphs[key] = EagerGraph(runner.forward_fn, batch, out)
        graphs.outputs[key] = out
    runner.graph_runner = graphs
    return graphs
