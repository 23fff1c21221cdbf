"""Time one decoder layer of lowlat-amd-mono on a GPU, against the general path, with stage variants.

Usage (on the H200; about a minute with a warm Triton cache, under two minutes cold):
    PYTHONPATH=core/src:vendors/amd_mono/src python vendors/amd_mono/bench_layers.py
    ... --models llama-3.2-1b --rows 1 --overlaps     # also PDL off and L2 prefetch off (extra compiles)
    ... --staged                                      # also the stage-per-launch mode (extra compiles)
    ... --variants "pdl=0;pdl=0,programs_per_sm=2"   # also these MonoOptions (";" between variants)
    ... --rows 1 --variants "row1_fma=1"              # the one-row FMA GEMVs (off by default) against tl.dot
    ... --sync-floor                                  # also each variant with every stage's compute skipped

Method: a model cut to ``--layers`` distinct decoder layers (so weights do not stay in L2 between replays) with
seeded random weights made on the GPU; each request has ``--ctx`` cached tokens. A CUDA graph holds the
embedding launch (it bumps the step tag) plus the layers (the one-launch step, or every layer's K1 and K2 with
``one_launch=0``); another holds the embedding alone.
Per layer = (median replay of the first - median of the second) / layers. The general path is the same cut
model twice, each in a CUDA graph: its reference decoder layers (lowlat.models' modules, plain torch ops), and
the path the engine runs on CUDA (``general_impl`` "fused", ``LayeredForward`` with core's Triton kernels: a whole
step minus the step without its layers). "vs general" is against the second: until 2026-12-07 this script
compared with the reference layers only, which are 1.6-1.9x slower than the engine's on an H100, so the
per-layer ratios in docs/design.md before that date overstate amd_mono against the engine. "skip S"
re-captures with stage S's compute skipped in every layer (it still publishes), so "full - skip S" is what stage
S costs on the critical path. The roofline is the bytes a layer must read (weights it touches, K/V) over the
measured device-copy bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from lowlat.bench import timing
from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.kv_cache import KVPool
from lowlat.loader.presets import get_preset, with_layers
from lowlat.loader.synthetic import iter_synthetic_weights
from lowlat.models import build_model
from lowlat.models.general_impl import make_general_step
from lowlat_amd_mono.forward import MonoForward
from lowlat_amd_mono.kernels import plan as P
from lowlat_amd_mono.kernels.launch import MonoOptions

DEV = torch.device("cuda")


def graph_median_us(fn, reps: int = 20, inner: int = 5) -> float:
    """Median time of ``fn`` replayed from a CUDA graph (warm-up excluded), in microseconds."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written: ``lowlat bench``'s own
    measurement (2 GiB, median of 20), so rooflines here match its. A copy captured in a CUDA graph, as this
    script measured before 2026-12-02, read about 2.7 TB/s on the H200 against 4.25 TB/s."""
    return timing.copy_bandwidth(DEV, 2 << 30, 20).gb_per_s * 1e9


def layer_bytes(cfg, rows: int, ctx: int) -> float:
    """Bytes one decoder layer must read at ``rows`` requests of ``ctx`` tokens (bf16)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d * h + cfg.num_attention_heads * d * h) * 2
    kv = rows * ctx * cfg.num_key_value_heads * d * 2 * 2
    if cfg.is_moe_layer(0):
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        unique = e * (1 - (1 - k / e) ** rows)  # expected distinct experts under uniform routing
        mlp = (e * h + unique * 3 * cfg.moe_intermediate_size * h) * 2
    else:
        mlp = 3 * cfg.intermediate_size * h * 2
    return attn + kv + mlp


