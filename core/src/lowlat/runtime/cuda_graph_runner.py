"""CUDA graphs for DECODE and VERIFY steps.

After SGLang's ``CudaGraphRunner`` (python/sglang/srt/model_executor/cuda_graph_runner.py): each captured
shape is a (mode, padded batch size, tokens per request) key; inputs are copied into fixed buffers, rows
beyond the real batch are padding that points at the KV pool's dummy request row (whose ``req_to_token``
entries are all slot 0) and writes its K/V to the dummy slot 0, the graph is replayed, and the first real
rows of its fixed output are returned. All graphs share one memory pool (``torch.cuda.graph_pool_handle``)
and are captured largest first, so later, smaller captures reuse the first one's memory. The fixed buffers
are a ``StepInputs`` (``lowlat.runtime.step_inputs``): a batch that the scheduler's ``BatchBuilder`` built into
them is replayed without any copy, its padding rows already in place.

Captured set: DECODE at batch sizes ``capture_batch_sizes(max_batch_size)`` (every size 1..8, then
multiples of 8, then max_batch_size), and VERIFY at the same batch sizes for every tokens-per-request
count 2..``max_verify_tokens``. A VERIFY step with one token per request, or any step outside the set,
runs eagerly. Sampled ids (plugin API 3): for each shape whose graph took a sampling plugin's path, one more graph
per ``SamplingInfo.variant`` the plugin serves (``ids_variants``), captured with the ``SamplingInputs`` buffers as
the static batch's ``sampling``; a step that ``wants_ids`` of that variant replays it and gets int64 ids [T].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.runtime.progress import task_progress
from lowlat.runtime.step_inputs import StepInputs

ForwardFn = Callable[[ForwardBatch], torch.Tensor]


class GraphKey(NamedTuple):
    """One captured shape: ``batch_size`` (padded) requests of ``tokens_per_req`` new tokens each; ``sampling``
    "" for the logits graph, else the ``SamplingInfo.variant`` of an ids graph."""

    mode: ForwardMode
    batch_size: int
    tokens_per_req: int
    sampling: str = ""

    @property
    def base(self) -> GraphKey:
        """The logits graph's key of this shape."""
        return GraphKey(self.mode, self.batch_size, self.tokens_per_req)

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.tokens_per_req


GraphHook = Callable[[GraphKey, ForwardBatch], None]
FunctionFor = Callable[[GraphKey, ForwardBatch], ForwardFn]


def capture_batch_sizes(max_batch_size: int) -> list[int]:
    """Padded batch sizes to capture: 1..min(8, max), then 16, 24, ... up to max, and max itself."""
    sizes = set(range(1, min(8, max_batch_size) + 1)) | set(range(16, max_batch_size + 1, 8)) | {max_batch_size}
    return sorted(sizes)


