"""Which engine activity leaves a path's CUDA-graph replay slower: lowlat bench's DECODE step between activities.

    python bench/scripts/replay_drift.py --model llama-3.2-1b --path general --batch 1

On the H200, the general path's graph replay at batch 1 (llama-3.2-1b, KV 960-1120) measured 1.06 ms in a fresh
engine and 1.12 ms after an overlapped ``Engine.generate`` in the same engine, at every KV length; nvidia_mega's
did not move (bench/results/2026-12-01-h200-e2e-gptfast-drift). The cause was torch's cuDNN SDPA backend in the
prefill (``--sdpa-backend cudnn`` reproduces it; bench/results/2026-12-01-h200-cudnn-drift), which
``lowlat.layers.attention.sdpa`` now excludes. This script measures the step (``lowlat bench``'s
``measure_shape``: step and pure replay, median µs) after each of, in order:

1. nothing (twice);
2. an eager bf16 GEMM and an eager causal SDPA (``lowlat.layers.attention.sdpa``) of the prefill's shapes;
3. the same GEMM on a new thread (its own cuBLAS handle);
4. a PREFILL through ``ModelRunner.forward`` on the main thread;
5. a prefill through ``Engine.generate`` (run on the step watchdog's thread; one new token, plain loop);
6. plain decode (``overlap=False``), overlapped decode, and ``torch.cuda.empty_cache()``;
7. the graphs captured again (``ModelRunner.init_cuda_graphs``; on the H200 at main ba4dcc9 these replayed 62 µs
   slower, a second effect not yet diagnosed);
8. a second Engine built in the same process after the first closed (``lowlat bench`` builds a runner per path
   and per layer depth in one process);

so the activity that causes the drift shows as the first row that moves. With ``--kernels``, the step is also
profiled (torch.profiler, CUDA activity: graph replays included) in the fresh engine, after the overlapped decode,
after the recapture and in the second engine, and for each later profile the kernels whose device time plus idle
time before them moved most against the fresh one are printed.

Diagnostic only (no pass/fail); CUDA.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch
from lowlat import Engine, EngineConfig, SamplingParams
from lowlat.bench.config import GENERAL_VARIANTS
from lowlat.forward_batch import ForwardMode
from lowlat.layers.attention import sdpa
from lowlat.runtime.overlap import OverlapLoop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overlap_phases import bench_step  # noqa: E402


def kernel_means(engine: Engine, batch: int, context: int) -> dict[str, tuple[float, float, int]]:
    """Per CUDA kernel name over one ``bench_step`` under torch.profiler: (mean device µs, mean idle µs before it
    since the previous kernel ended, launches); idle spans of 50 µs or more (host waits) count as 0."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        bench_step(engine, batch, context)
    kernels = sorted(
        (ev for ev in prof.events() if ev.device_type == DeviceType.CUDA), key=lambda ev: ev.time_range.start
    )
    sums: dict[str, list[float]] = {}
    prev_end = None
    for ev in kernels:
        gap = 0.0 if prev_end is None else ev.time_range.start - prev_end
        prev_end = max(prev_end or 0.0, ev.time_range.end)
        acc = sums.setdefault(ev.name, [0.0, 0.0, 0])
        acc[0] += ev.time_range.elapsed_us()
        acc[1] += gap if 0.0 < gap < 50.0 else 0.0
        acc[2] += 1
    return {name: (t / n, g / n, n) for name, (t, g, n) in sums.items()}