class LayerBench:
    """One cut model, its KV pool and a DECODE batch of ``rows`` requests with ``ctx`` cached tokens each."""

    def __init__(self, preset: str, layers: int, rows: int, ctx: int) -> None:
        self.cfg = with_layers(get_preset(preset), layers)
        self.model = build_model(self.cfg, dtype=torch.bfloat16, device=DEV, max_context_len=ctx + 64)
        self.model.load_weights(iter_synthetic_weights(self.cfg, seed=0, dtype=torch.bfloat16, device=DEV))
        self.params = dict(self.model.named_parameters())
        c = self.cfg
        page = 16
        self.pool = KVPool(num_layers=c.num_hidden_layers, num_pages=rows * (ctx + 64) // page + 2, page_size=page,
                           num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=torch.bfloat16,
                           device=DEV, max_reqs=rows, max_context_len=ctx + 64)
        for buf in (*self.pool.k_buffers, *self.pool.v_buffers):
            buf.normal_()
        reqs = [self.pool.alloc_req() for _ in range(rows)]
        for r in reqs:
            self.pool.alloc_slots(r, ctx)
        loc = torch.cat([self.pool.alloc_slots(r, ctx + 1) for r in reqs])
        ids = torch.randint(0, c.vocab_size, (rows,))
        self.batch = ForwardBatch.build(ForwardMode.DECODE, ids, [ctx] * rows, [1] * rows, reqs, loc, DEV)
        self.rows = rows

    def mono(self, **extra) -> MonoForward:
        opts = MonoOptions.resolve(DEV, extra)
        fwd = MonoForward(model_config=self.cfg, params=self.params, dtype=torch.bfloat16, device=DEV,
                          alloc_workspace=lambda n, s, d: torch.zeros(s, dtype=d, device=DEV),
                          max_context_len=self.pool.max_context_len, options=opts)
        fwd.attach_kv_pool(self.pool)
        return fwd

    def mono_layer_us(self, fwd: MonoForward) -> float:
        b = self.batch
        shape = fwd.plan.step_shape(self.rows, 1)

        def embed() -> None:
            fwd.embed(b.input_ids)

        def layers() -> None:
            embed()
            fwd.run_layers(b, shape)

        full = graph_median_us(layers)
        fwd.check_errors()
        return (full - graph_median_us(embed)) / self.cfg.num_hidden_layers

    def skipped_us(self, fwd: MonoForward, stages: tuple[int, ...]) -> float:
        """Per-layer time with ``stages``' compute skipped in every layer (they still publish); all of them: the
        launches, waits and publishes alone."""
        for i in range(self.cfg.num_hidden_layers):
            fwd.set_debug(i, skip=stages)
        us = self.mono_layer_us(fwd)
        for i in range(self.cfg.num_hidden_layers):
            fwd.set_debug(i)
        return us

    def general_layer_us(self) -> float:
        """The reference general layers (``lowlat.models``' own modules, plain torch ops), µs per layer."""
        m, b = self.model, self.batch
        x = m.model.embed_tokens(b.input_ids)
        cos, sin = m.model.rotary_emb(b.positions, x.dtype)

        def layers() -> None:
            y = x
            for layer in m.model.layers:
                y = layer(y, cos, sin, b, self.pool, None)

        return graph_median_us(layers) / self.cfg.num_hidden_layers

    def engine_general_layer_us(self) -> float:
        """The general path as the engine runs it on CUDA (``general_impl`` "auto" = "fused": core's Triton norm,
        RoPE/KV-write and SwiGLU kernels around the same GEMMs and attention), µs per layer: a whole fused step
        of the cut model minus the same step with its decoder layers removed (embedding, final norm, LM head)."""
        m, b = self.model, self.batch
        step = make_general_step(m, "fused")
        full = graph_median_us(lambda: step(b, self.pool))
        kept = m.model.layers
        m.model.layers = torch.nn.ModuleList()
        try:
            bare = graph_median_us(lambda: step(b, self.pool))
        finally:
            m.model.layers = kept
        return (full - bare) / self.cfg.num_hidden_layers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-30b-a3b")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--layers", type=int, default=0, help="distinct layers per graph (default: 4 dense, 2 MoE)")
    ap.add_argument("--ctx", type=int, default=512, help="cached tokens per request")
    ap.add_argument("--overlaps", action="store_true", help="also time PDL off and L2 prefetch off")
    ap.add_argument("--staged", action="store_true", help="also time the stage-per-launch mode")
    ap.add_argument("--variants", default="", help="MonoOptions variants to time: 'field=value,...' separated by ';'")
    ap.add_argument("--no-skips", action="store_true", help="leave out the skip-one-stage variants")
    ap.add_argument("--sync-floor", action="store_true",
                    help="also time each variant with every stage's compute skipped (launches, waits, publishes)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_layers.py needs a GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s (read + written)")
    hdr = f"{'model':16s} {'rows':>4s} {'variant':34s} {'us/layer':>9s} {'vs general':>10s} {'roofline %':>10s}"
    print(hdr)
    print("-" * len(hdr))
    for preset in args.models.split(","):
        moe = get_preset(preset).is_moe
        for rows in (int(r) for r in args.rows.split(",")):
            lb = LayerBench(preset, args.layers or (2 if moe else 4), rows, args.ctx)
            roof = layer_bytes(lb.cfg, rows, args.ctx) / bw * 1e6
            timed = {}
            for name, fn in (("reference", lb.general_layer_us), ("engine", lb.engine_general_layer_us)):
                try:
                    timed[name] = fn()
                except Exception as e:  # the general path is only the comparison here; keep timing amd_mono
                    print(f"{preset:16s} {rows:4d} general path ({name}) not timed: {type(e).__name__}: {e}",
                          flush=True)
                    timed[name] = float("nan")
            general = timed["engine"]

            def row(variant: str, us: float, preset: str = preset, rows: int = rows, general: float = general,
                    roof: float = roof) -> None:
                print(f"{preset:16s} {rows:4d} {variant:34s} {us:9.1f} {general / us:9.2f}x {100 * roof / us:9.0f}%",
                      flush=True)

            row("general path, reference ops", timed["reference"])
            row("general path as the engine runs it", general)
            print(f"{preset:16s} {rows:4d} {'roofline':34s} {roof:9.1f}")
            fwd = lb.mono()
            full = lb.mono_layer_us(fwd)
            row(f"amd_mono persistent (pdl={int(fwd.options.pdl)}, row1={int(fwd.row1(rows))})", full)
            stages = P.K1_STAGES + (P.K2_MOE_STAGES if moe else P.K2_DENSE_STAGES)
            if not args.no_skips:
                for st in stages:
                    us = lb.skipped_us(fwd, (st,))
                    row(f"  skip {fwd.stage_name(0, st)} (saves {full - us:+.1f})", us)
            if args.overlaps:
                row("  PDL off (cooperative launch)", lb.mono_layer_us(lb.mono(amd_mono_pdl=False)))
                row("  L2 prefetch off", lb.mono_layer_us(lb.mono(amd_mono_l2_prefetch_bytes=0)))
            if args.staged:
                row("  stage per launch", lb.mono_layer_us(lb.mono(amd_mono_staged=True)))

            def sync_floor(f: MonoForward, label: str, lb: LayerBench = lb, stages: tuple = stages) -> None:
                if args.sync_floor:
                    row(f"  {label}, every stage skipped", lb.skipped_us(f, stages))

            sync_floor(fwd, "defaults")
            for spec in filter(None, (v.strip() for v in args.variants.split(";"))):
                extra = {f"amd_mono_{k.strip()}": v.strip() for k, v in (kv.split("=") for kv in spec.split(","))}
                try:
                    vf = lb.mono(**extra)
                    row(f"  {spec}", lb.mono_layer_us(vf))
                    sync_floor(vf, spec)
                except Exception as e:  # e.g. a grid the residency check refuses; keep timing the others
                    print(f"{preset:16s} {rows:4d}   {spec}: not timed: {type(e).__name__}: {str(e)[:160]}", flush=True)
            del lb, fwd
            torch.cuda.empty_cache()
    print(f"# {time.time() - t_start:.0f} s; per layer = (graph of embed + layers - graph of embed) / layers; "
          f"ctx {args.ctx}; roofline = weights touched + KV read at the copy bandwidth")
    return 0


if __name__ == "__main__":
    sys.exit(main())
