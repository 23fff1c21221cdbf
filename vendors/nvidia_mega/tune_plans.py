"""Sweep the launch plans of nvidia_mega's small GEMMs and fused QKV kernel on a GPU, and time a do-nothing kernel
chain for the per-launch floor (on a GPU only: ``--smoke`` prints no such line).

    PYTHONPATH=core/src:vendors/nvidia_mega/src python vendors/nvidia_mega/tune_plans.py [--models ...] [--rows 1,8]

Each candidate plan (BLOCK_N, split-K, BLOCK_K, warps, stages) is timed as ``bench_kernels.py`` times a kernel:
one CUDA graph launching it once per distinct weight copy (more bytes than 4x the L2), median replay time per
launch. Stage 1 sweeps (BLOCK_N, split-K) at the production BLOCK_K / warps / stages; stage 2 sweeps BLOCK_K
and warps around the two best, then stages around the best; the same weights through ``F.linear`` alone (cuBLAS,
none of the fusions) are timed as a reference. It prints the production plan (``tuned_plans``: the
measured table, this GPU's or a same-chip GPU's, else the heuristic), the best found and the ratio; ``--json``
keeps every candidate's time. Add a winner to ``tuned_plans.TUNED`` only from such a run, with the GPU's
``MEASURED_ON`` line the first output line prints. ``--smoke`` runs a few candidates at tiny shapes on the
CPU (``TRITON_INTERPRET=1``) to check the script; its timings print as nan (nothing is timed off CUDA).
``--row1-only`` sweeps the one-row kernels alone, ``--stream`` the one-row GEMV's weight stream
(``GemvPlan.per_sm``) beside its per-tile plans. The attention's plans: ``tune_attention.py``.

The kernels with a norm prologue (qkv_rope, gate_up) run as production runs them at each row count: on a prenorm
step (``bench_kernels.Case.prenorm``: ``norm_rows.prenorm_step``, 2..``tuned_plans.prenorm_rows`` rows, or as
``LOWLAT_MEGA_PRENORM`` says) without the prologue, x standing in for the normalized rows, so a plan is never chosen
for work the step does not do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402
from lowlat_nvidia_mega.kernels.gemm_plans import GemmPlan, GemvPlan, make_plan, splitk_workspace_numel  # noqa: E402
from lowlat_nvidia_mega.kernels.gemv import gemm  # noqa: E402
from lowlat_nvidia_mega.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs  # noqa: E402
from lowlat_nvidia_mega.kernels.qk_late import late_qk  # noqa: E402
from lowlat_nvidia_mega.kernels.qkv_rope import qkv_rope, qkv_workspace_numel  # noqa: E402
from lowlat_nvidia_mega.kernels.tuned_plans import (  # noqa: E402
    device_name,
    gemm_plan,
    plan_sources_line,
    qkv_plan,
)


@triton.jit
def _nop_kernel(x_ptr, USE_PDL: tl.constexpr):
    gdc_launch_dependents(USE_PDL)
    gdc_wait(USE_PDL)
    if tl.program_id(0) == 0:
        tl.store(x_ptr, tl.load(x_ptr) + 1)


def nop_chain(dev: torch.device, programs: int, pdl: bool, n: int = 32):
    x = torch.zeros(1, dtype=torch.int32, device=dev)

    def chain() -> int:
        for _ in range(n):
            _nop_kernel[(programs,)](x, USE_PDL=pdl, num_warps=4, **launch_kwargs(pdl))
        return n
    return chain


class Tuner:
    def __init__(self, case: bk.Case, reps: int) -> None:
        self.c, self.reps = case, reps
        self.ws = torch.zeros(16 * 8 * 16384, device=case.dev)
        self.pdl = case.dev.type == "cuda"
        self.prenorm = case.prenorm  # production's choice at this row count (bench_kernels.Case)
        self.norm = case.prologue_norm  # None on a prenorm step: x stands in for the rows norm_rows normalizes

    def time(self, chain) -> float:
        try:
            return bk.time_chain(chain, self.c.dev, self.reps) * 1e6
        except Exception as e:  # a plan the compiler rejects (e.g. out of shared memory) is skipped, not fatal
            if self.c.dev.type != "cuda":
                raise
            print(f"    rejected: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
            return float("inf")

    def gemm_chain(self, which: str, plan: GemmPlan):
        c, h = self.c, self.c.s["hidden"]
        ws = {"o_proj": c.wo, "gate_up": c.wgu, "down": c.wd}[which]
        gated = which == "gate_up"
        n = c.s["inter"] if gated else h
        if splitk_workspace_numel(plan, n, gated=gated) > self.ws.numel():
            return None
        x_in = c.x if gated else (c.attn if which == "o_proj" else c.act)
        resid = torch.zeros(c.t, h, dtype=c.dt, device=c.dev)  # the residual in and out: never uninitialized

        def chain() -> int:
            for i, w in enumerate(ws):
                if gated:
                    gemm(x_in, w, c.act, plan=plan, epilogue="silu_mul", norm_weight=self.norm(i), eps=bk.EPS,
                         workspace=self.ws, counters=c.counters, use_pdl=self.pdl)
                else:
                    gemm(x_in, w, resid, plan=plan, epilogue="residual", residual=resid, workspace=self.ws,
                         counters=c.counters, use_pdl=self.pdl)
            return len(ws)
        return chain

    def cublas_chain(self, kernel: str):
        """The same weights through ``F.linear`` alone (cuBLAS on a GPU): the GEMM without its fusions, the
        general path's projection, as the reference the tuned plan is read against."""
        c = self.c
        ws = {"qkv_rope": c.wqkv, "o_proj": c.wo, "gate_up": c.wgu, "down": c.wd}[kernel]
        x_in = {"qkv_rope": c.x, "o_proj": c.attn, "gate_up": c.x, "down": c.act}[kernel]
        out = torch.empty(c.t, ws[0].shape[0], dtype=c.dt, device=c.dev)

        def chain() -> int:
            for w in ws:
                torch.nn.functional.linear(x_in, w, out=out)
            return len(ws)
        return chain

    def qkv_chain(self, plan: GemmPlan):
        c, s = self.c, self.c.s
        hq, hkv, d = s["heads"], s["kv_heads"], s["head_dim"]
        if qkv_workspace_numel(plan, hq, hkv, d) > self.ws.numel():
            return None
        _, _, pos, loc = c.decode_batch(c.t, 1)

        late = late_qk(c.t, plan, c.qn is not None)

        def chain() -> int:
            for i, w in enumerate(c.wqkv):
                qkv_rope(c.x, self.norm(i), w, num_heads=hq, num_kv_heads=hkv, q_norm=c.qn, k_norm=c.kn, cos=c.cos,
                         sin=c.sin, positions=pos, out_cache_loc=loc, q_out=c.q, k_buffer=c.kb[i % len(c.kb)],
                         v_buffer=c.vb[i % len(c.vb)], eps=bk.EPS, plan=plan, workspace=self.ws,
                         counters=c.counters, use_pdl=self.pdl, qk_late=late)
            return len(c.wqkv)
        return chain


