"""gpt-fast (github.com/meta-pytorch/gpt-fast) as a peer: its own model.py and generate.py, run unmodified.

    python3 bench/peers/gpt_fast.py measure --checkout .peers/gpt-fast --model llama-3.2-1b --json out.json
    python3 bench/peers/gpt_fast_table.py out.json --lowlat e2e.json   # beside lowlat's e2e TPOT (e2e_tpot.py)

Nothing of gpt-fast is copied here: ``--checkout`` is a directory holding its files (``git archive`` of the
upstream repository; ``.peers/`` is git-ignored; bench/gpu_jobs.py's ``gpt-fast`` job says how it reaches the
device). Per lowlat preset this harness

1. maps the preset's shapes onto gpt-fast's ``ModelArgs`` (``gpt_fast_args``). gpt-fast's model is Llama-style:
   Qwen3's q/k RMSNorm does not exist there, so ``qwen3-8b`` runs as a Llama-style model at qwen3-8b's shapes
   (two 128-element norms per layer fewer: their weights are 0.01% of the bytes, their work two small element-wise
   ops per layer). Tied embeddings are stored untied (the same bytes per step: one embedding row, the whole head).
   MoE presets, ``num_heads * head_dim != hidden_size``, biases and RoPE types other than default/llama3 are
   refused with the reason;
2. builds ``model.pth`` with gpt-fast's own ``Transformer(ModelArgs(...))`` and seeded random bf16 weights
   (matrices normal(0, 0.02), norms 1), and a ``tokenizer.model`` that its tokenizer.py accepts: a tiktoken BPE
   file of vocab - 256 distinct byte strings (its ``TiktokenWrapper`` adds 256 special tokens; picked for any
   checkpoint path containing "llama-3", so the directory is named e.g. ``qwen3-8b-as-llama-3``); the device image
   has tiktoken and sentencepiece, both of which tokenizer.py imports;
3. runs ``generate.py --compile --batch_size 1 --prompt P`` (a synthetic prompt of P random tokens) in a subprocess
   that first registers the shapes in ``model.transformer_configs`` under the directory's name (generate.py picks
   its config by ``checkpoint_path.parent.name``) and then executes generate.py as ``__main__`` with ``runpy``;
   ``--top_k 1`` makes its sampler greedy like lowlat's e2e runs;
4. takes gpt-fast's decode time per token from inside the generate.py process, on the GPU's timeline: CUDA events
   around each call of its compiled ``decode_one_token`` (gpt_fast_output.py, which says why and how), over the
   steps whose KV length lies in the window; the mean per timed sample, the median over samples. It runs once, 160
   new tokens after a prompt of P = context - 80 (with the default context 1024, P = 944 and KV lengths 945..1103,
   mean 1024, the window of bench/scripts/e2e_tpot.py's ``Engine.generate`` at ``--context 1024 --new-tokens
   128``), and also reports gpt-fast's own figure (1000 / tokens/s: prefill included). ``--short N`` adds a run of
   N new tokens for the older estimate ``(t_long - t_short) / (N_long - N_short)`` (``t = N / (tokens/s)``, sample
   medians), printed beside it; each run compiles its own decode graph (generate.py sizes the KV cache to prompt +
   new tokens).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import json
import os
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling gpt_fast_output, however it is loaded
import gpt_fast_output  # noqa: E402
from gpt_fast_output import GenerateRun, GptFastError, decode_ms, parse_generate_output  # noqa: E402,F401

SPECIAL_TOKENS = 256  # gpt-fast's TiktokenWrapper appends this many special tokens to the BPE file's ranks
FORBIDDEN_IN_PATH = ("int8", "int4", "stories", "chat")  # generate.py switches behaviour on these substrings
LAUNCH = "_launch"
SYNTHETIC_IDS = 1024  # generate.py's --prompt N draws N ids in [0, 1024)


# ---- 1. shapes -------------------------------------------------------------------------------------------------

def gpt_fast_args(cfg: Any) -> tuple[dict[str, Any], list[str]]:
    """gpt-fast ``ModelArgs`` keyword arguments for a lowlat ``ModelConfig``, and the differences from it.

    Returns:
        (kwargs for ``ModelArgs(**kwargs)``, list of plain-text differences gpt-fast's model has).

    Raises:
        GptFastError: a feature gpt-fast's Llama-style model cannot express (MoE, biases, head_dim other than
            hidden / heads, a RoPE type other than default/llama3).
    """
    if cfg.architecture not in ("LlamaForCausalLM", "Qwen3ForCausalLM") or cfg.num_experts:
        raise GptFastError(f"{cfg.architecture} with {cfg.num_experts} experts: gpt-fast's model.py is a dense "
                           "Llama-style transformer (its MoE is a separate mixtral-moe/ model); use a dense preset")
    if cfg.num_attention_heads * cfg.head_dim != cfg.hidden_size:
        raise GptFastError(f"heads {cfg.num_attention_heads} x head_dim {cfg.head_dim} != hidden "
                           f"{cfg.hidden_size}: gpt-fast's ModelArgs sets head_dim = dim // n_head")
    if cfg.vocab_size < SYNTHETIC_IDS:
        raise GptFastError(f"vocab {cfg.vocab_size} < {SYNTHETIC_IDS}: generate.py's synthetic prompt (--prompt N) "
                           f"draws token ids below {SYNTHETIC_IDS}")
    if cfg.attention_bias or cfg.mlp_bias:
        raise GptFastError("attention/MLP biases: gpt-fast's linears have no bias")
    scaling = cfg.rope_scaling or None
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind not in ("default", "llama3"):
        raise GptFastError(f"rope_scaling type {kind!r}: gpt-fast implements default and llama3 RoPE only")
    args: dict[str, Any] = dict(
        block_size=cfg.max_position_embeddings, vocab_size=cfg.vocab_size, n_layer=cfg.num_hidden_layers,
        n_head=cfg.num_attention_heads, n_local_heads=cfg.num_key_value_heads, dim=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, rope_base=float(cfg.rope_theta), norm_eps=float(cfg.rms_norm_eps))
    if kind == "llama3":
        args["rope_scaling"] = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                        "original_max_position_embeddings")}
    diffs = []
    if cfg.architecture == "Qwen3ForCausalLM":
        diffs.append("no q/k RMSNorm (gpt-fast's model is Llama-style): Qwen3's shapes as a Llama-style model")
    if cfg.tie_word_embeddings:
        diffs.append("embeddings stored untied (same bytes read per step)")
    return args, diffs


def config_name(model: str) -> str:
    """The checkpoint directory's name (a preset's name, or a checkpoint directory's last part): gpt-fast's config
    key; it contains "llama-3" so that gpt-fast's get_tokenizer picks tiktoken."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name) or "model"
    return name if "llama-3" in name.lower() else f"{name}-as-llama-3"