class CudaGraphRunner:
    """Captures ``forward_fn`` per shape and replays it.

    Args:
        device: where the fixed input buffers live (capture needs CUDA).
        dummy_row: a ``req_to_token`` row that is never given to a request (all entries slot 0).
        max_batch_size: the largest batch captured.
        max_verify_tokens: VERIFY graphs are captured for 2..max_verify_tokens tokens per request.
        vocab_size: columns of the logits (for the output check).
        inputs: the fixed input buffers (a StepInputs for at least ``max_batch_size`` x ``max_verify_tokens``,
            shared with the scheduler's BatchBuilder); None allocates them here.

    Hooks (the runner's Dispatcher uses ``function_for`` at capture and a replay hook):
        capture_hooks: called as ``hook(key, batch)`` before a shape is warmed up and captured; ``batch`` is the
            static batch (device tensors only, ``seq_lens_cpu`` None) that the forward will see.
        replay_hooks: called as ``hook(key, batch)`` before a replay, with the real (unpadded) batch, after
            the fixed buffers are filled.
    """

    def __init__(self, *, device: torch.device, dummy_row: int, max_batch_size: int, max_verify_tokens: int,
                 vocab_size: int, inputs: StepInputs | None = None) -> None:
        self.device = device
        self.dummy_row = dummy_row
        self.vocab_size = vocab_size
        self.batch_sizes = capture_batch_sizes(max_batch_size)
        self.max_bs = self.batch_sizes[-1]
        self.verify_tokens = list(range(2, max_verify_tokens + 1))
        max_tpr = max([1, *self.verify_tokens])
        if inputs is None:
            inputs = StepInputs(device=device, max_batch_size=self.max_bs, max_tokens_per_req=max_tpr,
                                dummy_row=dummy_row)
        elif (inputs.max_batch_size < self.max_bs or inputs.max_tokens_per_req < max_tpr
              or inputs.dummy_row != dummy_row):
            raise ValueError(f"StepInputs of {inputs.max_batch_size} x {inputs.max_tokens_per_req} (dummy row "
                             f"{inputs.dummy_row}) cannot hold graphs of {self.max_bs} x {max_tpr} (dummy row "
                             f"{dummy_row})")
        self.inputs = inputs
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = inputs.input_ids
        self.positions = inputs.positions
        self.out_cache_loc = inputs.out_cache_loc
        self.seq_lens = inputs.seq_lens
        self.req_pool_indices = inputs.req_pool_indices
        self.extend_lens = inputs.extend_lens
        self.extend_start_loc = inputs.extend_start_loc
        # padded[n]: the captured batch size that runs n requests
        self._padded = [next(b for b in self.batch_sizes if b >= n) for n in range(self.max_bs + 1)]
        # Per tokens-per-request templates: padding positions (0..tpr-1 per row) and row start offsets.
        self._pad_positions = {t: torch.arange(t, **i64).repeat(self.max_bs) for t in [1, *self.verify_tokens]}
        self._starts = {t: torch.arange(self.max_bs, **i32) * t for t in [1, *self.verify_tokens]}
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.capture_hooks: list[GraphHook] = []
        self.replay_hooks: list[GraphHook] = []
        self.pool = None

    def keys(self) -> list[GraphKey]:
        """Every shape to capture, largest first."""
        keys = [GraphKey(ForwardMode.DECODE, b, 1) for b in self.batch_sizes]
        keys += [GraphKey(ForwardMode.VERIFY, b, t) for t in self.verify_tokens for b in self.batch_sizes]
        return sorted(keys, key=lambda k: (k.num_tokens, k.mode is ForwardMode.DECODE, k.batch_size), reverse=True)

    def capture(self, forward_fn: ForwardFn | None = None, *, function_for: FunctionFor | None = None,
                progress: bool = False, ids_variants: Callable[[GraphKey], tuple[str, ...]] | None = None,
                sampling: Any = None, max_top_k: int = 0) -> None:
        """Capture every key (each warmed up twice eagerly first, as SGLang does).

        Args:
            forward_fn: the one function every shape captures; or
            function_for: ``fn(key, static_batch) -> forward`` asked once per shape for the function that
                shape captures (the Dispatcher's ``function_for``: it picks the path of the shape there).
            ids_variants: ``fn(key) -> variants`` asked after a shape's logits graph (the Dispatcher's): an ids
                graph is captured for each, with ``sampling`` (a SamplingInputs) giving the static SamplingInfo
                (``max_top_k``: the plugin's, for the "filter" variant).

        Raises:
            ValueError: the buffers are not on a CUDA device.
            RuntimeError: the forward returned something other than float32 ``[T, vocab]`` logits.
        """
        if (forward_fn is None) == (function_for is None):
            raise ValueError("capture takes forward_fn or function_for, exactly one")
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}; set cuda_graph=False")
        self.pool = torch.cuda.graph_pool_handle()
        keys = self.keys()
        stream = torch.cuda.Stream(self.device)
        with task_progress("capturing CUDA graphs", len(keys), enabled=progress) as advance:
            for key in keys:
                self._capture_one(key, function_for, forward_fn, stream, None)
                for variant in ids_variants(key) if ids_variants is not None else ():
                    info = sampling.static(key.num_tokens, variant, max_top_k)
                    self._capture_one(key._replace(sampling=variant), function_for, forward_fn, stream, info)
                advance()
        torch.cuda.synchronize(self.device)

    def _capture_one(self, key: GraphKey, function_for: FunctionFor | None, forward_fn: ForwardFn | None,
                     stream: torch.cuda.Stream, sampling: Any) -> None:
        batch = self._fill_dummy(key)
        if sampling is not None:
            batch.sampling, batch.logits_required = sampling, False
        for hook in self.capture_hooks:
            hook(key, batch)
        fn = function_for(key, batch) if function_for is not None else forward_fn
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(batch)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = fn(batch)
        want = ((key.num_tokens,), torch.int64) if key.sampling else ((key.num_tokens, self.vocab_size), torch.float32)
        if out.dtype != want[1] or tuple(out.shape) != want[0]:
            what = "int64 ids" if key.sampling else "float32 logits"
            raise RuntimeError(f"the forward captured for {key} returned {out.dtype} {tuple(out.shape)}; "
                               f"expected {what} of shape {want[0]}")
        self.graphs[key] = graph
        self.outputs[key] = out

    def key_for(self, batch: ForwardBatch, sampling: str = "") -> GraphKey | None:
        """The captured key that can run ``batch`` (smallest padded batch size), or None; ``sampling``: the ids
        variant wanted ("" logits); without an ids graph of it, the logits graph's key."""
        tpr = batch.tokens_per_req
        b = batch.batch_size
        if batch.forward_mode is ForwardMode.PREFILL or tpr is None or b > self.max_bs:
            return None
        key = GraphKey(batch.forward_mode, self._padded[b], tpr, sampling)
        if sampling and key not in self.graphs:
            key = key.base
        return key if key in self.graphs else None

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.key_for(batch) is not None

    def replay(self, batch: ForwardBatch, key: GraphKey | None = None, *, fresh: bool = True) -> torch.Tensor:
        """Run ``batch`` through its graph.

        Args:
            batch: the step; when a BatchBuilder built it into ``self.inputs``, nothing is copied.
            key: ``key_for(batch)`` when the caller already has it.
            fresh: return a copy of the graph's output (default); False returns a view of the graph's fixed
                output, which the next replay overwrites: only for a caller whose every read of it is queued on
                the stream before the next replay (the overlapped loop's pick), saving a copy kernel per step.

        Returns:
            float32 logits ``[T, vocab]``, or int64 ids ``[T]`` for an ids key.

        Raises:
            ValueError: no captured graph fits ``batch`` (check ``can_run`` first).
        """
        if key is None:
            key = self.key_for(batch)
            if key is None:
                raise ValueError(f"no CUDA graph for {batch.forward_mode.name} with {batch.batch_size} requests "
                                 f"of {batch.tokens_per_req} tokens; run it eagerly")
        b, tpr = batch.batch_size, key.tokens_per_req
        if self.inputs.layout != (b, tpr) or batch.input_ids.data_ptr() != self.input_ids.data_ptr():
            self._copy_in(batch, key)
        for hook in self.replay_hooks:
            hook(key.base, batch)
        self.graphs[key].replay()
        out = self.outputs[key][:b * tpr]
        return out.clone() if fresh else out

    def close(self) -> None:
        """Drop the graphs and their memory pool."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def _copy_in(self, batch: ForwardBatch, key: GraphKey) -> None:
        """Copy a batch built elsewhere into the fixed buffers and pad it to ``key``'s shape."""
        self.inputs.invalidate()
        b, tpr = batch.batch_size, key.tokens_per_req
        t, tp = b * tpr, key.num_tokens
        self.input_ids[:t].copy_(batch.input_ids, non_blocking=True)
        self.positions[:t].copy_(batch.positions, non_blocking=True)
        self.out_cache_loc[:t].copy_(batch.out_cache_loc, non_blocking=True)
        self.seq_lens[:b].copy_(batch.seq_lens, non_blocking=True)
        self.req_pool_indices[:b].copy_(batch.req_pool_indices, non_blocking=True)
        if tp > t:  # padding rows: dummy request row, positions 0..tpr-1, KV written to slot 0
            self.input_ids[t:tp].zero_()
            self.positions[t:tp].copy_(self._pad_positions[tpr][: tp - t])
            self.out_cache_loc[t:tp].zero_()
            self.seq_lens[b:key.batch_size].fill_(tpr)
            self.req_pool_indices[b:key.batch_size].fill_(self.dummy_row)
        self.extend_lens[:key.batch_size].fill_(tpr)
        self.extend_start_loc[:key.batch_size].copy_(self._starts[tpr][:key.batch_size])

    def _fill_dummy(self, key: GraphKey) -> ForwardBatch:
        """Fill the buffers with an all-padding batch of ``key``'s shape and return the static batch views."""
        self.inputs.invalidate()
        bs, tpr, t = key.batch_size, key.tokens_per_req, key.num_tokens
        self.input_ids[:t].zero_()
        self.positions[:t].copy_(self._pad_positions[tpr][:t])
        self.out_cache_loc[:t].zero_()
        self.seq_lens[:bs].fill_(tpr)
        self.req_pool_indices[:bs].fill_(self.dummy_row)
        self.extend_lens[:bs].fill_(tpr)
        self.extend_start_loc[:bs].copy_(self._starts[tpr][:bs])
        return ForwardBatch(
            forward_mode=key.mode,
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            seq_lens=self.seq_lens[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            out_cache_loc=self.out_cache_loc[:t],
            extend_lens=self.extend_lens[:bs],
            extend_start_loc=self.extend_start_loc[:bs],
            tokens_per_req=tpr,
            seq_lens_cpu=None,
            extend_lens_cpu=None,
        )