def gemm_shape(s: dict, kernel: str) -> tuple[int, int]:
    """(N, K) of the GEMM ``kernel`` (o_proj, gate_up: N per half, down) of a preset's shapes ``s``."""
    h = s["hidden"]
    return (s["inter"] if kernel == "gate_up" else h,
            {"o_proj": s["heads"] * s["head_dim"], "gate_up": h, "down": s["inter"]}[kernel])


def sweep(tuner: Tuner, kernel: str, smoke: bool, row1_only: bool = False) -> dict:
    """Default plan vs the best of the two-stage sweep for one kernel; returns a result row. ``row1_only``: only
    the one-row GEMV's sweep against the production plan (no small_gemm sweep)."""
    c, s = tuner.c, tuner.c.s
    h, d = s["hidden"], s["head_dim"]
    if kernel == "qkv_rope":
        n, k, gated, rows_of = (s["heads"] + 2 * s["kv_heads"]) * d, h, False, lambda bn: d
        default = dataclasses.replace(qkv_plan(s["heads"], s["kv_heads"], d, h, c.dt, c.dev,
                                                     qk_norm=s["qk_norm"]), row1=None)
        make = tuner.qkv_chain
        block_ns = [d]
    else:
        n, k = gemm_shape(s, kernel)
        gated = kernel == "gate_up"
        rows_of = (lambda bn: 2 * bn) if gated else (lambda bn: bn)
        default = dataclasses.replace(gemm_plan(n, k, c.dt, c.dev, gated=gated), row1=None)  # small_gemm alone
        make = lambda p: tuner.gemm_chain(kernel, p)  # noqa: E731
        block_ns = [16, 32] if smoke else [16, 32, 64, 128]
    results: dict[tuple, float] = {}

    def measure(p: GemmPlan) -> float:
        key = dataclasses.astuple(p)
        if key not in results:
            chain = make(p)
            results[key] = tuner.time(chain) if chain is not None else float("inf")
        return results[key]

    t_default = measure(default)
    if row1_only:
        r1 = {}
        if c.t == 1:
            r1 = row1_sweep(tuner, kernel, n, k, gated, default, t_default, smoke)
        return dict(kernel=kernel, rows=c.t, n=n, k=k, default=dataclasses.asdict(default), default_us=t_default, **r1)
    splits = [1, 2] if smoke else [1, 2, 4, 8, 16, 32]
    stage1 = []
    for bn in block_ns:
        for sk in splits:
            if k // sk < default.block_k:
                continue
            programs = triton.cdiv(n, bn) * sk
            if not smoke and not c.sms // 2 <= programs <= 16 * c.sms:
                continue
            p = make_plan(k, weight_rows=rows_of(bn), block_n=bn, split_k=sk, block_k=default.block_k,
                          num_warps=default.num_warps, num_stages=default.num_stages)
            stage1.append((measure(p), p))
    stage1.sort(key=lambda r: r[0])
    for _, p in stage1[: 1 if smoke else 2]:
        for bkk in ([64] if smoke else [64, 128, 256]):
            for nw in ([4] if smoke else [2, 4, 8]):
                if bkk * p.split_k <= 2 * k:
                    measure(make_plan(k, weight_rows=rows_of(p.block_n), block_n=p.block_n, split_k=p.split_k,
                                      block_k=bkk, num_warps=nw, num_stages=p.num_stages))
    top = GemmPlan(*min(results.items(), key=lambda kv: kv[1])[0])
    for ns in ([2] if smoke else [2, 3, 4, 5]):
        measure(dataclasses.replace(top, num_stages=ns))
    best_key, t_best = min(results.items(), key=lambda kv: kv[1])
    best = GemmPlan(*best_key)
    r1 = {}
    if c.t == 1:
        r1 = row1_sweep(tuner, kernel, n, k, gated, best, t_best, smoke)
    t_cublas = tuner.time(tuner.cublas_chain(kernel))
    row = dict(kernel=kernel, rows=c.t, default=dataclasses.asdict(default), default_us=t_default,
               best=dataclasses.asdict(best), best_us=t_best, cublas_us=t_cublas, candidates=len(results), n=n, k=k,
               **r1,
               all=sorted(([_fmt(GemmPlan(*key)), us] for key, us in results.items()), key=lambda r: r[1]))
    print(entry_line("TUNED", c.dev, kernel, n, k, c.dt, (best.block_n, best.block_k, best.split_k, best.num_warps,
                                                          best.num_stages)), flush=True)
    print(f"  {kernel:9} rows {c.t}: default {t_default:7.2f} us {_fmt(default)} | best {t_best:7.2f} us "
          f"{_fmt(best)} ({t_default / t_best:.2f}x, {len(results)} plans) | torch F.linear alone {t_cublas:7.2f} us "
          f"(best / F.linear {t_best / t_cublas:.2f})", flush=True)
    return row


