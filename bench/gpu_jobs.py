"""The GPU jobs, named in one place (this file's JOBS; issue 17's speed jobs in gpu_jobs_speed.py, mega-ab in
gpu_jobs_ab.py, the Step and shared commands in gpu_job_base.py): what a device call runs, as steps with time limits
and output files.

    python3 bench/gpu_jobs.py JOB [JOB ...] [--models M,M] [--plugins P,P] [--scale X]
    nox -s gpu -- JOB [JOB ...]                      # the same, in the current environment
    python3 bench/gpu_jobs.py --list                 # the jobs and their steps

Each step runs one command under ``timeout_s * scale`` seconds, its output going to ``$OUT/<file>`` (default
/tmp/out); the runner prints ``=== STEP`` / ``=== rc=N (S s)`` around the lines of the output that the step
marks as its summary, and writes ``$OUT/jobs-<jobs>-<UTC time>.json`` (every step's command, rc and seconds).
Before the first step it installs the four distributions editable without dependencies (the device image has
them) and, when ``.whl/`` holds carried wheels, those into /tmp/site (put on PYTHONPATH); NVLink multicast stays
off.

Stdlib only: it runs on the device image as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however this file is loaded
from gpu_job_base import CONTRACT, LOWLAT, PASS_FAIL, PY, ROOT, STANDARD_BENCH, Options, Step, slug  # noqa: E402
from gpu_jobs_ab import mega_ab  # noqa: E402
from gpu_jobs_speed import SPEED_JOBS  # noqa: E402


def smoke(o: Options) -> list[Step]:
    """The machine, the versions, and a general-path generation per model."""
    steps = [Step("versions", 60, [PY, "-c", "import torch, triton; print('torch', torch.__version__, 'triton', "
                                   "triton.__version__, torch.cuda.get_device_name())"], "versions.txt", r".")]
    steps += [Step(f"run general {m}", 240, [*LOWLAT, "run", "--model", m, "--device", "cuda", "--plugin", "none",
                                             "--max-new-tokens", "64", "--max-context-len", "2048", "--prompt", "a"],
                   f"run_{m}.txt", r"tok/s|ms|error") for m in o.models]
    return steps


def gpu_tests(o: Options) -> list[Step]:
    """Every test marked ``gpu`` in core and the vendors (CUDA graphs, Triton kernels compiled for the GPU), with
    nvidia_mega's sm90 compile checks switched on (``LOWLAT_MEGA_COMPILE_CHECK=1``)."""
    return [Step("gpu tests", 420, [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "core/tests",
                                    "vendors/nvidia_mega/tests", "vendors/amd_mono/tests"], "gpu_tests.txt",
                 env={"LOWLAT_MEGA_COMPILE_CHECK": "1"})]


def ids_path(o: Options) -> list[Step]:
    """Sampled ids (plugin API 3) on CUDA: the Engine's ids graphs against the logits path (greedy, batch 1 and 4,
    64 tokens; seeded sampling reproducible) for the reference plugin and nvidia_mega, then the sampled_ids contract
    on nvidia_mega's compiled kernel (tiny presets)."""
    return [Step("ids path engine", 240, [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                          "core/tests/test_ids_path_cuda.py", "vendors/nvidia_mega/tests/"
                                          "test_kernels_lm_head.py"], "ids_path.txt"),
            Step("ids contract nvidia_mega", 300, [*CONTRACT, "--lowlat-plugin", "nvidia_mega", "--lowlat-device",
                                                   "cuda", "-k", "sampled_ids"], "ids_contract.txt")]


ARCH_OF = {"llama-3.2-1b": "LlamaForCausalLM", "qwen3-8b": "Qwen3ForCausalLM", "qwen3-30b-a3b": "Qwen3MoeForCausalLM"}


def contract(o: Options) -> list[Step]:
    """The contract suite on CUDA, one step per plugin and model: the model with its architecture's tiny preset
    (``ARCH_OF``; a model not listed runs with every tiny preset). Such groups took 128-200 s on the H200; the whole
    suite of amd_mono at three models in one step passed 540 s (bench/results/2026-12-01-h200-contract-0.3.1)."""
    steps = []
    for p in o.plugins:
        for m in o.models:
            arch = ["--lowlat-arch", ARCH_OF[m]] if m in ARCH_OF else []
            steps.append(Step(f"contract {p} {m}", 300, [*CONTRACT, "--lowlat-plugin", p, "--lowlat-device", "cuda",
                                                         "--lowlat-model", m, *arch],
                              f"contract_{p}_{slug(m)}.txt", PASS_FAIL + r"|^performance"))
    return steps