# ---- 2. checkpoint and tokenizer -------------------------------------------------------------------------------

def load_gpt_fast_model(checkout: Path) -> Any:
    """gpt-fast's model.py as a module (by file path, so nothing named ``model`` lands on sys.path)."""
    path = checkout / "model.py"
    if not path.is_file() or not (checkout / "generate.py").is_file():
        raise GptFastError(f"{checkout} holds no gpt-fast checkout (model.py, generate.py): pass --checkout DIR "
                           "with the files of github.com/meta-pytorch/gpt-fast (e.g. git archive into .peers/gpt-fast)")
    spec = importlib.util.spec_from_file_location("gpt_fast_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A tiktoken BPE file (``base64 rank`` lines) of ``vocab_size - 256`` distinct byte strings: every id of the
    model decodes (the first 256 are the single bytes). Its merges are meaningless: only generate.py's final
    ``tokenizer.decode`` of the output uses it (the synthetic prompt is never encoded)."""
    n = vocab_size - SPECIAL_TOKENS
    if n < 256:
        raise GptFastError(f"vocab {vocab_size} < {256 + SPECIAL_TOKENS}: too small for gpt-fast's tiktoken tokenizer")
    lines, length = [], 1
    while len(lines) < n:
        for i in range(256 ** length):
            if len(lines) == n:
                break
            lines.append(f"{base64.b64encode(i.to_bytes(length, 'big')).decode()} {len(lines)}")
        length += 1
    path.write_text("\n".join(lines) + "\n")


def build_checkpoint(checkout: Path, preset: str, cfg: Any, root: Path, *, device: str = "cuda",
                     seed: int = 0) -> Path:
    """``root/<config_name>/model.pth`` (gpt-fast's state dict, bf16, on the CPU) and ``tokenizer.model``.

    Returns:
        the model.pth path (reused when it exists with a matching ``args.json``).
    Raises:
        GptFastError: the shapes cannot be expressed, or the path holds a substring generate.py reacts to.
    """
    import torch

    args, _ = gpt_fast_args(cfg)
    out = root / config_name(preset)
    bad = [s for s in FORBIDDEN_IN_PATH if s in str(out)]
    if bad:
        raise GptFastError(f"checkpoint path {out} contains {bad}: generate.py would quantize / change mode; "
                           "choose another --workdir")
    ckpt, stamp = out / "model.pth", out / "args.json"
    want = json.dumps({"args": args, "seed": seed}, sort_keys=True)
    if ckpt.is_file() and stamp.is_file() and stamp.read_text() == want:
        return ckpt
    out.mkdir(parents=True, exist_ok=True)
    mod = load_gpt_fast_model(checkout)
    margs = mod.ModelArgs(**args)
    if margs.head_dim != cfg.head_dim:
        raise GptFastError(f"gpt-fast's head_dim {margs.head_dim} != the preset's {cfg.head_dim}")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = mod.Transformer(margs)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
            state[name] = p.detach().to("cpu")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # this process stays alive beside generate.py: give its GPU memory back
    torch.save(state, ckpt)
    write_tokenizer(out / "tokenizer.model", cfg.vocab_size)
    stamp.write_text(want)
    return ckpt


# ---- 3. running generate.py ------------------------------------------------------------------------------------

def launch(argv: list[str]) -> None:
    """In the child: register ``argv[1]``'s shapes in gpt-fast's ``transformer_configs``, run generate.py.

    ``argv``: [checkout, name, ModelArgs kwargs as JSON, generate.py's arguments...].
    """
    checkout, name, args = Path(argv[0]), argv[1], json.loads(argv[2])
    import torch

    gpt_fast_output.install(torch)  # its decode steps timed with CUDA events; gpt_fast_output.py says how
    sys.path.insert(0, str(checkout))
    import model  # gpt-fast's model.py: generate.py's own ``from model import Transformer`` gets this module

    model.transformer_configs[name] = args
    sys.argv = [str(checkout / "generate.py"), *argv[3:]]
    runpy.run_path(str(checkout / "generate.py"), run_name="__main__")


def generate_argv(ckpt: Path, prompt_len: int, new_tokens: int, samples: int, *, compile: bool = True,
                  device: str = "cuda") -> list[str]:
    """generate.py's arguments: synthetic prompt, batch 1, greedy (top_k 1), ``samples`` timed samples."""
    argv = ["--checkpoint_path", str(ckpt), "--prompt", str(prompt_len), "--max_new_tokens", str(new_tokens),
            "--num_samples", str(samples), "--batch_size", "1", "--top_k", "1", "--device", device]
    return argv + (["--compile"] if compile else [])


def run_generate(checkout: Path, name: str, args: dict[str, Any], gen_argv: list[str], *, cache_dir: Path,
                 timeout_s: float) -> str:
    """Run generate.py unmodified in a subprocess (through ``launch``); its stdout and stderr.

    Raises:
        GptFastError: it exited non-zero or ran past ``timeout_s`` (the message holds its last output).
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), LAUNCH, str(checkout), name, json.dumps(args), *gen_argv]
    # TIKTOKEN_CACHE_DIR "": tiktoken caches a BPE file by its path, not its content (a stale vocabulary otherwise)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1", "TIKTOKEN_CACHE_DIR": ""}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=checkout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise GptFastError(f"generate.py ran past {timeout_s:.0f} s; last output:\n{out[-3000:]}") from None
    text = proc.stdout + proc.stderr
    if proc.returncode:
        raise GptFastError(f"generate.py exited {proc.returncode}; last output:\n{text[-4000:]}")
    return text


# ---- the measurement -------------------------------------------------------------------------------------------

def git_blob_sha(path: Path) -> str:
    """The file's git blob id (``git ls-tree`` of the upstream commit shows the same id when it is unmodified)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def measure(checkout: Path, preset: str, *, context: int = 1024, short: int = 0, long: int = 160,
            samples: int = 5, workdir: Path, device: str = "cuda", compile: bool = True,
            timeout_s: float = 240.0) -> dict[str, Any]:
    """gpt-fast's ms per token at ``preset``'s shapes, batch 1 (see the module docstring); ``timeout_s`` bounds
    the checkpoint and the generate.py runs together.

    One run of ``long`` new tokens after a prompt of ``context - (short + long) // 2`` tokens, its decode steps timed
    on the GPU (``gpt_fast_output``) over the KV window; with ``short`` > 0 a run of ``short`` new tokens too, for
    the difference of the two runs (the older method, printed beside it; the only one without ``compile``).

    Returns:
        a JSON-able dict: model, config name, ModelArgs, differences, gpt-fast commit and file ids, the runs,
        ``decode_ms`` (decode only: GPU-timed, else by difference; ``decode_method`` says which),
        ``decode_ms_by_difference`` (None without a short run), ``reported_ms`` (1000 / tokens/s of the long run)
        and the KV-length window of ``decode_ms``.
    Raises:
        GptFastError: as ``gpt_fast_args``, ``build_checkpoint``, ``run_generate``, ``parse_generate_output``; or
            no decode figure (no timed steps and no short run).
    """
    from lowlat.loader.checkpoint import resolve_model

    cfg = resolve_model(preset)
    args, diffs = gpt_fast_args(cfg)
    prompt = context - (short + long) // 2
    if not (0 <= short < long) or long < 2 or prompt < 1:
        raise GptFastError(f"need 0 <= short ({short}) < long ({long}), long >= 2 and context > (short + long) / 2")
    window = (prompt + max(short, 1), prompt + long - 1)
    t0 = time.perf_counter()
    ckpt = build_checkpoint(checkout, preset, cfg, workdir, device=device)
    built = time.perf_counter() - t0
    runs, tails, texts = {}, [], {}
    for n in (short, long) if short else (long,):
        text = run_generate(checkout, config_name(preset), args, generate_argv(ckpt, prompt, n, samples,
                            compile=compile, device=device), cache_dir=workdir / "inductor",
                            timeout_s=max(1.0, timeout_s - (time.perf_counter() - t0)))
        runs[n], texts[n] = parse_generate_output(text, prompt_len=prompt, new_tokens=n), text
        tails.append(text[-3000:])
        print(f"[gpt-fast] {preset} prompt {prompt} + {n} new: {statistics.median(runs[n].tokens_per_s):.2f} "
              f"tokens/sec (median of {samples}; compile {runs[n].compile_s} s)", flush=True)
    by_diff = decode_ms(runs[short], runs[long]) if short else None
    try:
        steps = gpt_fast_output.step_intervals(texts[long])
        timed = None if steps is None else gpt_fast_output.decode_ms_per_token(
            steps, runs=samples + (1 if compile else 0), new_tokens=long, prompt_len=prompt, kv_window=window)
    except ValueError as e:
        raise GptFastError(f"{preset}: {e}") from None
    if timed is None and by_diff is None:
        raise GptFastError(f"{preset}: generate.py printed no {gpt_fast_output.TAG} line (it compiled no function "
                           f"named {gpt_fast_output.STEP_NAME!r}, or ran without --compile); pass --short N to take "
                           f"the decode time as the difference of two runs instead")
    commit_file = checkout / ".commit"
    res = {"model": preset, "config_name": config_name(preset), "model_args": args, "differences": diffs,
           "gpt_fast_commit": commit_file.read_text().strip() if commit_file.is_file() else None,
           "gpt_fast_blobs": {f: git_blob_sha(checkout / f) for f in ("model.py", "generate.py", "tokenizer.py")},
           "device": device, "compile": compile, "checkpoint_build_s": round(built, 1),
           "runs": [{**asdict(runs[n]), "output_tail": tail} for n, tail in zip(runs, tails, strict=True)],
           "decode_ms": timed[0] if timed else by_diff,
           "decode_method": "gpu-events" if timed else "difference",
           "decode_ms_per_run": timed[1] if timed else None,
           "decode_ms_by_difference": by_diff,
           "reported_ms": 1e3 / statistics.median(runs[long].tokens_per_s),
           "decode_kv_window": list(window)}
    also = f"; by the difference of the runs {by_diff:.3f}" if timed and by_diff is not None else ""
    print(f"[gpt-fast] {preset}: {res['decode_ms']:.3f} ms/token decode only ({res['decode_method']}, KV "
          f"{window[0]}-{window[1]}{also}), {res['reported_ms']:.3f} ms/token as gpt-fast reports it "
          f"(prefill of {prompt} included)", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [LAUNCH]:
        launch(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="gpt-fast's ms/token per preset")
    m.add_argument("--checkout", type=Path, required=True, help="a directory with gpt-fast's files")
    m.add_argument("--model", default="llama-3.2-1b", help="comma-separated dense presets")
    m.add_argument("--context", type=int, default=1024, help="mean KV length of the decode-only window")
    m.add_argument("--short", type=int, default=0,
                   help="new tokens of a second, shorter run: decode time also by difference (0: none)")
    m.add_argument("--long", type=int, default=160, help="new tokens of the long run")
    m.add_argument("--samples", type=int, default=5, help="timed samples per run after its compile run (median)")
    m.add_argument("--workdir", type=Path, default=None,
                   help="checkpoints and inductor cache (default /dev/shm/gpt-fast-peer when it has room, else /tmp)")
    m.add_argument("--device", default="cuda")
    m.add_argument("--no-compile", action="store_true", help="eager (CPU smoke runs)")
    m.add_argument("--timeout-s", type=float, default=240.0, help="limit per model: checkpoint and the runs")
    m.add_argument("--json", type=Path, default=None, help="write the results (a list, one per model)")
    args = ap.parse_args(argv)
    workdir = args.workdir or _default_workdir()
    results, failed = [], []
    for preset in args.model.split(","):
        try:
            results.append(measure(args.checkout.resolve(), preset, context=args.context, short=args.short,
                                   long=args.long, samples=args.samples, workdir=workdir, device=args.device,
                                   compile=not args.no_compile, timeout_s=args.timeout_s))
        except Exception as e:  # noqa: BLE001 -- one model failing (a GptFastError, out of memory) keeps the others
            failed.append({"model": preset, "error": f"{type(e).__name__}: {e}"})
            print(f"[gpt-fast] {preset}: error: {type(e).__name__}: {e}", flush=True)
        if str(workdir).startswith("/dev/shm"):  # memory: 16 GB for qwen3-8b, needed by the next steps
            shutil.rmtree(workdir / config_name(preset), ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "failed": failed}, indent=1))
    return 1 if failed else 0


def _default_workdir() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 40 * 2 ** 30:
        return shm / "gpt-fast-peer"
    return Path("/tmp/gpt-fast-peer")


if __name__ == "__main__":
    raise SystemExit(main())