def row1_sweep(tuner: Tuner, kernel: str, n: int, k: int, gated: bool, best: GemmPlan, t_best: float,
               smoke: bool) -> dict:
    """The one-row GEMV (``GemmPlan.row1``) over rows per program, K chunk, warps and stages, against ``best``
    (small_gemm's best plan, ``t_best`` µs) at 1 row; prints the fastest and the ratio, returns them as a dict
    (empty when no candidate fits). ``best`` has no ``row1`` (every swept plan is small_gemm's alone)."""

    def timed(r1: GemvPlan) -> tuple[float, GemvPlan]:
        plan = dataclasses.replace(best, row1=r1)
        chain = tuner.qkv_chain(plan) if kernel == "qkv_rope" else tuner.gemm_chain(kernel, plan)
        return (tuner.time(chain) if chain is not None else float("inf")), r1

    results = []
    if kernel == "qkv_rope":  # one program per head and split: (K chunk, split-K, warps) within the registers
        d = tuner.c.s["head_dim"]
        for bkk in ([16] if smoke else [128, 256, 512]):
            for sk in ([2] if smoke else [2, 4, 8]):
                for nw in ([4] if smoke else [4, 8]):
                    if d * bkk > 4096 * nw or bkk * sk > k:
                        continue
                    results.append(timed(GemvPlan(block_n=d, block_k=bkk, num_warps=nw, num_stages=1, split_k=sk)))
        # the row-pair form: 2-16 rows of a head per program, all of K, no ticket; with q/k norm it leaves q and k
        # raw for the attention (late q/k), whose extra work this chain does not time: confirm with mega-ab
        for bn in ([4] if smoke else [4, 8, 16]):
            for bkk in ([32] if smoke else [1024, 2048]):
                for nw in ([4] if smoke else [4, 8]):
                    if bn >= d or bkk > triton.next_power_of_2(k) or bn * bkk > 4096 * nw:
                        continue
                    results.append(timed(GemvPlan(block_n=bn, block_k=bkk, num_warps=nw, num_stages=1)))
    for bn in ([] if kernel == "qkv_rope" else [4] if smoke else [2, 4, 8]):
        for bkk in ([64] if smoke else [1024, 2048]):
            for nw in ([4] if smoke else [4, 8]):
                if bkk > triton.next_power_of_2(k) or bn * bkk * (2 if gated else 1) > 4096 * nw:
                    continue
                results.append(timed(GemvPlan(block_n=bn, block_k=bkk, num_warps=nw, num_stages=1)))
    if not results:
        return {}
    results.append(timed(dataclasses.replace(min(results, key=lambda r: r[0])[1], num_stages=3)))
    t1, r1 = min(results, key=lambda r: r[0])
    print(f"  {kernel:9} rows 1: one-row FMA best {t1:7.2f} us bn{r1.block_n} bk{r1.block_k} w{r1.num_warps} "
          f"s{r1.num_stages} sk{r1.split_k} ({len(results)} plans) | tl.dot plan {t_best:7.2f} us "
          f"(FMA / tl.dot {t1 / t_best:.2f})", flush=True)
    print(entry_line("TUNED_ROW1", tuner.c.dev, kernel, n, k, tuner.c.dt, tuple(dataclasses.astuple(r1))), flush=True)
    return dict(row1_best=dataclasses.asdict(r1), row1_us=t1,
                row1_all=[[dataclasses.asdict(p), us] for us, p in results])


