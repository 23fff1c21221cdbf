"""Per-op device time of the general path's pieces on a GPU: core Triton kernel vs plain torch vs torch.compile.

    python3 bench/scripts/bench_fused_kernels.py [--tokens 1,6,8,48] [--reps 50]

Shapes of llama-3.2-1b and qwen3-30b-a3b (bf16). Each op is captured ``reps`` times in one CUDA graph and the
replay time is divided by ``reps`` (median of 5 replays), so a figure is device time plus the in-graph launch
gap, which is what a decode step pays. The byte floor is bytes read + written / the measured copy bandwidth.
Prints a markdown table (``|`` rows).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from lowlat.kernels.moe_gemv import moe_experts_gemv
from lowlat.kernels.rms_norm import fused_add_rms_norm
from lowlat.kernels.rope_kv import qk_norm_rope_kv_write
from lowlat.kernels.silu_mul import silu_and_mul
from lowlat.layers.moe import FusedExperts
from lowlat.layers.rotary import RotaryEmbedding
from lowlat.models.general_impl import torch_add_rms_norm, torch_rope_kv, torch_silu_mul
from lowlat.runtime.distributed import SINGLE

MODELS = {  # hidden, q heads, kv heads, head_dim, qk norm, intermediate, experts, top_k, moe intermediate
    "llama-3.2-1b": (2048, 32, 8, 64, False, 8192, 0, 0, 0),
    "qwen3-30b-a3b": (2048, 32, 4, 128, True, 0, 128, 8, 768),
}
DEV = torch.device("cuda")
BF16 = torch.bfloat16


def graph_us(fn: Callable[[], object], reps: int) -> float:
    """Median µs per call of ``fn`` captured ``reps`` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def copy_gb_s() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    us = graph_us(lambda: y.copy_(x), 5)
    return 2 * x.numel() / us / 1e3


def rows(model: str, t: int, reps: int, compiled: bool) -> list[tuple[str, int, dict[str, float], int]]:
    h, hq, hkv, d, qk, inter, e, k, mi = MODELS[model]
    g = torch.Generator(device=DEV).manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, device=DEV)).to(BF16)

    x, r, w = rnd(t, h), rnd(t, h), rnd(h)
    rot = RotaryEmbedding(d, 1e6, None, 4096, device=DEV)
    qkv = rnd(t, (hq + 2 * hkv) * d)
    pos = torch.randint(0, 4096, (t,), device=DEV, generator=g)
    loc = torch.randperm(16384, device=DEV, generator=g)[:t]
    kb, vb = rnd(16384, hkv, d), rnd(16384, hkv, d)
    qn, kn = (rnd(d), rnd(d)) if qk else (None, None)
    gu = rnd(t, 2 * inter)
    ops: list[tuple[str, dict[str, Callable[[], object]], int]] = [
        ("add+rmsnorm", {"triton": lambda: fused_add_rms_norm(x, r, w, 1e-6),
                         "torch": lambda: torch_add_rms_norm(x, r, w, 1e-6)}, 2 * (3 * t * h + h)),
        ("qk-norm+rope+kv", {
            "triton": lambda: qk_norm_rope_kv_write(qkv, pos, rot.cos_cache, rot.sin_cache, loc, kb, vb,
                                                    num_q_heads=hq, num_kv_heads=hkv, head_dim=d, q_norm_weight=qn,
                                                    k_norm_weight=kn),
            "torch": lambda: torch_rope_kv(qkv, pos, rot.cos_cache, rot.sin_cache, loc, kb, vb, hq, hkv, d, qn, kn,
                                           1e-6)}, 2 * 2 * qkv.numel() + 4 * t * d),
    ]
    if not e:
        ops.append(("silu*mul", {"triton": lambda: silu_and_mul(gu), "torch": lambda: torch_silu_mul(gu)},
                    2 * 3 * t * inter))
    if compiled:
        fns = [torch.compile(f, fullgraph=True) for f in (torch_add_rms_norm, torch_rope_kv, torch_silu_mul)]
        ops[0][1]["compiled"] = lambda: fns[0](x, r, w, 1e-6)
        ops[1][1]["compiled"] = lambda: fns[1](qkv, pos, rot.cos_cache, rot.sin_cache, loc, kb, vb, hq, hkv, d, qn,
                                               kn, 1e-6)
        if not e:
            ops[2][1]["compiled"] = lambda: fns[2](gu)
    if e:
        ex = FusedExperts(e, h, mi, tp=SINGLE, dtype=BF16, device=DEV)
        ex.w13_weight.normal_(generator=g)
        ex.w2_weight.normal_(generator=g)
        hx = rnd(t, h)
        ids = torch.stack([torch.randperm(e, device=DEV, generator=g)[:k] for _ in range(t)])
        wts = torch.rand(t, k, device=DEV, generator=g).to(BF16)
        touched = len(set(ids.flatten().tolist()))
        if t * k <= 64:
            ops.append(("moe experts", {"triton": lambda: moe_experts_gemv(hx, ex.w13_weight, ex.w2_weight, wts, ids),
                                        "torch": lambda: ex._forward_grouped(hx, wts, ids)},
                        2 * touched * 3 * h * mi))
    return [(name, t, {k2: graph_us(f, reps) for k2, f in impls.items()}, nbytes) for name, impls, nbytes in ops]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,6,8,48")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    bw = copy_gb_s()
    print(f"copy bandwidth {bw:.0f} GB/s; torch {torch.__version__}")
    print("| model | op | T | triton us | torch us | compiled us | floor us |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for model in MODELS:
            for t in (int(s) for s in args.tokens.split(",")):
                for name, tt, us, nbytes in rows(model, t, args.reps, not args.no_compile):
                    c = f"{us['compiled']:.2f}" if "compiled" in us else "-"
                    print(f"| {model} | {name} | {tt} | {us['triton']:.2f} | {us['torch']:.2f} | {c} | "
                          f"{nbytes / bw / 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