def compare(o: Options) -> list[Step]:
    """Greedy 256 tokens on the general path and each plugin: token agreement, logit difference, speed; rc 1 only
    on a divergence that is no near-tie of the general logits (``lowlat run --compare``'s verdict line)."""
    return [Step(f"compare {p} {m}", 200, [*LOWLAT, "run", "--compare", "--plugin", p, "--model", m, "--device",
                                           "cuda", "--dtype", "bfloat16", "--max-new-tokens", "256",
                                           "--max-context-len", "1024", "--prompt", "The capital of France"],
                 f"compare_{p}_{m}.txt", r"identical|diverge|near-tie|speed|ms/token|x ")
            for m in o.models for p in o.plugins]


def bench(o: Options) -> list[Step]:
    """``lowlat bench``'s standard set per model: general, each plugin and the hf peer, side by side."""
    paths = ",".join(["general", *o.plugins, "hf"])
    return [Step(f"bench {m}", 480, [*LOWLAT, "bench", "--model", m, "--paths", paths, *STANDARD_BENCH,
                                     "--hf-budget-s", "200", "--out", f"{os.environ.get('OUT', '/tmp/out')}/bench_{m}"],
                 f"bench_{m}.txt", r"\|") for m in o.models]


def mega_kernels(o: Options) -> list[Step]:
    """nvidia_mega's per-kernel times against their byte floors, and the MoE / LM-head benches."""
    return [Step("bench kernels", 200, [PY, "vendors/nvidia_mega/bench_kernels.py"], "bench_kernels.txt", r"\|"),
            Step("bench moe/head", 150, [PY, "vendors/nvidia_mega/bench_moe_head.py"], "bench_moe_head.txt", r"\|")]


def mega_moe(o: Options) -> list[Step]:
    """nvidia_mega's MoE at Qwen3-30B-A3B's shapes: route / gate_up / down per stage (chain prefixes and each
    alone), ``MOE_SWEEP=1`` adds the tile sweep; then the MoE kernel tests on CUDA."""
    sweep = ["--sweep", "moe"] if os.environ.get("MOE_SWEEP") == "1" else []
    return [Step("moe stages", 300, [PY, "vendors/nvidia_mega/bench_moe_head.py", "--stages", *sweep],
                 "moe_stages.txt", r"check|^moe"),
            Step("moe tests", 180, [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    "vendors/nvidia_mega/tests/test_kernels_moe.py",
                                    "vendors/nvidia_mega/tests/test_kernels_moe_edges.py",
                                    "vendors/nvidia_mega/tests/test_kernels_moe_keys.py"], "moe_tests.txt")]


def mega_tune(o: Options) -> list[Step]:
    """nvidia_mega's launch-plan sweep for the given models (their winners go to kernels/tuned_plans.py)."""
    return [Step("tune plans", 330, [PY, "vendors/nvidia_mega/tune_plans.py", "--models", ",".join(o.models),
                                     "--rows", os.environ.get("ROWS", "1"), "--json",
                                     f"{os.environ.get('OUT', '/tmp/out')}/tune.json"], "tune.txt", r"best|plan")]


def mega_row1(o: Options) -> list[Step]:
    """nvidia_mega's one-row kernels (the GEMV and qkv_rope's one-row loop) against the production tl.dot plans at
    one row, per model (winners go to ``tuned_plans.TUNED_ROW1``)."""
    out = os.environ.get("OUT", "/tmp/out")
    return [Step(f"row1 {m}", 240, [PY, "vendors/nvidia_mega/tune_plans.py", "--models", m, "--rows", "1",
                                    "--row1-only", "--json", f"{out}/row1_{m}.json"], f"row1_{m}.txt", r"FMA")
            for m in o.models]