def stream_sweep(tuner: Tuner, kernel: str, smoke: bool) -> dict:
    """The one-row GEMV's weight stream (``GemvPlan.per_sm`` > 0) against the production one-row plan of
    ``kernel`` (o_proj, gate_up or down) at 1 row. Stage 1 sweeps (rows per program, programs per SM; 0 is the
    per-tile kernel, so each form's best on this GPU is known) at the production K chunk and warps; stage 2 K chunk
    and warps around the two best; then stages 1 / 3 for the best. Prints production, best (> 1: faster), the
    per-tile best and ``F.linear``; returns them."""
    n, k = gemm_shape(tuner.c.s, kernel)
    gated = kernel == "gate_up"
    prod = gemm_plan(n, k, tuner.c.dt, tuner.c.dev, gated=gated)
    results: dict[GemvPlan, float] = {}

    def measure(r1: GemvPlan) -> float:
        w_elems = r1.block_n * r1.block_k * (2 if gated else 1)
        if r1 not in results and r1.block_k <= triton.next_power_of_2(k) and w_elems <= 4096 * r1.num_warps:
            chain = tuner.gemm_chain(kernel, dataclasses.replace(prod, row1=r1))
            results[r1] = tuner.time(chain) if chain is not None else float("inf")
        return results.get(r1, float("inf"))

    t_prod = tuner.time(tuner.gemm_chain(kernel, prod))
    base = prod.row1 or GemvPlan(4, 1024, 4, 1)
    for bn in ([2, 4] if smoke else [1, 2, 4, 8]):
        for per_sm in ([0, 1] if smoke else [0, 1, 2, 4, 8]):
            measure(dataclasses.replace(base, block_n=bn, per_sm=per_sm, split_k=1))
    top2 = sorted(results, key=results.get)[:2]
    for r1 in top2:
        for bkk in ([32, 64] if smoke else [512, 1024, 2048]):
            for nw in ([4] if smoke else [4, 8]):
                measure(dataclasses.replace(r1, block_k=bkk, num_warps=nw))
    best = min(results, key=results.get)
    for ns in (1, 3):
        measure(dataclasses.replace(best, num_stages=ns))
    best = min(results, key=results.get)
    tile_best = min((p for p in results if not p.per_sm), key=results.get)
    t_best, t_cublas = results[best], tuner.time(tuner.cublas_chain(kernel))
    print(f"  {kernel:9} rows 1: production {t_prod:7.2f} us {prod.row1} | best {t_best:7.2f} us bn"
          f"{best.block_n} bk{best.block_k} w{best.num_warps} s{best.num_stages} per_sm{best.per_sm} "
          f"({t_prod / t_best:.2f}x, {len(results)} plans) | per-tile best {results[tile_best]:7.2f} us bn"
          f"{tile_best.block_n} bk{tile_best.block_k} w{tile_best.num_warps} s{tile_best.num_stages} | F.linear "
          f"{t_cublas:7.2f} us", flush=True)
    print(entry_line("TUNED_ROW1", tuner.c.dev, kernel, n, k, tuner.c.dt, tuple(dataclasses.astuple(best))), flush=True)
    return dict(kernel=kernel, rows=1, n=n, k=k, production=dataclasses.asdict(prod.row1) if prod.row1 else None,
                production_us=t_prod, best=dataclasses.asdict(best), best_us=t_best, cublas_us=t_cublas,
                tile_best=dataclasses.asdict(tile_best), tile_us=results[tile_best],
                all=sorted(([dataclasses.asdict(p), us] for p, us in results.items()), key=lambda r: r[1]))


