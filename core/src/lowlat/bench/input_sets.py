"""A bench row's input sets, fed to the runner through the engine's own input path.

``input_sets`` gives each of ``cfg.input_sets`` batches its own requests (so its own KV pages), ``context`` cached
positions per request, its own new-token slots and random token ids. Where the runner has preallocated step inputs
(``ModelRunner.step_inputs``, the buffers its CUDA graphs read) and the shape fits them, each set is built once by
a ``BatchBuilder``, as the scheduler builds every DECODE and VERIFY step, and its packed host mirror is kept. A timed
step (``InputSets.step``) then does on the device what an engine step does before the replay: one host->device copy
of the packed inputs and one ``index_copy_`` of the new KV slots into ``req_to_token``
(``lowlat.runtime.step_inputs``). A set that does not fit is a standalone batch, which ``CudaGraphRunner.replay``
copies into the graph's buffers field by field.

Before 2026-12-07 every bench step took that field-by-field copy: five copies and two fills ahead of the replay, which
no engine step runs (docs/benchmarks.md, "What a timed step is").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from lowlat.bench.config import BenchConfig, Shape
from lowlat.forward_batch import ForwardBatch
from lowlat.runtime.step_inputs import BatchBuilder, StepInputs

FED_BUILT, FED_COPIED = "built", "copied"


@dataclass
class InputSets:
    """The input sets of one bench row.

    Attributes:
        batches: one ForwardBatch per set with tensors of its own (never aliasing the step inputs): for the eager
            passes (launch counts, MoE routing), which may run after other sets were fed.
        rows: the ``req_to_token`` rows the sets hold (``free_rows`` returns them).
        fed: "built" (``step`` restores a set into the runner's step inputs: the engine's path) or "copied".
    """

    batches: list[ForwardBatch]
    rows: list[int]
    fed: str
    _step: Callable[[int], ForwardBatch]

    def step(self, i: int) -> ForwardBatch:
        """The batch of step ``i`` (set ``i mod n``), its inputs in place for ``runner.forward``.

        With ``fed == "built"`` this issues the engine's per-step device work (the packed upload, the KV slot write)
        on the current stream, and the returned batch aliases the step inputs until the next ``step``.
        """
        return self._step(i)


def input_sets(runner: object, shape: Shape, cfg: BenchConfig, seed: int) -> InputSets:
    """``cfg.input_sets`` batches of ``shape`` on fresh requests holding ``context`` cached tokens each.

    Raises:
        KVPoolExhausted / ValueError: the pool cannot hold the sets (``engine_config`` sizes it for them).
    """
    pool = runner.kv_pool  # type: ignore[attr-defined]
    vocab = runner.model_config.vocab_size  # type: ignore[attr-defined]
    inputs: StepInputs | None = getattr(runner, "step_inputs", None)
    gen = torch.Generator().manual_seed(seed)
    b, tpr = shape.batch_size, shape.tokens_per_req
    builder = BatchBuilder(pool, inputs) if inputs is not None else None
    built = builder is not None and builder.fits(b, tpr)
    batches: list[ForwardBatch] = []
    mirrors: list[torch.Tensor] = []
    view: ForwardBatch | None = None  # every set's batch: the same views of the step inputs (same shape)
    all_rows: list[int] = []
    for _ in range(cfg.input_sets):
        rows = [pool.alloc_req() for _ in range(b)]
        all_rows += rows
        for r in rows:
            pool.alloc_slots(r, cfg.context)
        tokens = torch.randint(0, vocab, (b, tpr), generator=gen).tolist()
        if not built:
            batches.append(runner.prepare_batch(shape.mode, rows, [cfg.context] * b, tokens))  # type: ignore
            continue
        view = builder.build(shape.mode, rows, [cfg.context] * b, [t for row in tokens for t in row], tpr)
        inputs.wait_host()  # the mirror is final once its upload has read it
        mirrors.append(inputs.host_buffer.clone())
        batches.append(_standalone(view))
    if not built:
        return InputSets(batches, all_rows, FED_COPIED, lambda i: batches[i % len(batches)])
    kv = (inputs.kv_index[:b * tpr], inputs.kv_slot[:b * tpr])

    def step(i: int) -> ForwardBatch:
        inputs.wait_host()
        inputs.host_buffer.copy_(mirrors[i % len(mirrors)])
        inputs.upload()
        inputs.layout = (b, tpr)
        pool.write_slots(*kv)
        return view

    return InputSets(batches, all_rows, FED_BUILT, step)


def _standalone(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` with each tensor cloned, so it stays valid after the step inputs are rebuilt."""
    names = ("input_ids", "positions", "seq_lens", "req_pool_indices", "out_cache_loc", "extend_lens",
             "extend_start_loc")
    return replace(batch, **{n: getattr(batch, n).clone() for n in names})


def free_rows(runner: object, rows: list[int]) -> None:
    """Return request rows (and their KV pages) to the runner's pool."""
    for r in rows:
        runner.kv_pool.free_req(r)  # type: ignore[attr-defined]
