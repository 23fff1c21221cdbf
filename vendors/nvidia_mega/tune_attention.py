"""Sweep the launch plan (``AttnPlan``) of nvidia_mega's paged decode attention (split + merge kernels) on a GPU.

    PYTHONPATH=core/src:vendors/nvidia_mega/src python3 vendors/nvidia_mega/tune_attention.py [--json PATH]

Shapes: each model preset of ``--models`` (llama-3.2-1b, qwen3-8b, qwen3-30b-a3b: Hq, Hkv, D) with every request
holding ``--ctx`` (1024) tokens, DECODE at batch 1, 2, 4, 8 (1 row per request) and VERIFY at batch 1 x 6 rows.
The production plan is ``tuned_plans.attn_plan`` at engine ``--max-context-len`` (2048, EngineConfig's default).

Timing is ``tune_plans.py``'s (``bench_kernels.time_chain``): one CUDA graph launching the attention (split and
merge kernel) once per distinct KV pool copy, the copies together more than 4x the L2 so K/V come from HBM, PDL on
as in production, the median replay time divided by the launches: µs per attention call. Candidates, in stages
(p = the production plan's splits; splits also at most one ``block_kv`` block of ``--ctx`` each, since more only
add empty programs):
  1. splits in {p/4, p/2, p, 2p, 4p} (1..MAX_SPLITS) x BLOCK_KV in {32, 64, 128}, heuristic warps and stages;
  2. split warps in {2, 4, 8} around the two best;
  3. split stages in {1, 2, 3} around the best;
  4. merge warps in {1, 2, 4} around the best;
then production and best are timed again (the "confirm" columns: a best of many noisy samples reads low). Every
candidate's output is checked against core's torch attention once; a plan that fails is reported and never best.
Per shape it prints the production plan and µs, the best and µs, the ratio and the byte floor (K/V bytes read /
``--bw``, 4.2e12 B/s), then ``TUNED_ATTN`` lines for the shapes where the best beat production by more than 3% on
both timings (add them to ``kernels/tuned_plans.py`` only from such a run). ``--json`` keeps every candidate.

About 240 candidates and 220 kernel compiles over the 15 shapes: ``--jobs`` processes (default min(8, cores / 2))
compile each stage's plans ahead into Triton's cache while the timing process waits: 74 s for the three presets
on the H200 (2026-12-02). ``--smoke`` runs a few candidates at a tiny shape on the CPU (``TRITON_INTERPRET=1``) to
check the script; its times are nan. The candidates are timed alone (attention after attention); in a step the
attention sits between qkv_rope and o_proj, and four winners of the 2026-12-02 sweep, faster alone, made the step
slower (``kernels/tuned_plans.py`` lists them): confirm a new entry with ``lowlat bench`` before keeping it.

``--in-layer`` times every candidate inside the step's chain instead (``attn_chain.py``): per layer qkv_rope ->
attention -> o_proj with the production plans and forward.py's launches, each layer its own weights and KV pool,
PDL on; ``--in-layer full`` adds gate_up -> down (a MoE preset: the MoE), which the next layer's qkv_rope follows.
Its times are µs per layer (each candidate prints one line: the chain's µs per layer and the attention's share,
that minus the base: the same chain without the attention, timed once per shape); the stages' ranking, the confirm
timings, the 3% rule and the ``TUNED_ATTN`` lines use the chain's times (not the share). Each shape also reports
production and best timed alone and checks the chain's own attention output (``--json``: ``base_us`` and the rest
per shape). Not yet run on a GPU; ``--smoke --in-layer full`` runs it on the CPU, with a MoE preset too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402
from attn_chain import MODES, LayerChain  # noqa: E402
from lowlat.layers.attention import decode_attention_torch  # noqa: E402
from lowlat_nvidia_mega.kernels.attention import (  # noqa: E402
    MAX_SPLITS,
    AttnPlan,
    default_merge_warps,
    paged_decode_attention,
    partial_numel,
    split_cap,
)
from lowlat_nvidia_mega.kernels.gemm_plans import num_sms  # noqa: E402
from lowlat_nvidia_mega.kernels.pdl import pdl_enabled  # noqa: E402
from lowlat_nvidia_mega.kernels.tuned_plans import attn_plan, device_name, plan_sources_line  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Grid:
    """The values each stage tries."""

    split_factors: tuple[float, ...] = (0.25, 0.5, 1, 2, 4)
    block_kvs: tuple[int, ...] = (32, 64, 128)
    split_warps: tuple[int, ...] = (2, 4, 8)
    split_stages: tuple[int, ...] = (1, 2, 3)
    merge_warps: tuple[int, ...] = (1, 2, 4)
    top: int = 2


SMOKE_GRID = Grid(split_factors=(1, 2), block_kvs=(16,), split_warps=(2,), split_stages=(1,), merge_warps=(1,), top=1)


class AttnCase:
    """One shape: ``b`` requests x ``r`` rows, each request ``ctx`` tokens long, contiguous in its KV pool copy; as
    many pool copies as exceed 4x the L2 (2 on the CPU), the query, the output and workspaces for any plan."""

    def __init__(self, shape: dict, b: int, r: int, ctx: int, dev: torch.device, dtype: torch.dtype,
                 copies: int | None = None) -> None:
        self.hq, self.hkv, self.d = shape["heads"], shape["kv_heads"], shape["head_dim"]
        self.b, self.r, self.ctx, self.dev, self.dt = b, r, ctx, dev, dtype
        self.kv_bytes = 2 * b * ctx * self.hkv * self.d * torch.finfo(dtype).bits // 8  # K and V, read once each
        l2 = bk.L2_BYTES if dev.type == "cuda" else 0
        copies = copies or max(2, min(256, math.ceil(4 * l2 / self.kv_bytes)))
        g = torch.Generator(device=dev).manual_seed(b * 8 + r)
        slots = b * ctx + 16
        self.kb = [torch.randn(slots, self.hkv, self.d, generator=g, device=dev).to(dtype) for _ in range(copies)]
        self.vb = [torch.randn(slots, self.hkv, self.d, generator=g, device=dev).to(dtype) for _ in range(copies)]
        self.rtt = (torch.arange(b * ctx, device=dev, dtype=torch.int32) + 16).view(b, ctx)
        self.rpi = torch.arange(b, device=dev)
        self.seq = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        self.q = torch.randn(b * r, self.hq * self.d, generator=g, device=dev).to(dtype)
        self.out = torch.empty_like(self.q)
        n_o, n_l = partial_numel(b, self.hq, self.hkv, self.d, r, AttnPlan(num_splits=MAX_SPLITS))
        self.o_p, self.l_p = torch.empty(n_o, device=dev), torch.empty(n_l, device=dev)
        self.pdl = pdl_enabled(dev)
        ref = decode_attention_torch(self.q.view(b * r, self.hq, self.d), self.kb[0], self.vb[0], self.rtt,
                                     self.rpi, self.seq, r, self.d ** -0.5)
        self.ref = ref.float().reshape(b * r, -1)

    def launch(self, plan: AttnPlan, i: int) -> None:
        paged_decode_attention(self.q, self.kb[i], self.vb[i], self.rtt, self.rpi, self.seq, self.out,
                               rows_per_req=self.r, sm_scale=self.d ** -0.5, plan=plan, o_partial=self.o_p,
                               lse_partial=self.l_p, use_pdl=self.pdl)

    def chain(self, plan: AttnPlan):
        def run() -> int:
            for i in range(len(self.kb)):
                self.launch(plan, i)
            return len(self.kb)
        return run

    def error(self, plan: AttnPlan) -> float:
        """Largest |out - reference| over the largest |reference|, for KV copy 0."""
        self.launch(plan, 0)
        return ((self.out.float() - self.ref).abs().max() / self.ref.abs().max().clamp_min(1e-30)).item()


def _fmt(p: AttnPlan) -> str:
    return f"s{p.num_splits} kv{p.block_kv} w{p.split_warps} st{p.split_stages} m{p.merge_warps}"


class Precompiler:
    """Compiles the candidates' kernels in ``jobs`` spawned processes before they are timed, a stage at a time: each
    worker launches a plan once at batch 1 of the same shape (no kernel argument depends on the batch, so the
    kernels specialize alike), which fills Triton's on-disk cache; the timing process then loads the kernels instead
    of compiling them one after another. A worker's failure is ignored (the timing run reports the plan)."""

    def __init__(self, jobs: int) -> None:
        self.pool = multiprocessing.get_context("spawn").Pool(jobs)

    def __call__(self, case: AttnCase, plans: list[AttnPlan]) -> None:
        shape = dict(heads=case.hq, kv_heads=case.hkv, head_dim=case.d)
        self.pool.map(_compile_job, [(shape, case.r, case.ctx, case.dev.type, case.dt, p) for p in plans], chunksize=1)

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