def mega_stream(o: Options) -> list[Step]:
    """nvidia_mega's one-row GEMV as a weight stream (``GemvPlan.per_sm``) beside the per-tile plans, at o_proj, gate_up
    and down per model, against the production one-row plan (winners go to ``tuned_plans.TUNED_ROW1`` after a step
    A/B: ``mega-ab`` with ``AB_KEY`` / ``AB_VALUE``)."""
    out = os.environ.get("OUT", "/tmp/out")
    return [Step(f"stream {m}", 240, [PY, "vendors/nvidia_mega/tune_plans.py", "--models", m, "--rows", "1",
                                      "--stream", "--json", f"{out}/stream_{m}.json"], f"stream_{m}.txt", r"rows 1:")
            for m in o.models]


def mega_attn(o: Options) -> list[Step]:
    """nvidia_mega's attention launch-plan sweep (``AttnPlan``: splits, KV block, warps, stages) for the given models,
    DECODE at batch 1-8 and VERIFY 1 x 6 at context 1024 (winners go to ``tuned_plans.TUNED_ATTN``), each plan timed
    alone; ``ATTN_IN_LAYER=1`` times each in the layer chain instead (``--in-layer``: qkv_rope -> attention ->
    o_proj per layer, µs per layer), ``ATTN_IN_LAYER=full`` with gate_up -> down (or the MoE) too (not yet run on a
    GPU)."""
    mode = os.environ.get("ATTN_IN_LAYER", "")
    mode = "attn" if mode == "1" else "" if mode == "0" else mode
    extra = ["--in-layer", mode] if mode else []  # tune_attention.py refuses a mode other than attn / full
    tag = f"_inlayer_{slug(mode)}" if mode else ""
    return [Step(f"tune attention{' in-layer ' + mode if mode else ''}", 420,
                 [PY, "vendors/nvidia_mega/tune_attention.py", "--models", ",".join(o.models), *extra, "--json",
                  f"{os.environ.get('OUT', '/tmp/out')}/attn{tag}.json"],
                 f"tune_attention{tag}.txt", r"production|TUNED|NVIDIA|rejected|WRONG|device")]


def mega_prenorm(o: Options) -> list[Step]:
    """nvidia_mega with and without prenorm (``LOWLAT_MEGA_PRENORM=1``: the 2-8-row steps' input norms in their own
    ``norm_rows`` launch) per model, DECODE at 2, 4 and 8 rows and VERIFY x6, one after the other in one call."""
    out = os.environ.get("OUT", "/tmp/out")
    args = ["--paths", "nvidia_mega", "--batch-sizes", "2,4,8", "--modes", "decode,verify", "--verify-tokens", "6",
            "--verify-batch-sizes", "1", "--context", "1024", "--layer-depth", "4", "--input-sets", "2", "--warmup",
            "5", "--iters", "30", "--no-plot"]
    return [Step(f"prenorm={v} {m}", 150, [*LOWLAT, "bench", "--model", m, *args, "--out", f"{out}/prenorm{v}_{m}"],
                 f"bench_prenorm{v}_{slug(m)}.txt", r"\| nvidia_mega", env={"LOWLAT_MEGA_PRENORM": v})
            for m in o.models for v in ("0", "1")]


def mega_plans(o: Options) -> list[Step]:
    """nvidia_mega with its measured launch plans (``LOWLAT_MEGA_TUNED`` unset: this GPU's table entries, else those
    of a GPU of the same chip, ``tuned_plans.plan_sources``) and with the heuristic plans only (``=0``), each beside
    the general path in its own ``lowlat bench`` run: DECODE at ``BATCHES`` (default 1,8) and VERIFY 1 x 6."""
    out = os.environ.get("OUT", "/tmp/out")
    args = ["--paths", "general,nvidia_mega", "--batch-sizes", os.environ.get("BATCHES", "1,8"), "--modes",
            "decode,verify", "--verify-tokens", "6", "--verify-batch-sizes", "1", "--context", "1024",
            "--layer-depth", "4", "--input-sets", "2", "--warmup", "5", "--iters", "30", "--no-plot"]
    return [Step(f"tuned={v or 'default'} {m}", 300,
                 [*LOWLAT, "bench", "--model", m, *args, "--out", f"{out}/tuned{v or 'default'}_{m}"],
                 f"bench_tuned{v or 'default'}_{slug(m)}.txt", r"\| (general|nvidia_mega) |bandwidth|GPU",
                 env={"LOWLAT_MEGA_TUNED": v}) for m in o.models for v in ("0", "")]


