"""A PREFILL step's time with and without torch's cuDNN SDPA backend (``lowlat.layers.attention.sdpa``).

    python bench/scripts/prefill_sdpa.py --model llama-3.2-1b --tokens 1024,8192

The general path's prefill excludes cuDNN because one cuDNN SDPA call slows every later CUDA-graph replay of the
general path (bench/results/2026-12-01-h200-cudnn-drift). This prints what that costs the prefill (TTFT): one
request of each length (no cached prefix), the PREFILL through ``ModelRunner.forward``, median of 5 after 2
warm-ups (ms), every length without cuDNN first (the default), then every length with cuDNN as the only SDPA
backend (``sdpa_kernel([CUDNN_ATTENTION])``, which ``lowlat.layers.attention.sdpa`` leaves standing when cuDNN is
the only backend enabled: an error if cuDNN cannot run the shape, never a silent other backend). Diagnostic only;
CUDA.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from lowlat import Engine, EngineConfig
from lowlat.forward_batch import ForwardMode
from torch.nn.attention import SDPBackend, sdpa_kernel


def prefill_ms(e: Engine, n: int, reps: int = 5) -> float:
    ids = torch.randint(0, e.model_config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    times = []
    for i in range(reps + 2):
        row = e.runner.kv_pool.alloc_req()
        try:
            batch = e.runner.prepare_batch(ForwardMode.PREFILL, [row], [0], [ids])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            e.runner.forward(batch)
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
        finally:
            e.runner.kv_pool.free_req(row)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--tokens", default="1024,8192")
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    cfg = EngineConfig(model=args.model, device="cuda", dtype="bfloat16", plugin="none", max_batch_size=1,
                       max_context_len=max(lengths) + 64, chunked_prefill_size=max(lengths))
    with Engine(cfg) as e:
        print("| model | tokens | prefill ms, no cuDNN | prefill ms, cuDNN | no cuDNN / cuDNN |\n|---|---|---|---|---|")
        without = [prefill_ms(e, n) for n in lengths]
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            with_cudnn = [prefill_ms(e, n) for n in lengths]
        for n, a, b in zip(lengths, without, with_cudnn):
            print(f"| {args.model} | {n} | {a:.2f} | {b:.2f} | {a / b:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