def entry_line(table: str, dev: torch.device, kernel: str, n: int, k: int, dtype: torch.dtype,
               value: tuple[int, ...]) -> str:
    """A paste-ready ``tuned_plans`` line for ``table`` (``TUNED``: BLOCK_N, BLOCK_K, split-K, warps, stages;
    ``TUNED_ROW1``: BLOCK_N, BLOCK_K, warps, stages[, split-K[, per_sm]]), keyed as the lookups read it."""
    kind = {"qkv_rope": "qkv", "gate_up": "gated"}.get(kernel, "gemm")
    key = (device_name(dev), kind, n, k, str(dtype).removeprefix("torch."))
    return f"    {table} entry: {key!r}: {value!r},"


def _fmt(p: GemmPlan) -> str:
    return f"bn{p.block_n} sk{p.split_k} bk{p.block_k} w{p.num_warps} s{p.num_stages} pre{p.pre_k}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-30b-a3b")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--kernels", default="qkv_rope,o_proj,gate_up,down")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None, help="write the result rows here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few plans, CPU interpreter")
    ap.add_argument("--row1-only", action="store_true",
                    help="only sweep the one-row GEMV against the production plan (at --rows 1)")
    ap.add_argument("--stream", action="store_true",
                    help="only sweep the one-row GEMV's weight stream (per_sm) against the production one-row plan "
                         "(o_proj, gate_up, down; 1 row)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    rows_out = []
    print(plan_sources_line(dev), flush=True)
    if dev.type == "cuda":
        for pdl in (True, False):
            for programs in (1, 132, 528):
                us = bk.time_chain(nop_chain(dev, programs, pdl), dev, args.reps) * 1e6
                print(f"do-nothing kernel, {programs:3} programs, PDL {'on ' if pdl else 'off'}: {us:.2f} us/launch")
                rows_out.append(dict(kernel="nop", programs=programs, pdl=pdl, us=us))
    for m in (["tiny"] if args.smoke else args.models.split(",")):
        for r in (int(x) for x in args.rows.split(",")):
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
            case = bk.Case(m, r, 40 if args.smoke else 512, dev, dtype)
            tuner = Tuner(case, args.reps)
            note = " (prenorm step: qkv_rope and gate_up without their norm prologue)" if tuner.prenorm else ""
            print(f"{m}, {r} rows{note}", flush=True)
            for kern in args.kernels.split(","):
                if kern in ("gate_up", "down") and not case.s["inter"]:
                    continue
                if args.stream:
                    if kern != "qkv_rope" and r == 1:
                        rows_out.append(dict(model=m, **stream_sweep(tuner, kern, args.smoke)))
                    continue
                rows_out.append(dict(model=m, **sweep(tuner, kern, args.smoke, args.row1_only)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