def print_kernel_moves(
    before: dict[str, tuple[float, float, int]], after: dict[str, tuple[float, float, int]], top: int = 12
) -> None:
    """The ``top`` kernels whose launch-weighted device time plus idle-before time moved most between two
    ``kernel_means``."""
    rows = []
    for name in before.keys() | after.keys():
        (b, bg, nb), (a, ag, na) = before.get(name, (0.0, 0.0, 0)), after.get(name, (0.0, 0.0, 0))
        rows.append(((a + ag) * na - (b + bg) * nb, name, b, bg, nb, a, ag, na))
    rows.sort(key=lambda r: -abs(r[0]))
    print(
        "\n| kernel | fresh µs | idle before | n | after µs | idle before | n | total moved µs |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for d, name, b, bg, nb, a, ag, na in rows[:top]:
        print(f"| {name[:80]} | {b:.2f} | {bg:.2f} | {nb} | {a:.2f} | {ag:.2f} | {na} | {d:+.0f} |", flush=True)
    idle = [sum(g * n for _, g, n in m.values()) for m in (before, after)]
    print(f"\nidle between kernels (< 50 µs spans), whole bench step: fresh {idle[0]:.0f} µs, after {idle[1]:.0f} µs")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--path", default="general")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--kernels", action="store_true", help="profile the step's kernels fresh and after decode")
    ap.add_argument(
        "--sdpa-backend",
        choices=("flash", "efficient", "cudnn", "math"),
        help="only: fresh, one eager SDPA of this backend (the kernels with --kernels)",
    )
    args = ap.parse_args()
    general = GENERAL_VARIANTS.get(args.path)
    cfg = EngineConfig(
        model=args.model,
        device="cuda",
        dtype="bfloat16",
        plugin="none" if general else args.path,
        general_impl=general or "auto",
        max_batch_size=2 * args.batch,
        max_verify_tokens=1,
        max_context_len=args.context + 128,
        overlap=True,
        chunked_prefill_size=max(4096, args.batch * args.context),
    )
    vocab_gen = torch.Generator().manual_seed(0)
    with Engine(cfg) as e:
        prompts = torch.randint(
            0, e.model_config.vocab_size, (args.batch, args.context - 64), generator=vocab_gen
        ).tolist()

        def show(label: str, engine: Engine = e) -> None:
            step, replay = bench_step(engine, args.batch, args.context)
            print(f"| {args.path} | {args.batch} | {label} | {step:.1f} | {replay:.1f} |", flush=True)

        def generate(overlap: bool, n: int) -> None:
            e.overlap = OverlapLoop(e) if overlap else None
            e.generate(prompts, SamplingParams(max_new_tokens=n, stop_at_eos=False))

        print("| path | batch | after | bench step us | replay us |\n|---|---|---|---|---|")
        show("fresh engine")
        show("fresh engine, again")
        fresh = kernel_means(e, args.batch, args.context) if args.kernels else None
        dev, bf16 = e.runner.device, torch.bfloat16
        hidden, inter = e.model_config.hidden_size, e.model_config.intermediate_size
        a, w = (
            torch.randn(args.context, hidden, device=dev, dtype=bf16),
            torch.randn(hidden, inter, device=dev, dtype=bf16),
        )
        for _ in range(3):
            a @ w
        show(f"an eager bf16 GEMM [{args.context}, {hidden}] x [{hidden}, {inter}]")
        hq, hkv = e.model_config.num_attention_heads, e.model_config.num_key_value_heads
        d = e.model_config.head_dim
        q = torch.randn(1, hq, args.context, d, device=dev, dtype=bf16)
        kv = torch.randn(1, hkv, args.context, d, device=dev, dtype=bf16)
        if args.sdpa_backend:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = {
                "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION,
                "math": SDPBackend.MATH,
            }[args.sdpa_backend]
            kv = kv.repeat_interleave(hq // hkv, dim=1)  # not every backend takes enable_gqa
            with sdpa_kernel([backend]):
                for _ in range(3):
                    torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True)
            torch.cuda.synchronize()
            show(f"an eager causal SDPA over {args.context} tokens, {args.sdpa_backend} backend only")
            if fresh is not None:
                print_kernel_moves(fresh, kernel_means(e, args.batch, args.context))
            return 0
        for _ in range(3):
            sdpa(q, kv, kv, is_causal=True, enable_gqa=True)
        show(f"an eager causal SDPA over {args.context} tokens (lowlat.layers.attention.sdpa: no cuDNN)")
        worker = threading.Thread(target=lambda: [a @ w for _ in range(3)] and torch.cuda.synchronize())
        worker.start()
        worker.join()
        show("the same GEMM on a new thread (its own cuBLAS handle)")
        row = e.runner.kv_pool.alloc_req()
        try:
            e.runner.forward(e.runner.prepare_batch(ForwardMode.PREFILL, [row], [0], [prompts[0]]))
            torch.cuda.synchronize()
        finally:
            e.runner.kv_pool.free_req(row)
        show("a PREFILL through ModelRunner.forward on this thread")
        generate(False, 1)
        show("a prefill (1 new token)")
        generate(False, args.new_tokens)
        show(f"plain decode ({args.new_tokens} tokens)")
        generate(True, args.new_tokens)
        show(f"overlapped decode ({args.new_tokens} tokens)")
        moved = kernel_means(e, args.batch, args.context) if args.kernels else None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        show("torch.cuda.empty_cache()")
        e.runner.graph_runner.close()
        e.runner.init_cuda_graphs()  # the same StepInputs: the scheduler's builder keeps feeding them
        show("the graphs captured again, after all of the above")
        recaptured = kernel_means(e, args.batch, args.context) if args.kernels else None
    with Engine(cfg) as second:  # lowlat bench builds a runner per path and layer depth in one process
        show("a second engine in this process (the first closed)", second)
        again = kernel_means(second, args.batch, args.context) if args.kernels else None
    for label, later in (("after the overlapped decode", moved), ("graphs captured again", recaptured),
                         ("a second engine", again)):
        if fresh is not None and later is not None:
            print(f"\nfresh engine against {label}:")
            print_kernel_moves(fresh, later)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
