"""The HF transformers peer ("hf"): what a user would otherwise run for low-latency decoding.

The model is transformers' own class for the architecture (``AutoModelForCausalLM.from_config``) built on the
device at the preset's shapes with seeded random bf16 weights (every matrix normal(0, 0.02), HF's
``initializer_range``; norm weights 1), a ``StaticCache`` of exactly ``context + k + 1`` positions per shape,
and ``torch.compile(model, mode="reduce-overhead", dynamic=False)`` (HF's recommended recipe for static-cache
decoding; reduce-overhead records CUDA graphs). A DECODE row is a forward of one token per request at
positions ``context``; a VERIFY row a forward of ``k + 1`` tokens. Every shape is one compile; the dynamo
caches are reset between shapes so each compile starts clean and its CUDA-graph memory is freed.

The cache's K/V are filled with random values instead of a prefill. transformers 5.x writes new K/V at the
cache's running length (``StaticLayer.cumulative_length``), not at the positions passed, so that length is set
back to ``context`` before every step, untimed; older versions take ``cache_position`` instead, which is passed
when the forward accepts it.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch

from lowlat.bench.config import HF_PATH, BenchConfig, Shape
from lowlat.bench.measure import (
    DepthResult,
    Measurement,
    describe_error,
    fmt_row,
    free_device_memory,
    launches_of,
    timed_twice,
)
from lowlat.bench.roofline import mean_union, topk_ids
from lowlat.config import DTYPES, ModelConfig
from lowlat.loader.presets import with_layers

Log = Callable[[str], None]
INIT_STD = 0.02  # transformers' default initializer_range


def unavailable_reason(device: torch.device) -> str | None:
    """Why the hf peer cannot run here (None when it can)."""
    if device.type != "cuda":
        return ("the hf peer needs a CUDA GPU (torch.compile mode='reduce-overhead' records CUDA graphs); "
                "CPU figures cover the lowlat paths only")
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install transformers)"
    return None


def hf_config(model_config: ModelConfig, num_layers: int) -> Any:
    """The transformers config of ``model_config`` cut to its first ``num_layers`` decoder layers."""
    import transformers

    d = with_layers(model_config, num_layers).to_hf_dict()
    model_type = d.pop("model_type")
    for key in ("architectures", "torch_dtype", "bos_token_id", "eos_token_id"):
        d.pop(key, None)
    return transformers.AutoConfig.for_model(model_type, use_cache=True, **d)


class HFPeer:
    """A transformers model at ``num_layers`` layers with random weights on ``device``.

    Raises:
        ImportError: transformers is missing; torch.OutOfMemoryError: the model does not fit.
    """

    def __init__(self, model_config: ModelConfig, *, num_layers: int, device: torch.device, dtype: torch.dtype,
                 seed: int) -> None:
        import transformers

        self.model_config, self.device, self.dtype = model_config, device, dtype
        self.config = hf_config(model_config, num_layers)
        with torch.device(device):
            try:
                model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=dtype)
            except TypeError:  # transformers 4.x
                model = transformers.AutoModelForCausalLM.from_config(self.config, torch_dtype=dtype)
        self.model = model.eval().requires_grad_(False)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.ndim >= 2:
                    p.normal_(0.0, INIT_STD, generator=gen)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pass_cache_position = "cache_position" in params


def make_static_cache(config: Any, batch_size: int, max_cache_len: int, device: torch.device,
                      dtype: torch.dtype) -> Any:
    """A transformers StaticCache (lazily allocated in 4.56+/5.x; explicit batch/device/dtype before that)."""
    from transformers import StaticCache

    try:
        return StaticCache(config=config, max_cache_len=max_cache_len)
    except TypeError:
        return StaticCache(config=config, max_batch_size=batch_size, max_cache_len=max_cache_len, device=device,
                           dtype=dtype)


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The K and V tensors of a StaticCache (5.x ``layers[i].keys/values``; 4.x ``key_cache/value_cache``)."""
    out: list[torch.Tensor] = []
    for layer in getattr(cache, "layers", None) or []:
        out += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                if isinstance(t, torch.Tensor)]
    if not out:
        for name in ("key_cache", "value_cache"):
            out += [t for t in getattr(cache, name, None) or [] if isinstance(t, torch.Tensor)]
    return out


