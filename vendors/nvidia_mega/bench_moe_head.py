"""Time ``moe_forward`` and the fused LM head (logits, greedy, filtered sampling) at Qwen3-30B-A3B shapes on an
sm90 GPU, with PDL on and off, against the byte floor; check them against torch first. About a minute.

    PYTHONPATH=core/src:vendors/nvidia_mega/src python vendors/nvidia_mega/bench_moe_head.py [--sweep [moe|lm_head]]

Method: each measurement is one CUDA graph holding ``--layers`` back-to-back launches over distinct weight copies
(so the 50 MB L2 never holds the next weights, and consecutive launches overlap through PDL as in a real step);
the graph is replayed ``--reps`` times and the median replay time is divided by the number of launches. Floor:
bytes that must move (router + the experts actually selected, counted from each launch's routing; or the whole
vocabulary weight) divided by the copy bandwidth measured at the start (device-to-device copy, bytes read plus
written, the roofline method of docs/benchmarks.md). Targets: qwen3-30b-a3b decode <= 2.0 ms per step at
batch 1 (48 MoE layers + LM head).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_kernels import copy_bandwidth, time_chain  # the same timing method as the kernel bench
from lowlat.layers.norm import rms_norm
from lowlat_nvidia_mega.kernels.lm_head import LMHeadConfig, lm_head_logits, lm_head_sample
from lowlat_nvidia_mega.kernels.moe import MoEKernelConfig, MoEStages, MoEWorkspace, moe_forward, moe_stages
from lowlat_nvidia_mega.kernels.sampling import LMHeadWorkspace

H, E, TOP_K, INTER, V = 2048, 128, 8, 768, 151936
EPS = 1e-6
DT = torch.bfloat16
DEV = "cuda"


def copy_bandwidth_here() -> float:
    """Copy bandwidth (bytes/s, read + written) on the GPU; NaN in --smoke mode on the CPU."""
    return copy_bandwidth(torch.device(DEV)) if DEV == "cuda" else float("nan")


def graph_seconds(chain: Callable[[], int], reps: int) -> float:
    """Seconds per launch of ``chain`` from median CUDA-graph replays (bench_kernels.time_chain)."""
    return time_chain(chain, torch.device(DEV), reps)


def rand(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=DEV) * std).to(DT)


class MoELayers:
    """``n`` distinct MoE layers (router std chosen so routing is decisive, few bf16 ties)."""

    def __init__(self, n: int, gen: torch.Generator) -> None:
        self.gate = [rand(gen, E, H, std=3 / H**0.5) for _ in range(n)]
        self.w13 = [rand(gen, E, 2 * INTER, H, std=0.02) for _ in range(n)]
        self.w2 = [rand(gen, E, H, INTER, std=0.02) for _ in range(n)]
        self.norm = [(1 + 0.1 * torch.randn(H, generator=gen, device=DEV)).to(DT) for _ in range(n)]


def moe_reference(x, residual, norm_w, gate_w, w13, w2):  # type: ignore[no-untyped-def]
    """HF order of operations; top-k by a stable sort (ties -> lower expert id, as the kernel)."""
    h = rms_norm(x, norm_w, EPS)
    probs = torch.softmax(F.linear(h, gate_w), dim=-1, dtype=torch.float32)
    w, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    w, ids = w[:, :TOP_K], ids[:, :TOP_K]
    w = (w / w.sum(-1, keepdim=True)).to(DT)
    y = residual.float().clone()
    for r in range(x.shape[0]):
        for j in range(TOP_K):
            e = int(ids[r, j])
            act = F.silu(F.linear(h[r], w13[e, :INTER])) * F.linear(h[r], w13[e, INTER:])
            y[r] += F.linear(act, w2[e]).float() * w[r, j].float()
    return y.to(DT), ids


TDOT_CFG = MoEKernelConfig(row1=False)  # the tl.dot forms at one row too, checked and timed beside the default


def check_moe(layers: MoELayers, gen: torch.Generator, cfg: MoEKernelConfig, row_counts: tuple[int, ...] = (1, 8),
              form: str = "") -> list[str]:
    notes = []
    for rows in row_counts:
        x, res = rand(gen, rows, H, std=1.0), rand(gen, rows, H, std=1.0)
        ws = MoEWorkspace.allocate(8, H, INTER, E, TOP_K, DT, DEV)
        outs = []
        for pdl in (True, False, True) if DEV == "cuda" else (False, False):
            out = torch.full_like(x, float("nan"))
            moe_forward(x, res, layers.norm[0], EPS, layers.gate[0], layers.w13[0], layers.w2[0], TOP_K, True,
                        out, ws, pdl=pdl, config=cfg)
            outs.append(out)
        want, ids = moe_reference(x, res, layers.norm[0], layers.gate[0], layers.w13[0], layers.w2[0])
        err = ((outs[0].float() - want.float()).norm() / (want.float() - res.float()).norm()).item()
        same_ids = torch.equal(ws.topk_ids[:rows].long(), ids)
        ok = err < 2e-2 and same_ids and all(torch.equal(outs[0], o) for o in outs[1:])
        notes.append(f"moe rows={rows}{form}: rel err {err:.2e}, top-k ids equal: {same_ids}, "
                     f"pdl on/off/on bitwise equal: {all(torch.equal(outs[0], o) for o in outs[1:])} "
                     f"-> {'OK' if ok else 'FAILED'}")
    return notes


@triton.jit
def _uniform_kernel(seed_ptr, offset_ptr, out_ptr, V, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = tl.rand(tl.load(seed_ptr + r), tl.load(offset_ptr + r) + offs.to(tl.int64))
    tl.store(out_ptr + r * V + offs, u, mask=offs < V)


def reference_tokens(logits, temp, top_k, top_p, u, cand):  # type: ignore[no-untyped-def]
    """The semantics documented in kernels/sampling.py (same as tests/test_kernels_lm_head.py)."""
    out = []
    for r in range(logits.shape[0]):
        lg, t, k, p = logits[r], float(temp[r]), int(top_k[r]), float(top_p[r])
        if t <= 0:
            out.append(int(torch.argmax(lg)))
            continue
        score = lg / t - torch.log(-torch.log(u[r]))
        k_on = 0 < k < lg.numel()
        if not (k_on or p < 1.0):
            out.append(int(torch.argmax(score)))
            continue
        ids = torch.argsort(-lg, stable=True)[:cand][:min(k, cand) if k_on else cand]
        e = torch.exp((lg[ids] - lg[ids[0]]) / t)
        z = e.sum() if k_on and k <= cand else torch.exp((lg - lg[ids[0]]) / t).sum()
        keep = ids[(torch.cumsum(e, 0) - e) < p * z]
        out.append(int(keep[torch.argmax(score[keep])]))
    return out


def check_lm_head(w: torch.Tensor, norm_w: torch.Tensor, gen: torch.Generator, ws: LMHeadWorkspace) -> list[str]:
    x = rand(gen, 8, H, std=1.0)
    logits = torch.empty(8, V, device=DEV)
    pdl = DEV == "cuda"
    lm_head_logits(x, norm_w, w, EPS, logits, pdl=pdl)
    want = F.linear(rms_norm(x, norm_w, EPS), w).float()
    err = (logits - want).abs().max().item()
    toks = torch.empty(8, dtype=torch.int64, device=DEV)
    lm_head_sample(x, norm_w, w, EPS, None, None, None, None, None, toks, ws, pdl=pdl)
    greedy_ok = torch.equal(toks, torch.argmax(logits, -1))
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.6, 1.0, 2.0, 0.9], device=DEV)
    top_k = torch.tensor([0, 0, 20, 0, 50, 64, 100, 0], dtype=torch.int32, device=DEV)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.95, 0.8, 1.0, 0.3], device=DEV)
    seeds = torch.arange(8, device=DEV) + 77
    offsets = torch.arange(8, device=DEV) * V
    lg2 = torch.empty_like(logits)
    lm_head_sample(x, norm_w, w, EPS, temp, top_k, top_p, seeds, offsets, toks, ws, pdl=pdl, out_logits=lg2)
    u = torch.empty(8, V, device=DEV)
    _uniform_kernel[(8, triton.cdiv(V, 1024))](seeds, offsets, u, V, BLOCK=1024)
    ref = reference_tokens(lg2.cpu(), temp.cpu(), top_k.cpu(), top_p.cpu(), u.cpu(), ws.candidates)
    sample_ok = toks.cpu().tolist() == ref
    ok = err <= 0.0625 * max(1.0, want.abs().max().item() / 8) and greedy_ok and sample_ok
    return [f"lm_head: max |logit err| {err:.3g}, greedy == argmax: {greedy_ok}, sampled == reference "
            f"(same noise): {sample_ok} {toks.cpu().tolist()} vs {ref} -> {'OK' if ok else 'FAILED'}"]


def moe_chain(layers: MoELayers, rows: int, gen: torch.Generator, cfg: MoEKernelConfig,
              pdl: bool) -> tuple[list[MoEStages], list[MoEWorkspace]]:
    """One ``MoEStages`` per layer (checked once, by ``moe_stages``) and its workspace: layer i reads layer i-1's
    output, like the residual stream."""
    x = rand(gen, rows, H, std=1.0)
    outs = [torch.empty_like(x) for _ in layers.gate]
    wss = [MoEWorkspace.allocate(8, H, INTER, E, TOP_K, DT, DEV) for _ in layers.gate]
    stages = [moe_stages(x if i == 0 else outs[i - 1], x if i == 0 else outs[i - 1], layers.norm[i], EPS,
                         layers.gate[i], layers.w13[i], layers.w2[i], TOP_K, True, outs[i], wss[i], pdl=pdl,
                         config=cfg) for i in range(len(layers.gate))]
    return stages, wss


def bench_moe(layers: MoELayers, rows: int, pdl: bool, reps: int, gen: torch.Generator, bw: float,
              cfg: MoEKernelConfig) -> tuple[float, float]:
    n = len(layers.gate)
    stages, wss = moe_chain(layers, rows, gen, cfg, pdl)

    def chain() -> int:
        for st in stages:  # moe_forward's three launches
            st.route(), st.gate_up(), st.down()
        return n
    sec = graph_seconds(chain, reps)
    experts = sum(int(ws.num_slots) for ws in wss) / n
    floor = (E * H + experts * 3 * INTER * H + 3 * rows * H) * 2 / bw
    return sec, floor


STAGE_SETS = {  # what one layer of the chain launches: prefixes of route -> gate_up -> down, and each alone
    "route": ("route",), "route+gate_up": ("route", "gate_up"), "route+gate_up+down": ("route", "gate_up", "down"),
    "gate_up alone": ("gate_up",), "down alone": ("down",),
}


def bench_moe_stages(layers: MoELayers, rows: int, reps: int, gen: torch.Generator, bw: float,
                     cfg: MoEKernelConfig) -> list[tuple[str, float, float]]:
    """Seconds per layer of each ``STAGE_SETS`` chain (PDL on). A stage run "alone" reads the routing (and
    ``act``) its layer computed in a full pass just before, so it times the weight stream without the chain's
    dependency on the stage before it; the prefixes' differences are each stage's cost inside the chain.
    Returns (label, seconds, floor seconds: the weight bytes of the stages launched at ``bw``)."""
    n = len(layers.gate)
    stages, wss = moe_chain(layers, rows, gen, cfg, DEV == "cuda")
    for st in stages:  # a full pass: every workspace holds its routing and act
        st.route(), st.gate_up(), st.down()
    experts = sum(int(ws.num_slots) for ws in wss) / n
    weight_bytes = {"route": E * H * 2, "gate_up": experts * 2 * INTER * H * 2, "down": experts * INTER * H * 2}
    results = []
    for label, names in STAGE_SETS.items():
        def chain(names: tuple[str, ...] = names) -> int:
            for st in stages:
                for name in names:
                    getattr(st, name)()
            return n
        results.append((label, graph_seconds(chain, reps), sum(weight_bytes[m] for m in names) / bw))
    return results


def bench_lm_head(ws_list, norms, rows, mode, pdl, reps, gen, bw, cfg):  # type: ignore[no-untyped-def]
    x = rand(gen, rows, H, std=1.0)
    out = torch.empty(rows, V, device=DEV)
    toks = torch.empty(rows, dtype=torch.int64, device=DEV)
    temp = torch.full((rows,), 0.7, device=DEV)
    top_k = torch.full((rows,), 20, dtype=torch.int32, device=DEV)
    top_p = torch.full((rows,), 0.95, device=DEV)
    seeds = torch.arange(rows, device=DEV)
    offsets = torch.zeros(rows, dtype=torch.int64, device=DEV)
    wss, weights = ws_list

    def chain() -> int:
        for i, w in enumerate(weights):
            if mode == "logits":
                lm_head_logits(x, norms[i], w, EPS, out, pdl=pdl, config=cfg)
            elif mode == "greedy":
                lm_head_sample(x, norms[i], w, EPS, None, None, None, None, None, toks, wss, pdl=pdl, config=cfg)
            else:
                lm_head_sample(x, norms[i], w, EPS, temp, top_k, top_p, seeds, offsets, toks, wss, pdl=pdl,
                               config=cfg)
        return len(weights)
    sec = graph_seconds(chain, reps)
    return sec, (V * H * 2 + rows * H * 2 + (rows * V * 4 if mode == "logits" else 0)) / bw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="distinct MoE layers per graph (default 8)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays (median taken)")
    ap.add_argument("--sweep", nargs="?", const="all", choices=("all", "moe", "lm_head"),
                    help="also try other tile sizes (PDL on): the MoE's, the LM head's, or both (no value)")
    ap.add_argument("--stages", action="store_true",
                    help="also time the MoE's route / gate_up / down stages: chain prefixes and each alone")
    ap.add_argument("--smoke", action="store_true",
                    help="check the script itself: tiny shapes on the CPU with TRITON_INTERPRET=1, no timing")
    args = ap.parse_args()
    global H, E, TOP_K, INTER, V, DEV
    if args.smoke:
        H, E, TOP_K, INTER, V, DEV = 64, 8, 2, 32, 512, "cpu"
        args.layers, args.reps = 2, 1
    else:
        assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (sm90 for PDL)"
    pdl_modes = (True, False) if DEV == "cuda" else (False,)
    gen = torch.Generator(device=DEV).manual_seed(0)
    device_name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)"
    print(f"{device_name} | torch {torch.__version__} | triton {triton.__version__}")
    bw = copy_bandwidth_here()
    print(f"copy bandwidth (read + written): {bw / 1e12:.2f} TB/s")
    layers = MoELayers(args.layers, gen)
    lm_w = [rand(gen, V, H, std=0.02) for _ in range(3)]
    lm_norm = [(1 + 0.1 * torch.randn(H, generator=gen, device=DEV)).to(DT) for _ in range(3)]
    lm_ws = LMHeadWorkspace.allocate(8, V, DEV)
    moe_cfg, lm_cfg = MoEKernelConfig(), LMHeadConfig()
    notes = check_moe(layers, gen, moe_cfg) + check_moe(layers, gen, TDOT_CFG, (1,), " (tl.dot forms)")
    for note in notes + check_lm_head(lm_w[0], lm_norm[0], gen, lm_ws):
        print("check:", note)

    table = []
    for rows in (1, 8):
        for pdl in pdl_modes:
            sec, floor = bench_moe(layers, rows, pdl, args.reps, gen, bw, moe_cfg)
            table.append(("moe_forward (per layer)", rows, pdl, "default", sec, floor))
    for mode in ("logits", "greedy", "sample top-k 20 top-p 0.95"):
        for rows in (1, 8):
            for pdl in pdl_modes:
                sec, floor = bench_lm_head((lm_ws, lm_w), lm_norm, rows, mode, pdl, args.reps, gen, bw, lm_cfg)
                table.append((f"lm_head {mode}", rows, pdl, "default", sec, floor))
    if args.stages:
        for rows, cfg, name in ((1, moe_cfg, "default"), (1, TDOT_CFG, "tl.dot forms"), (8, moe_cfg, "default")):
            for label, sec, floor in bench_moe_stages(layers, rows, args.reps, gen, bw, cfg):
                table.append((f"moe {label}", rows, DEV == "cuda", name, sec, floor))
    if args.sweep in ("all", "moe") and DEV == "cuda":
        both, one, eight = (1, 8), (1,), (8,)  # the row counts each entry is timed at
        moe_sweep = [(dict(gate_up_block_n=gn, gate_up_block_k=gk, down_block_n=dn), f"gu {gn}x{gk} down {dn}", both)
                     for gn, gk, dn in ((32, 256, 16), (16, 512, 16), (16, 128, 16), (16, 256, 32), (32, 128, 32))]
        moe_sweep += [(dict(route_warps=rw, route_programs=rp), f"route {rp}x{rw}w", both)
                      for rw, rp in ((1, 32), (2, 32), (4, 16), (4, 64))]
        moe_sweep += [(dict(gate_up_stages=st, gate_up_warps=wp), f"gu {st}st {wp}w", both)
                      for st, wp in ((3, 4), (4, 8))]
        # the one-row forms (1 row only): off, and gate/up tiles (rows per program, K chunk, warps, stages)
        moe_sweep += [(dict(row1=False), "r1 off (tl.dot forms)", one)]
        moe_sweep += [(dict(row1_block_n=bn, row1_block_k=bk, row1_warps=wp, row1_stages=st),
                       f"r1 gu {bn}x{bk} {wp}w {st}st", one)
                      for bn, bk, wp, st in ((4, 1024, 4, 3), (2, 2048, 4, 1), (8, 1024, 8, 3), (1, 1024, 4, 3))]
        moe_sweep += [(dict(down_block_n=bn, down_warps=wp), f"r1 down {bn} {wp}w", one)
                      for bn, wp in ((8, 4), (32, 8), (16, 8))]
        # down in I chunks (its K loop): (BLOCK_N, I chunk, warps, stages), at 8 rows and at 1 (row1 forms)
        moe_sweep += [(dict(down_block_n=bn, down_block_i=bi, down_warps=wp, down_stages=st),
                       f"down8 {bn}x{bi} {wp}w {st}st", eight) for bn, bi, wp, st in
                      ((64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (32, 256, 4, 3),
                       (64, 128, 8, 4), (128, 256, 8, 3), (32, 128, 4, 4))]
        moe_sweep += [(dict(down_block_n=bn, down_block_i=bi, down_warps=wp, down_stages=st),
                       f"r1 down {bn}x{bi} {wp}w {st}st", one) for bn, bi, wp, st in
                      ((16, 256, 4, 3), (32, 256, 8, 3), (32, 512, 8, 1), (64, 256, 8, 3))]
        for kwargs, label, row_counts in moe_sweep:
            cfg = MoEKernelConfig(**kwargs)
            for rows in row_counts:
                sec, floor = bench_moe(layers, rows, True, args.reps, gen, bw, cfg)
                table.append(("moe_forward (per layer)", rows, True, label, sec, floor))
    if args.sweep in ("all", "lm_head") and DEV == "cuda":
        # the LM head's tiles: logits at 1 and 8 rows, greedy ids at 1 row (at the workspace's 128-token tiles);
        # min_rows=8 runs one row as 8 (on sm90 the dot then compiles to wgmma, as at 8 rows, not mma.sync)
        lm_sweep = [dict(block_v=bv, block_k=bk, num_stages=st) for bv, bk, st in
                    ((128, 64, 4), (128, 128, 2), (128, 256, 3), (64, 128, 4))]
        lm_sweep += [dict(block_v=bv, block_k=bk, num_stages=st, num_warps=wp, min_rows=8) for bv, bk, st, wp in
                     ((128, 128, 3, 4), (128, 128, 3, 8), (128, 256, 2, 4), (128, 64, 4, 4), (64, 128, 4, 4),
                      (64, 256, 3, 4), (256, 64, 3, 8))]
        for kwargs in lm_sweep:
            cfg = LMHeadConfig(**kwargs)
            label = f"v{cfg.block_v} k{cfg.block_k} s{cfg.num_stages} w{cfg.num_warps} m{cfg.min_rows}"
            for rows, mode in ((1, "logits"), (1, "greedy"), (8, "logits")) if cfg.block_v == 128 else ((1, "logits"),):
                sec, floor = bench_lm_head((lm_ws, lm_w), lm_norm, rows, mode, True, args.reps, gen, bw, cfg)
                table.append((f"lm_head {mode}", rows, True, label, sec, floor))

    print(f"\n{'kernel':34} {'rows':>4} {'pdl':>4} {'config':>24} {'median us':>10} {'floor us':>9} {'% floor':>8}")
    for name, rows, pdl, cfg_name, sec, floor in table:
        print(f"{name:34} {rows:>4} {'on' if pdl else 'off':>4} {cfg_name:>24} {sec * 1e6:>10.1f} "
              f"{floor * 1e6:>9.1f} {100 * floor / sec:>7.0f}%")
    moe1 = next(s for n, r, p, c, s, f in table if n.startswith("moe") and r == 1 and p == pdl_modes[0])
    head1 = next(s for n, r, p, c, s, f in table if n == "lm_head greedy" and r == 1 and p == pdl_modes[0])
    print(f"\nqwen3-30b-a3b batch 1, MoE part of a step: 48 x {moe1 * 1e6:.1f} us + greedy LM head "
          f"{head1 * 1e6:.1f} us = {(48 * moe1 + head1) * 1e3:.3f} ms (target for the whole step: 2.0 ms)")


if __name__ == "__main__":
    main()
