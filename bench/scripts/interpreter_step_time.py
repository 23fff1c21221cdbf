"""Time one interpreted plugin step on the CPU three ways: Triton's interpreter as it comes, with
``lowlat.fast_interpreter``'s once-per-launch patching only (its state before 2026-12-08), and with both speed-ups.

    TRITON_INTERPRET=1 .venv/bin/python bench/scripts/interpreter_step_time.py [--model tiny-llama]
        [--plugin nvidia_mega] [--rows 8] [--repeats 5]

Each way runs in its own process (the interpreter state is process-wide); one DECODE step of ``rows`` requests
that asks for sampled ids (top-k 3, temperature 1), best of ``repeats`` after one warm-up step. Prints seconds per
step and the ratios to the first way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

WAYS = {"triton as it comes": "off", "once-per-launch patching only": "patch", "both speed-ups": "both"}


def _step_time(model: str, plugin: str, rows: int, repeats: int, way: str) -> float:
    import torch
    from lowlat import fast_interpreter
    from lowlat.config import EngineConfig
    from lowlat.forward_batch import ForwardMode
    from lowlat.runtime import ModelRunner
    from lowlat.runtime.sampling import SamplingParams
    from lowlat.runtime.sampling_inputs import SamplingInputs
    from triton.runtime import interpreter as ti

    torch.set_num_threads(1)
    if way != "off":
        assert fast_interpreter.install()
    if way == "patch":  # the sanitizer back on: the module as it was before it dropped it
        opts = ti.interpreter_builder.options
        ti.interpreter_builder.options = dataclasses.replace(opts, sanitize_overflow=True)
    cfg = EngineConfig(model=model, device="cpu", dtype="bfloat16", plugin=plugin, max_batch_size=rows + 1,
                       max_context_len=256, max_verify_tokens=8, cuda_graph=False, seed=0)
    runner = ModelRunner(cfg, show_progress=False)
    reqs = [runner.kv_pool.alloc_req() for _ in range(rows)]
    batch = runner.prepare_batch(ForwardMode.DECODE, reqs, [0] * rows, [[5]] * rows)
    si = SamplingInputs(device=runner.device, max_rows=rows, vocab=runner.model_config.vocab_size)
    batch.sampling = si.fill([SamplingParams(temperature=1.0, top_k=3)] * rows, list(range(rows)), [0] * rows)
    batch.logits_required = False
    d = runner.plugin_host.dispatcher
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            d.run("plugin", batch, check=False)
            times.append(time.perf_counter() - t)
    runner.close()
    return min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--plugin", default="nvidia_mega")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--way", choices=sorted(WAYS.values()), help=argparse.SUPPRESS)  # one way, in this process
    a = ap.parse_args()
    if a.way:
        print(_step_time(a.model, a.plugin, a.rows, a.repeats, a.way))
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (this times the Triton interpreter)")
    print(f"{a.plugin} on {a.model}, DECODE {a.rows} rows with sampled ids, best of {a.repeats} (s per step)")
    base = None
    for label, way in WAYS.items():
        env = {**os.environ, "LOWLAT_FAST_INTERPRETER": "0" if way == "off" else "1"}
        out = subprocess.run([sys.executable, __file__, "--model", a.model, "--plugin", a.plugin, "--rows",
                              str(a.rows), "--repeats", str(a.repeats), "--way", way],
                             capture_output=True, text=True, env=env, check=True).stdout
        s = float(out.strip().splitlines()[-1])
        base = base or s
        print(f"  {label:32s} {s:6.2f} s  {base / s:4.2f}x")


if __name__ == "__main__":
    main()
