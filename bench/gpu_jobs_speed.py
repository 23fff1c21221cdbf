"""The GPU jobs of issue 17 (the general path's speed, the overlapped loop, peers): bench/gpu_jobs.py runs them.

Stdlib only: it runs on the device image as it is.
"""

from __future__ import annotations

import os

from gpu_job_base import LOWLAT, PY, STANDARD_BENCH, Options, Step, slug

E2E_GENERAL = "general,general-reference,general-compiled"  # the default (fused on CUDA), the oracle, compiled
E2E_LIMIT_S = {"llama-3.2-1b": 170, "qwen3-8b": 260, "qwen3-30b-a3b": 370}  # per model; others 300


def e2e_tpot(o: Options) -> list[Step]:
    """Engine.generate's TPOT against ``lowlat bench``'s step latency (context 1024, batch 1 and 8) per model,
    for the general path under each general_impl and each plugin, plain and overlapped loop (issue 17: overlapped
    within 1.03 of the step), with a token identity check of the two loops. One step per model (one process, the
    paths one after another, its JSON rewritten after each path); ``E2E_PATHS`` overrides the paths, ``REPEATS``
    the timed runs per loop (3). ``--models llama-3.2-1b,qwen3-30b-a3b`` fits one device call: its step limits add
    up to 540 s (estimated 1.5 min for llama-3.2-1b and 5 min for qwen3-30b-a3b with both plugins; not timed)."""
    out = os.environ.get("OUT", "/tmp/out")
    paths = os.environ.get("E2E_PATHS", ",".join([E2E_GENERAL, *o.plugins]))
    return [Step(f"e2e tpot {m}", E2E_LIMIT_S.get(m, 300),
                 [PY, "bench/scripts/e2e_tpot.py", "--model", m, "--paths", paths, "--batch-sizes",
                  os.environ.get("BATCH_SIZES", "1,8"), "--repeats", os.environ.get("REPEATS", "3"), "--json",
                  f"{out}/e2e_tpot_{slug(m)}.json"], f"e2e_tpot_{slug(m)}.txt", r"^\||error|warning|within")
            for m in o.models]


GPT_FAST_DIR = ".peers/gpt-fast"
GPT_FAST_MODELS = ("llama-3.2-1b", "qwen3-8b")  # dense presets gpt-fast's Llama-style model can express
GPT_FAST_PATHS = "general,general-reference,general-compiled,nvidia_mega"


def gpt_fast(o: Options) -> list[Step]:
    """gpt-fast (meta-pytorch/gpt-fast, its model.py and generate.py unmodified, --compile, batch 1, random
    weights at the preset's shapes: bench/peers/gpt_fast.py) beside lowlat's e2e TPOT at batch 1 (general under
    each general_impl, and nvidia_mega; ``GPT_FAST_PATHS`` overrides) per model, then one table (``x gpt-fast``:
    gpt-fast's decode-only ms over the overlapped TPOT; issue 17: >= 0.91). Models: those of ``--models`` among
    llama-3.2-1b and qwen3-8b, both when none is. gpt-fast's files travel as the ignored ``.peers/gpt-fast``
    (``GPT_FAST_DIR``) named in the device call's ``carry`` (docs/benchmark-e2e.md, "gpt-fast", shows how to make
    it). Each generate.py run compiles its own decode graph (its KV cache is sized by prompt + new tokens, so
    the second run's shapes differ from the first's: 78-129 s per compile on llama-3.2-1b, H200). One device
    call for llama-3.2-1b (400 + 90 + 30 s). qwen3-8b's peer took 560 s on 2026-12-01 and 236 s with its lowlat
    rows on 2026-12-02 (``GPT_FAST_PATHS=general,nvidia_mega``), both with two generate.py runs where one is made now
    (its decode steps timed with CUDA events, bench/peers/gpt_fast_output.py); where it runs long, split it:
    ``GPT_FAST_STEPS=peer`` in one call, ``GPT_FAST_STEPS=lowlat,table`` with the peer's JSON copied back into
    ``$OUT`` in another."""
    out = os.environ.get("OUT", "/tmp/out")
    checkout = os.environ.get("GPT_FAST_DIR", GPT_FAST_DIR)
    models = [m for m in o.models if m in GPT_FAST_MODELS] or list(GPT_FAST_MODELS)
    limits = {"llama-3.2-1b": (400, 90), "qwen3-8b": (560, 200)}
    parts = os.environ.get("GPT_FAST_STEPS", "peer,lowlat,table").split(",")
    steps: list[Step] = []
    for m in models:
        peer_s, e2e_s = limits[m]
        if "peer" in parts:
            steps.append(Step(f"gpt-fast {m}", peer_s,
                              [PY, "bench/peers/gpt_fast.py", "measure", "--checkout", checkout, "--model", m,
                               "--timeout-s", str(peer_s - 10), "--json", f"{out}/gpt_fast_peer_{m}.json"],
                              f"gpt_fast_{m}.txt", r"^\[gpt-fast\]|rror"))
        if "lowlat" in parts:
            steps.append(Step(f"gpt-fast lowlat {m}", e2e_s,
                              [PY, "bench/scripts/e2e_tpot.py", "--model", m, "--paths",
                               os.environ.get("GPT_FAST_PATHS", GPT_FAST_PATHS), "--batch-sizes", "1", "--repeats",
                               "2", "--json", f"{out}/gpt_fast_lowlat_{m}.json"], f"gpt_fast_lowlat_{m}.txt",
                              r"^\||error|within"))
    if "table" in parts:
        steps.append(Step("gpt-fast table", 30, [PY, "bench/peers/gpt_fast_table.py",
                                                 *[f"{out}/gpt_fast_peer_{m}.json" for m in models], "--lowlat",
                                                 *[f"{out}/gpt_fast_lowlat_{m}.json" for m in models], "--out",
                                                 f"{out}/gpt_fast_table.md"], "gpt_fast_table.txt", r"."))
    return steps