_WORKER_CASE: dict[tuple, AttnCase] = {}


def _compile_job(job: tuple) -> None:
    """In a worker: launch ``plan`` once on a batch-1 case of the shape (kept for the next job of that shape)."""
    shape, r, ctx, dev_type, dtype, plan = job
    key = (tuple(shape.values()), r, ctx, dev_type, dtype)
    try:
        if key not in _WORKER_CASE:
            _WORKER_CASE.clear()
            _WORKER_CASE[key] = AttnCase(shape, 1, r, ctx, torch.device(dev_type), dtype, copies=1)
        _WORKER_CASE[key].launch(plan, 0)
    except Exception:  # the timing process compiles and reports the plan itself
        pass


def sweep(case: AttnCase, prod: AttnPlan, grid: Grid, reps: int, tol: float, bw: float,
          ahead: Precompiler | None = None, layer: LayerChain | None = None) -> dict:
    """Time the production plan and the staged candidates for one shape (µs per call; ``tol``: the output check's
    tolerance, ``bw``: bytes/s of the floor; ``ahead``: compiles each stage's new plans first; ``layer``: time each
    plan in that chain instead, µs per layer); returns its result row, ``wrong`` listing plans that failed the
    check (and, in a chain, a failed check of the chain's own attention output)."""
    times: dict[AttnPlan, float] = {}
    errors: dict[AttnPlan, float] = {}
    chain = case.chain if layer is None else layer.chain

    def clock(p: AttnPlan | None) -> float:
        return bk.time_chain(chain(p), case.dev, reps) * 1e6

    base = clock(None) if layer is not None else math.nan  # the chain without the attention, once per shape

    def measure(p: AttnPlan) -> None:
        try:
            times[p] = clock(p)
            errors[p] = case.error(p)
            if layer is not None:
                print(f"    {_fmt(p)}: {times[p]:.2f} us/layer (attention {times[p] - base:.2f})", flush=True)
        except Exception as e:  # a plan the compiler rejects (e.g. out of shared memory) is skipped, not fatal
            if case.dev.type != "cuda":
                raise
            print(f"    rejected {_fmt(p)}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
            times[p], errors[p] = math.inf, math.nan
        if not errors[p] <= tol and times[p] != math.inf:
            print(f"    WRONG OUTPUT {_fmt(p)}: error {errors[p]:.3g} of the reference's max (tolerance {tol})",
                  flush=True)

    def stage(plans: list[AttnPlan]) -> None:
        new = [p for p in dict.fromkeys(plans) if p not in times]
        if ahead is not None and new:
            ahead(case, new)
        for p in new:
            measure(p)

    def ranked() -> list[AttnPlan]:
        ok = [p for p in times if errors[p] <= tol]
        return sorted(ok, key=lambda p: times[p] if times[p] == times[p] else math.inf)

    p0 = prod.num_splits
    splits = sorted({int(p0 * f) for f in grid.split_factors if 1 <= p0 * f <= MAX_SPLITS})
    stage([prod] + [AttnPlan(s, bkv, prod.split_warps, prod.split_stages, default_merge_warps(s, case.d))
                    for bkv in grid.block_kvs for s in splits if s <= split_cap(case.ctx, bkv)])
    stage([dataclasses.replace(p, split_warps=w) for p in ranked()[: grid.top] for w in grid.split_warps])
    stage([dataclasses.replace(p, split_stages=st) for p in ranked()[:1] for st in grid.split_stages])
    stage([dataclasses.replace(p, merge_warps=mw) for p in ranked()[:1] for mw in grid.merge_warps])
    best = (ranked() or [prod])[0]
    again = {p: clock(p) if times[p] != math.inf else math.inf for p in {prod, best}}
    floor = case.kv_bytes / bw * 1e6
    wrong = [dataclasses.asdict(p) for p in times if not errors[p] <= tol and times[p] != math.inf]
    extra: dict = {}
    if layer is not None:  # the base chain, the two plans alone, and the chain's own output check
        alone = {p: bk.time_chain(case.chain(p), case.dev, reps) * 1e6 if times[p] != math.inf else math.inf
                 for p in {prod, best}}
        extra = dict(in_layer=layer.mode, layers=layer.layers, base_us=base, production_alone_us=alone[prod],
                     best_alone_us=alone[best], chain_error=layer.error(prod))
        if not extra["chain_error"] <= tol:
            print(f"    WRONG CHAIN OUTPUT {_fmt(prod)}: error {extra['chain_error']:.3g}", flush=True)
            wrong.append(dict(chain_check=dataclasses.asdict(prod), error=extra["chain_error"]))
    return dict(batch=case.b, rows=case.r, ctx=case.ctx, heads=case.hq, kv_heads=case.hkv, head_dim=case.d,
                kv_copies=len(case.kb), kv_bytes=case.kv_bytes, floor_us=floor,
                production=dataclasses.asdict(prod), production_us=times[prod], production_confirm_us=again[prod],
                best=dataclasses.asdict(best), best_us=times[best], best_confirm_us=again[best],
                candidates=len(times), wrong=wrong,
                all=sorted(([dataclasses.asdict(p), times[p], errors[p]] for p in times),
                           key=lambda row: row[1] if row[1] == row[1] else math.inf), **extra)


def _shape_row(m: str, shape: dict, b: int, r: int, ctx: int, max_ctx: int, sms: int, dev: torch.device,
               dtype: torch.dtype, grid: Grid, args: argparse.Namespace, tol: float, ahead: Precompiler | None) -> dict:
    case = AttnCase(shape, b, r, ctx, dev, dtype)
    prod = attn_plan(b, r, case.hq, case.hkv, case.d, max_ctx, sms, dtype, device=dev)
    layer = LayerChain(shape, b, r, ctx, dev, dtype, args.in_layer) if args.in_layer else None
    return dict(model=m, mode="decode" if r == 1 else "verify",
                **sweep(case, prod, grid, args.reps, tol, args.bw, ahead, layer))


def _line(row: dict) -> str:
    prod, best = AttnPlan(**row["production"]), AttnPlan(**row["best"])
    head = f"  {row['model']:14} {row['mode']:6} B={row['batch']} R={row['rows']}:"
    if "base_us" in row:  # in-layer: µs per layer, the attention's share after the semicolon
        base = row["base_us"]
        return (f"{head} in-layer {row['in_layer']} ({row['layers']} layers, base {base:.2f} us) | production "
                f"{row['production_us']:6.2f} us/layer ({row['production_confirm_us']:6.2f}; attention "
                f"{row['production_us'] - base:5.2f}) {_fmt(prod)} | best {row['best_us']:6.2f} "
                f"({row['best_confirm_us']:6.2f}; attention {row['best_us'] - base:5.2f}) {_fmt(best)} "
                f"({row['production_us'] / row['best_us']:.3f}x, {row['candidates']} plans) | alone "
                f"{row['production_alone_us']:.2f} -> {row['best_alone_us']:.2f} us | floor {row['floor_us']:.2f} us")
    return (f"{head} production "
            f"{row['production_us']:6.2f} us ({row['production_confirm_us']:6.2f}) {_fmt(prod)} | best "
            f"{row['best_us']:6.2f} us ({row['best_confirm_us']:6.2f}) {_fmt(best)} "
            f"({row['production_us'] / row['best_us']:.2f}x, {row['candidates']} plans) | floor "
            f"{row['floor_us']:.2f} us")


def _tuned_line(row: dict, device: str, dtype: torch.dtype) -> str | None:
    """The ``TUNED_ATTN`` line of a shape whose best beat production by more than 3% on both timings (in-layer: µs
    per layer of the chain, the attention's share and the two plans alone in the comment), else None."""
    gain = min(row["production_us"] / row["best_us"], row["production_confirm_us"] / row["best_confirm_us"])
    if not gain > 1.03:
        return None
    key = (device, "attn", row["batch"], row["rows"], row["heads"], row["kv_heads"], row["head_dim"],
           str(dtype).removeprefix("torch."))
    note = (f" in-layer {row['in_layer']} (attention {row['production_us'] - row['base_us']:.2f} -> "
            f"{row['best_us'] - row['base_us']:.2f}; alone {row['production_alone_us']:.2f} -> "
            f"{row['best_alone_us']:.2f})" if "base_us" in row else "")
    return (f"    {key!r}: {tuple(dataclasses.astuple(AttnPlan(**row['best'])))!r},  # {row['model']} {row['mode']} "
            f"{row['production_us']:.2f} -> {row['best_us']:.2f}{note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b,qwen3-30b-a3b")
    ap.add_argument("--batches", default="1,2,4,8", help="DECODE batch sizes (1 row per request)")
    ap.add_argument("--verify", default="1x6", help="VERIFY shapes BxR, comma-separated ('' for none)")
    ap.add_argument("--ctx", type=int, default=1024, help="KV tokens per request")
    ap.add_argument("--max-context-len", type=int, default=2048, help="engine max_context_len (production plan)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bw", type=float, default=4.2e12, help="bytes/s of the byte floor")
    ap.add_argument("--json", default=None, help="write every candidate here")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes compiling each stage's plans ahead (default: 0 on the CPU, else min(8, cores / 2))")
    ap.add_argument("--in-layer", nargs="?", const="attn", default=None, choices=MODES,
                    help="time each plan in the step's chain, µs per layer: qkv_rope -> attention -> o_proj ('attn', "
                         "the default), 'full': then gate_up -> down (or the MoE)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, a few plans, CPU interpreter")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    grid, ctx, max_ctx = Grid(), args.ctx, args.max_context_len
    cases = [(b, 1) for b in map(int, args.batches.split(",") if args.batches else [])]
    cases += [tuple(map(int, v.split("x"))) for v in args.verify.split(",") if v]
    models = args.models.split(",")
    if args.smoke:
        grid, ctx, max_ctx, cases, models = SMOKE_GRID, 40, 64, [(2, 1), (1, 3)], ["tiny"]
        models += ["tiny-qwen3-moe"] if args.in_layer == "full" else []  # the MoE layer's chain too
    sms = num_sms(dev)
    jobs = args.jobs if args.jobs is not None else 0 if dev.type != "cuda" else min(8, (os.cpu_count() or 2) // 2)
    ahead = Precompiler(jobs) if jobs > 0 else None
    print(f"device {device_name(dev)} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}; context "
          f"{ctx} tokens, engine max_context_len {max_ctx}, {dtype}, PDL {'on' if pdl_enabled(dev) else 'off'}"
          + (f"; timed in the layer chain ({args.in_layer})" if args.in_layer else ""), flush=True)
    t0, rows = time.monotonic(), []
    try:
        for m in models:
            shape = bk.SHAPES[m] if m in bk.SHAPES else bk.preset_shape(m)
            for b, r in cases:
                rows.append(_shape_row(m, shape, b, r, ctx, max_ctx, sms, dev, dtype, grid, args, tol, ahead))
                print(_line(rows[-1]) + f" [{time.monotonic() - t0:.0f} s]", flush=True)
    finally:
        if ahead is not None:
            ahead.close()
    print(plan_sources_line(dev))
    print("TUNED_ATTN entries (best faster than production by > 3% on both timings"
          + (", µs per layer of the in-layer chain):" if args.in_layer else "):"))
    for row in rows:
        line = _tuned_line(row, device_name(dev), dtype)
        if line:
            print(line)
    if args.json:
        meta = dict(device=device_name(dev), sms=sms, torch=torch.__version__, triton=triton.__version__, ctx=ctx,
                    max_context_len=max_ctx, dtype=str(dtype), pdl=pdl_enabled(dev), reps=args.reps, bw=args.bw,
                    in_layer=args.in_layer, seconds=time.monotonic() - t0)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)
    wrong = [(row["model"], row["mode"], row["batch"], row["rows"], w) for row in rows for w in row["wrong"]]
    if wrong:
        raise SystemExit(f"plans whose output failed the reference check: {wrong}")


if __name__ == "__main__":
    main()