def amd_layers(o: Options) -> list[Step]:
    """amd_mono's per-layer times against the general path; ``AMD_VARIANTS`` adds option variants,
    ``AMD_SYNC_FLOOR=1`` times each with every stage's compute skipped too."""
    variants = os.environ.get("AMD_VARIANTS", "")
    extra = ["--variants", variants] if variants else []
    if os.environ.get("AMD_SYNC_FLOOR") == "1":
        extra.append("--sync-floor")
    return [Step(f"amd layers {m}", 200, [PY, "vendors/amd_mono/bench_layers.py", "--models", m, "--rows", "1,8",
                                          "--no-skips", *extra], f"amd_layers_{m}.txt", r"\|") for m in o.models]


def serve(o: Options) -> list[Step]:
    """``lowlat bench serve`` per model: one server per path (general and each plugin), streaming users at
    concurrency 1-8; ``INPUT_LEN`` / ``OUTPUT_LEN`` / ``REQUESTS`` tune it. ``SPECULATIVE`` (e.g. simulated:3.51,
    k = ``NUM_DRAFT_TOKENS``, default 5) serves each path plain and speculating (``SPEC_ONLY=1``: speculating only,
    half the time) and reports acceptance and the ratio to plain; ``SPEC_ADAPTIVE=0`` always speculates."""
    out = os.environ.get("OUT", "/tmp/out")
    spec = os.environ.get("SPECULATIVE", "")
    extra = [f"--speculative={spec}", f"--num-draft-tokens={os.environ.get('NUM_DRAFT_TOKENS', '5')}"] if spec else []
    if spec and os.environ.get("SPEC_ONLY") == "1":
        extra.append("--speculative-only")
    if spec and os.environ.get("SPEC_ADAPTIVE") == "0":
        extra.append("--serve-arg=--no-spec-adaptive")  # one token: argparse would take a bare "--x" as a flag
    tag = f"_{slug(spec)}" if spec else ""
    return [Step(f"bench serve {m}{' ' + spec if spec else ''}", 560,
                 [*LOWLAT, "bench", "serve", "--paths", ",".join(["general", *o.plugins]), "--model", m, "--device",
                  "cuda", "--input-len", os.environ.get("INPUT_LEN", "8192"), "--output-len",
                  os.environ.get("OUTPUT_LEN", "1024"), "--concurrency", os.environ.get("CONCURRENCY", "1,2,4,8"),
                  "--requests", os.environ.get("REQUESTS", "8"), *extra, "--out", f"{out}/serve_{m}{tag}"],
                 f"bench_serve_{m}{tag}.txt", r"\||ratio|skipped|error") for m in o.models]


def spec(o: Options) -> list[Step]:
    """Speculative decoding per model: greedy identity (ngram and a self-draft, batch 1 and 4, general path and
    each plugin; every divergence classified near-tie or bug, rc 1 only on a bug), then plain decoding against
    simulated acceptance 3.51 with k = 5 (six verified rows per step)."""
    paths = ",".join(["none", *o.plugins])
    steps = []
    for m in o.models:
        steps.append(Step(f"spec identity {m}", 420, [PY, "bench/scripts/spec_identity.py", "--model", m, "--device",
                                                      "cuda", "--paths", paths], f"spec_identity_{m}.txt",
                          r"path=|near-tie|BUG|^summary"))
        run = [*LOWLAT, "run", "--model", m, "--device", "cuda", "--dtype", "bfloat16", "--max-new-tokens", "256",
               "--max-context-len", "2048", "--prompt", "a"]
        for p in ["none", *o.plugins]:
            steps.append(Step(f"plain {p} {m}", 240, [*run, "--plugin", p], f"spec_plain_{p}_{m}.txt",
                              r"tok/s|decode|VERIFY|DECODE"))
            steps.append(Step(f"simulated {p} {m}", 240, [*run, "--plugin", p, "--speculative", "simulated:3.51",
                                                          "--num-draft-tokens", "5", "--no-spec-adaptive"],
                              f"spec_simulated_{p}_{m}.txt", r"tok/s|decode|VERIFY|DECODE|SIMULATED|acceptance"))
    return steps