def drift(o: Options) -> list[Step]:
    """Which activity slows a path's graph replay (bench/scripts/replay_drift.py): the general path at batch 1 and
    8, general-reference and each plugin at batch 1, llama-3.2-1b (or the first of ``--models``)."""
    m = o.models[0]
    runs = [("general", 1), ("general", 8), ("general-reference", 1), *[(p, 1) for p in o.plugins]]
    script = [PY, "bench/scripts/replay_drift.py", "--model", m, "--kernels"]
    return [Step(f"drift {p} b={b}", 120, [*script, "--path", p, "--batch", str(b)], f"drift_{slug(m)}_{p}_{b}.txt",
                 r"^\||rror|idle") for p, b in runs]


def phases(o: Options) -> list[Step]:
    """An overlapped DECODE step's device phases and host time per model (bench/scripts/overlap_phases.py, batch 1
    and 8, the general path and each plugin), with lowlat bench's step beside them."""
    return [Step(f"phases {m}", 150, [PY, "bench/scripts/overlap_phases.py", "--model", m, "--paths",
                                      ",".join(["general", *o.plugins])], f"phases_{slug(m)}.txt", r"^\||rror")
            for m in o.models]


GENERAL_PATHS = "general,general-reference,general-compiled,hf"


def general_tests(o: Options) -> list[Step]:
    """The fused kernels and general_impl on CUDA (bf16 bits, CUDA graphs, inductor), the sampler's syncs, and each
    fused piece's device time against plain torch, torch.compile and its byte floor."""
    return [Step("general tests", 360, [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                        "core/tests/test_kernels_fused.py", "core/tests/test_general_impl.py",
                                        "core/tests/test_runtime_sampling.py"], "general_tests.txt"),
            Step("fused kernels bench", 200, [PY, "bench/scripts/bench_fused_kernels.py"], "fused_kernels.txt",
                 r"\||bandwidth")]


def general_speed(o: Options) -> list[Step]:
    """The general path's variants (reference, fused Triton kernels, torch.compile) against the hf peer per model,
    with launches per layer; ``GENERAL_PATHS`` overrides the paths (default
    general,general-reference,general-compiled,hf).
    One model per device call fits its 600 s: ``--models llama-3.2-1b``, then ``--models qwen3-30b-a3b``.
    ``HF_BUDGET_S`` (default 200) and ``HF_BATCH_SIZES`` pick the hf peer's rows: the qwen3-30b-a3b rows past batch 1
    (35-75 s of torch.compile each) are ``GENERAL_PATHS=general,hf HF_BATCH_SIZES=2,4,8 HF_BUDGET_S=420``."""
    paths = os.environ.get("GENERAL_PATHS", GENERAL_PATHS)
    out = os.environ.get("OUT", "/tmp/out")
    hf = ["--hf-budget-s", os.environ.get("HF_BUDGET_S", "200")]
    if os.environ.get("HF_BATCH_SIZES"):  # e.g. 2,4,8 (VERIFY rows always run): the rows a budget left out
        hf += ["--hf-batch-sizes", os.environ["HF_BATCH_SIZES"]]  # second-depth rows only at those sizes
    return [Step(f"general-speed {m}", 540, [*LOWLAT, "bench", "--model", m, "--paths", paths, *STANDARD_BENCH, *hf,
                                             "--no-plot", "--out", f"{out}/general_speed_{m}"],
                 f"general_speed_{m}.txt", r"\|") for m in o.models]