def set_cache_length(cache: Any, length: int) -> None:
    """Set transformers 5.x's per-layer running length (where the next K/V are written) to ``length``."""
    for layer in getattr(cache, "layers", None) or []:
        cl = getattr(layer, "cumulative_length", None)
        if isinstance(cl, torch.Tensor):
            cl.fill_(length)
        elif isinstance(cl, int):
            layer.cumulative_length = length


class HFStep:
    """One shape of the hf peer: input sets, a StaticCache with random K/V, and the (compiled) forward.

    ``before(i)`` resets the cache length (untimed); ``run(i)`` is the timed step on input set ``i % n``. Call both
    under ``torch.no_grad()``.
    """

    def __init__(self, peer: HFPeer, shape: Shape, *, context: int, input_sets: int, seed: int,
                 compile: bool = True) -> None:
        b, t = shape.batch_size, shape.tokens_per_req
        self.peer, self.context, self.compiled = peer, context, compile
        gen = torch.Generator().manual_seed(seed)
        vocab = peer.model_config.vocab_size
        self.ids = [torch.randint(0, vocab, (b, t), generator=gen).to(peer.device) for _ in range(input_sets)]
        pos = torch.arange(context, context + t, device=peer.device)
        self.kwargs: dict[str, Any] = {"position_ids": pos.expand(b, t).contiguous(), "use_cache": True}
        if peer.pass_cache_position:
            self.kwargs["cache_position"] = pos
        self.cache = make_static_cache(peer.config, b, context + t, peer.device, peer.dtype)
        self.kwargs[peer.cache_kw] = self.cache
        with torch.no_grad():
            self.eager(0)  # allocates the lazily built cache
            gen_dev = torch.Generator(device=peer.device).manual_seed(seed)
            for tensor in cache_tensors(self.cache):
                tensor.normal_(generator=gen_dev)
        self.fn = peer.model
        if compile:
            torch._dynamo.reset()
            self.fn = torch.compile(peer.model, mode="reduce-overhead", dynamic=False)

    def before(self, i: int) -> None:
        set_cache_length(self.cache, self.context)

    def run(self, i: int) -> torch.Tensor:
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()
        return self.fn(input_ids=self.ids[i % len(self.ids)], **self.kwargs).logits

    def eager(self, i: int) -> torch.Tensor:
        """An uncompiled step on input set ``i`` (cache length reset first)."""
        self.before(i)
        return self.peer.model(input_ids=self.ids[i % len(self.ids)], **self.kwargs).logits

    def close(self) -> None:
        self.fn = None  # type: ignore[assignment]
        self.cache = None
        self.kwargs.clear()
        if self.compiled:
            torch._dynamo.reset()


def hf_routing(step: HFStep) -> list[float]:
    """Per MoE layer, the mean distinct experts the hf model's routers pick over the step's input sets (eager)."""
    routers = [m for name, m in step.peer.model.named_modules() if name.endswith("mlp.gate")]
    top_k = step.peer.model_config.num_experts_per_tok
    seen: list[list[int]] = []
    current: list[int] = []

    def hook(_m: torch.nn.Module, _inp: object, out: Any) -> None:
        ids = out[2] if isinstance(out, tuple) and len(out) >= 3 else topk_ids(out[0] if isinstance(out, tuple)
                                                                               else out, top_k)
        current.append(int(torch.unique(ids).numel()))
        if len(current) == len(routers):
            seen.append(list(current))
            current.clear()

    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        with torch.no_grad():
            for i in range(len(step.ids)):
                step.eager(i)
    finally:
        for h in handles:
            h.remove()
    return mean_union(seen)


def measure_hf_shape(step: HFStep, cfg: BenchConfig, device: torch.device, t_start: float) -> Measurement:
    """Warm up (compiles, records the CUDA graph; at least 3 calls), time twice, count the launches of one step."""
    from lowlat.bench.timing import warm_up

    with torch.no_grad():
        warm_up(step.run, max(cfg.warmup, 3), device, step.before)
        compile_s = time.perf_counter() - t_start
        first, second = timed_twice(step.run, cfg, device, step.before)
        m = Measurement(step=first, repeat=second, ran_on=HF_PATH, graphed=False, compile_s=compile_s)
        step.before(0)
        launches_of(lambda: step.run(0), device, m)
    return m