def spec_ngram(o: Options) -> list[Step]:
    """The n-gram drafter on the model's own repetitive greedy text (bench/scripts/spec_ngram.py): acceptance,
    tokens per step, speed-up over plain decoding and the drafter's cost per step, batch 1 and 4, general path and
    each plugin; one table per model (llama-3.2-1b: about 1-2 minutes)."""
    out = os.environ.get("OUT", "/tmp/out")
    paths = ",".join(["none", *o.plugins])
    return [Step(f"spec ngram {m}", 180 if "1b" in m else 420,
                 [PY, "bench/scripts/spec_ngram.py", "--model", m, "--device", "cuda", "--paths", paths, "--json",
                  f"{out}/spec_ngram_{slug(m)}.json"], f"spec_ngram_{slug(m)}.txt", r"^\||^n-gram|failed|^\(")
            for m in o.models]


def mutants(o: Options) -> list[Step]:
    """Mutants of the reference plugin held to the contract suite on CUDA (``MUTANTS`` names them; each must fail
    except ``control``): installed as plugins into /tmp/mutant-site first."""
    site = "/tmp/mutant-site"
    path = os.pathsep.join([site, "/tmp/site", os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    names = os.environ.get("MUTANTS", "control,host_len_frozen_at_capture,bf16_gate_up_swapped,splitkv64_drops_tail")
    steps = [Step("install mutants", 60, [PY, "-c", "from lowlat_contract.plugins.mutants import "
                                          f"install_mutant_plugins as i; i({site!r})"], "mutants_install.txt", r".")]
    steps += [Step(f"contract {m}", 150, [*CONTRACT, "--lowlat-plugin", m, "--lowlat-arch", "LlamaForCausalLM",
                                          "--lowlat-device", "cuda"], f"contract_mutant_{m}.txt",
                   PASS_FAIL + r"|^(PASS|FAIL|SKIP) ", env={"PYTHONPATH": path}) for m in names.split(",")]
    return steps


OOT_SITE = "/tmp/oot-site"
_OOT_INSTALL = """
import subprocess, sys
from lowlat_contract.checkout import export_tree
from lowlat_contract.matrix import load_matrix
v = next(v for v in load_matrix("compat_matrix.toml").vendors if v.name == "lowlat-swiglu")
tree = export_tree(".", v.path, v.commit, "/tmp/oot-export", repo=v.repo)
print("lowlat-swiglu", v.version, "at", v.commit, "->", tree)
subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                sys.argv[1], str(tree)], check=True)
"""


def oot_vendor(o: Options) -> list[Step]:
    """The out-of-tree vendor lowlat-swiglu at the commit compat_matrix.toml pins (exported from
    examples/lowlat-swiglu.bundle, installed into /tmp/oot-site), held to the contract suite on CUDA; record its
    cuda-sm90 row from the output by hand (nox is not on the device image)."""
    path = os.pathsep.join([OOT_SITE, "/tmp/site", os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    models = [a for m in o.models if m in ("llama-3.2-1b", "qwen3-8b") for a in ("--lowlat-model", m)]
    return [Step("install lowlat-swiglu", 120, [PY, "-c", _OOT_INSTALL, OOT_SITE], "oot_install.txt", r"lowlat-swiglu"),
            Step("contract swiglu", 540, [*CONTRACT, "--lowlat-plugin", "swiglu", "--lowlat-device", "cuda", *models],
                 "contract_swiglu.txt", PASS_FAIL + r"|^(PASS|FAIL|SKIP) ", env={"PYTHONPATH": path})]


def diag_alternating(o: Options) -> list[Step]:
    """Per-step logit differences and router gaps of each plugin on tiny-qwen3-moe (router near-tie diagnosis)."""
    return [Step(f"diag alternating {p}", 150, [PY, "bench/scripts/diag_alternating.py", "--plugin", p, "--device",
                                                "cuda", "--seeds", "8"], f"diag_alternating_{p}.txt",
                 r"^===|divergence [0-9]") for p in o.plugins]


JOBS: dict[str, Callable[[Options], list[Step]]] = {
    "smoke": smoke, "gpu-tests": gpu_tests, "ids-path": ids_path, "contract": contract, "compare": compare,
    "bench": bench, "mega-kernels": mega_kernels, "mega-moe": mega_moe, "mega-tune": mega_tune, "mega-row1": mega_row1,
    "mega-stream": mega_stream,
    "mega-prenorm": mega_prenorm, "mega-attn": mega_attn, "mega-plans": mega_plans, "mega-ab": mega_ab,
    "amd-layers": amd_layers,
    "diag-alternating": diag_alternating, "serve": serve, "spec": spec, "spec-ngram": spec_ngram, "mutants": mutants,
    "oot-vendor": oot_vendor, **SPEED_JOBS,
}
DEFAULT_MODELS = "llama-3.2-1b,qwen3-8b,qwen3-30b-a3b"
DEFAULT_PLUGINS = "nvidia_mega,amd_mono"


def prepare(out: Path) -> dict[str, str]:
    """The environment every step runs in; installs the distributions (and carried wheels) once."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "OUT": str(out)}
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if wheels:
        subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", "/tmp/site", *map(str, wheels)], check=True)
        env["PYTHONPATH"] = os.pathsep.join(p for p in ("/tmp/site", env.get("PYTHONPATH", "")) if p)
    subprocess.run([PY, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "core", "-e",
                    "vendors/nvidia_mega", "-e", "vendors/amd_mono", "-e", "contract_tests"], check=True, cwd=ROOT,
                   env=env)
    return env


def run_step(step: Step, out: Path, env: dict[str, str], scale: float) -> dict[str, object]:
    """Run ``step``; returns its record (name, argv, rc, seconds, out). rc 124 = the time limit ran out."""
    print(f"=== {step.name}", flush=True)
    t0 = time.monotonic()
    with open(out / step.out, "w") as f:
        try:
            rc = subprocess.run(step.argv, cwd=ROOT, env={**env, **step.env}, stdout=f, stderr=subprocess.STDOUT,
                                timeout=step.timeout_s * scale, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    secs = time.monotonic() - t0
    pattern = re.compile(step.show)
    for line in (out / step.out).read_text(errors="replace").splitlines():
        if pattern.search(line):
            print("  " + line[:300])
    print(f"=== rc={rc} ({secs:.0f} s)", flush=True)
    return {**asdict(step), "rc": rc, "seconds": round(secs, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jobs", nargs="*", help=f"jobs to run, in order: {', '.join(JOBS)}")
    ap.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated presets (default %(default)s)")
    ap.add_argument("--plugins", default=DEFAULT_PLUGINS, help="comma-separated plugins (default %(default)s)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every step's time limit")
    ap.add_argument("--list", action="store_true", help="print the jobs and their steps, run nothing")
    args = ap.parse_args(argv)
    opts = Options(args.models.split(","), args.plugins.split(","), args.scale)
    unknown = [j for j in args.jobs if j not in JOBS]
    if unknown or not (args.jobs or args.list):
        ap.error(f"unknown job(s) {unknown}; jobs: {', '.join(JOBS)}" if unknown else "name at least one job")
    if args.list:
        try:
            for name, make in JOBS.items():
                print(f"{name}: {(make.__doc__ or '').strip()}")
                for s in make(opts):
                    print(f"    {s.name} ({s.timeout_s:.0f} s): {' '.join(s.argv)}")
            sys.stdout.flush()
        except BrokenPipeError:  # `--list | head`: the reader left; stay quiet (the Python docs' idiom)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    env = prepare(out)
    records = [run_step(s, out, env, opts.scale) for j in args.jobs for s in JOBS[j](opts)]
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    (out / f"jobs-{'-'.join(args.jobs)}-{stamp}.json").write_text(
        json.dumps({"jobs": args.jobs, "argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if k in (
            "INPUT_LEN", "OUTPUT_LEN", "REQUESTS", "CONCURRENCY", "SPECULATIVE", "NUM_DRAFT_TOKENS", "SPEC_ONLY",
            "SPEC_ADAPTIVE", "MUTANTS", "AMD_VARIANTS", "AMD_SYNC_FLOOR", "ROWS", "MOE_SWEEP", "ATTN_IN_LAYER", "TP",
            "TP_PATHS", "BATCH_SIZES", "BATCHES", "AB_TABLE", "AB_KEY", "AB_VALUE", "AB_ENV", "AB_PATHS")},
                    "steps": records}, indent=1))
    failed = [r["name"] for r in records if r["rc"] != 0]
    print(f"{len(records) - len(failed)} steps ok, {len(failed)} failed: {failed}" if failed else
          f"{len(records)} steps ok")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