TP_LIMIT_S = {"llama-3.2-1b": 300, "qwen3-30b-a3b": 560}  # per model; others 400 (not timed yet: estimates)


def tp_bench(o: Options) -> list[Step]:
    """Issue 22, on a machine of 2 GPUs (``nvidia-h200-x2`` or ``nvidia-h100-x2``): per-layer DECODE latency at TP 2,
    batch 1 and 8, context 1024, per row of bench/scripts/tp_bench.py (general over NCCL, general-peer,
    nvidia_mega with epilogue publishing, nvidia_mega-nccl, amd_mono in-kernel; ``TP_PATHS`` overrides), rank 0's
    medians side by side with the ratio to general, and the all-reduce alone (NCCL against the one-shot peer, T x
    hidden and 4-64 KiB messages, µs per call in CUDA graphs). Run it with ``--models llama-3.2-1b`` and
    ``--models qwen3-30b-a3b`` in separate device calls (limits 300 and 560 s, estimates: ten ModelRunner builds
    per model). ``TP`` sets the ranks (2)."""
    out = os.environ.get("OUT", "/tmp/out")
    paths = os.environ.get("TP_PATHS", "general,general-peer,nvidia_mega,nvidia_mega-nccl,amd_mono")
    return [Step(f"tp-bench {m}", TP_LIMIT_S.get(m, 400),
                 [PY, "bench/scripts/tp_bench.py", "--model", m, "--tp", os.environ.get("TP", "2"), "--device", "cuda",
                  "--paths", paths, "--batch-sizes", os.environ.get("BATCH_SIZES", "1,8"), "--context", "1024",
                  "--layer-depth", "4", "--stall-s", "300", "--timeout-s", str(TP_LIMIT_S.get(m, 400) - 20),
                  "--out", f"{out}/tp_bench_{slug(m)}"], f"tp_bench_{slug(m)}.txt",
                 r"^\||^- |error|rank \d")
            for m in o.models]


def tp_serve(o: Options) -> list[Step]:
    """Issue 22's serving side, on a machine of 2 GPUs (``nvidia-h200-x2`` or ``nvidia-h100-x2``): ``lowlat bench
    serve`` per-user decode speed at TP 2 (``--serve-arg=--tp=2`` reaches every ``lowlat serve`` it starts),
    concurrency 1-8, the general path and each plugin (ratios to general); one device call per model (560 s).
    ``INPUT_LEN`` / ``OUTPUT_LEN`` / ``REQUESTS`` / ``CONCURRENCY`` tune it, ``TP`` sets the ranks (2)."""
    out = os.environ.get("OUT", "/tmp/out")
    tp = os.environ.get("TP", "2")
    return [Step(f"tp-serve {m}", 560,
                 [*LOWLAT, "bench", "serve", "--paths", ",".join(["general", *o.plugins]), "--model", m, "--device",
                  "cuda", "--input-len", os.environ.get("INPUT_LEN", "8192"), "--output-len",
                  os.environ.get("OUTPUT_LEN", "1024"), "--concurrency", os.environ.get("CONCURRENCY", "1,2,4,8"),
                  "--requests", os.environ.get("REQUESTS", "8"), f"--serve-arg=--tp={tp}", "--out",
                  f"{out}/tp_serve_{slug(m)}"], f"tp_serve_{slug(m)}.txt", r"\||ratio|skipped|error")
            for m in o.models]


SPEED_JOBS = {"general-tests": general_tests, "general-speed": general_speed, "e2e-tpot": e2e_tpot,
              "gpt-fast": gpt_fast, "drift": drift, "phases": phases, "tp-bench": tp_bench, "tp-serve": tp_serve}