def hf_plan(cfg: BenchConfig, shapes: list[Shape], depths: tuple[int, int] | None, full: int
            ) -> list[tuple[int, Shape]]:
    """(depth, shape) pairs in the order the hf peer runs them, most informative first.

    The second depth's rows (for per-layer figures, DECODE at ``hf_layer_batch_sizes``) come first, then the full
    model's: the smallest DECODE batch, the VERIFY rows, then the other DECODE batches, largest first.
    Only DECODE batch sizes in ``hf_batch_sizes`` (default all) run.
    """
    allowed = set(cfg.hf_batch_sizes) if cfg.hf_batch_sizes is not None else None
    decode = [s for s in shapes if s.tokens_per_req == 1 and (allowed is None or s.batch_size in allowed)]
    verify = [s for s in shapes if s.tokens_per_req > 1]
    decode.sort(key=lambda s: s.batch_size)
    order = decode[:1] + verify + sorted(decode[1:], key=lambda s: -s.batch_size)
    plan = [(full, s) for s in order]
    if depths is not None:
        plan = [(depths[1], s) for s in decode if s.batch_size in cfg.hf_layer_batch_sizes] + plan
    return plan


def run_hf_path(cfg: BenchConfig, model: str, model_config: ModelConfig, shapes: list[Shape],
                depths: tuple[int, int] | None, device: torch.device, *, want_routing: bool,
                log: Log = print) -> dict[int, DepthResult]:
    """Measure the hf peer for ``model``: one DepthResult per depth; never raises for a peer failure.

    Shapes outside ``hf_batch_sizes``, and those not started within ``hf_budget_s`` seconds, are skipped with the
    reason. With ``want_routing`` the full model's routing is measured (used when no lowlat path measured it).
    """
    full = model_config.num_hidden_layers
    results = {d: DepthResult(path=HF_PATH, depth=d) for d in ([full] if depths is None else list(depths))}
    reason = unavailable_reason(device)
    if reason is not None:
        log(f"[bench] {model} hf: skipped: {reason}")
        for res in results.values():
            res.fail_all(shapes, reason)
        return results
    plan = hf_plan(cfg, shapes, depths, full)
    for depth, res in results.items():
        for s in shapes:
            if (depth, s) in plan:
                continue
            res.rows[s] = (f"batch size {s.batch_size} not in --hf-batch-sizes "
                           f"{','.join(map(str, cfg.hf_batch_sizes or ()))}" if depth == full else
                           "the hf peer runs the second depth only for DECODE at --hf-layer-batch-sizes "
                           f"{','.join(map(str, cfg.hf_layer_batch_sizes))}")
    t_begin = time.perf_counter()
    peer: HFPeer | None = None
    for depth, shape in plan:
        prefix = f"[bench] {model} hf L={depth}"
        res = results[depth]
        spent = time.perf_counter() - t_begin
        if spent > cfg.hf_budget_s:
            res.rows[shape] = (f"the hf time budget ({cfg.hf_budget_s:.0f} s per model) was spent after "
                               f"{spent:.0f} s; raise --hf-budget-s or narrow --hf-batch-sizes")
            log(fmt_row(prefix, shape, res.rows[shape]))
            continue
        step: HFStep | None = None
        try:
            if peer is None or peer.config.num_hidden_layers != depth:
                peer = None
                free_device_memory(device)
                t0 = time.perf_counter()
                peer = HFPeer(model_config, num_layers=depth, device=device, dtype=DTYPES[cfg.dtype], seed=cfg.seed)
                log(f"{prefix}: transformers model built in {time.perf_counter() - t0:.1f} s")
            log(f"{prefix} {shape.label}: compiling with torch.compile(mode='reduce-overhead') "
                f"({time.perf_counter() - t_begin:.0f} s of the {cfg.hf_budget_s:.0f} s budget spent)")
            t0 = time.perf_counter()
            step = HFStep(peer, shape, context=cfg.context, input_sets=cfg.input_sets, seed=cfg.seed + shape.num_tokens)
            if want_routing and depth == full and model_config.is_moe:
                res.routing[shape] = hf_routing(step)
                res.routing_source = f"transformers model (eager, {cfg.input_sets} input sets)"
            res.rows[shape] = measure_hf_shape(step, cfg, device, t0)
        except Exception as e:
            res.rows[shape] = describe_error(e)
        finally:
            if step is not None:
                step.close()
            del step
            torch._dynamo.reset()
            free_device_memory(device)
        log(fmt_row(prefix, shape, res.rows[shape]))
    del peer
    free_device_memory(device)
    return results
