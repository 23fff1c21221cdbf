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
4. parses its per-sample ``tokens/sec`` (its timer covers prefill and decode). It runs twice, ``N_short`` and
   ``N_long`` new tokens after the same prompt, and reports both gpt-fast's own figure (1000 / tokens/s of the
   long run: prefill included) and the decode-only ms per token ``(t_long - t_short) / (N_long - N_short)``,
   ``t = N / (tokens/s)``, medians over samples. With the defaults (context 1024, 32 and 160 new tokens:
   P = 928) the decode-only window has KV lengths 960..1087, the same window as bench/scripts/e2e_tpot.py's
   ``Engine.generate`` run at ``--context 1024 --new-tokens 128``. Each run compiles its own decode graph
   (generate.py sizes the KV cache to prompt + new tokens, so the two runs' shapes differ).
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = 256  # gpt-fast's TiktokenWrapper appends this many special tokens to the BPE file's ranks
FORBIDDEN_IN_PATH = ("int8", "int4", "stories", "chat")  # generate.py switches behaviour on these substrings
LAUNCH = "_launch"
SYNTHETIC_IDS = 1024  # generate.py's --prompt N draws N ids in [0, 1024)


class GptFastError(RuntimeError):
    """gpt-fast cannot run this shape, its checkout is missing, or its output lacks a figure (message says which)."""


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


# ---- 4. its output ---------------------------------------------------------------------------------------------

@dataclass
class GenerateRun:
    """One generate.py run: per-sample tokens/s and seconds (``new_tokens / tokens_per_s``), what it reported."""

    prompt_len: int
    new_tokens: int
    tokens_per_s: list[float]
    seconds: list[float]
    average_tokens_per_s: float
    compile_s: float | None
    memory_gb: float | None


_SAMPLE = re.compile(r"^Time for inference (\d+): ([\d.]+) sec total, ([\d.]+) tokens/sec", re.M)


def _field(text: str, label: str) -> str:
    m = re.search(rf"^{re.escape(label)}: ([\d.]+)", text, re.M)
    if not m:
        raise GptFastError(f"generate.py's output has no {label!r} line (a gpt-fast version whose summary "
                           f"differs?); last output:\n{text[-2000:]}")
    return m.group(1)


def parse_generate_output(text: str, *, prompt_len: int, new_tokens: int) -> GenerateRun:
    """Parse generate.py's stdout into a ``GenerateRun``.

    Raises:
        GptFastError: no per-sample lines, a summary line missing, or a batch size, prompt length or token count
            other than the one asked for.
    """
    samples = [(int(i), float(tps)) for i, _, tps in _SAMPLE.findall(text)]
    if not samples:
        raise GptFastError(f"no 'Time for inference N: ... tokens/sec' lines in generate.py's output:\n{text[-2000:]}")
    if [i for i, _ in samples] != list(range(1, len(samples) + 1)) or min(t for _, t in samples) <= 0:
        raise GptFastError(f"per-sample lines out of order or with zero tokens/sec: {samples}")
    got = {"Batch Size": int(_field(text, "Batch Size")), "Prompt Length": int(_field(text, "Prompt Length")),
           "Generated tokens": int(_field(text, "Generated tokens"))}
    want = {"Batch Size": 1, "Prompt Length": prompt_len, "Generated tokens": new_tokens}
    if got != want:
        raise GptFastError(f"generate.py ran {got}, asked for {want}")
    comp = re.search(r"^Compilation time: ([\d.]+) seconds", text, re.M)
    mem = re.search(r"^Memory used: ([\d.]+) GB", text, re.M)
    tps = [t for _, t in samples]
    return GenerateRun(prompt_len, new_tokens, tps, [new_tokens / t for t in tps],
                       float(_field(text, "Average tokens/sec")), float(comp.group(1)) if comp else None,
                       float(mem.group(1)) if mem else None)


def decode_ms(short: GenerateRun, long: GenerateRun) -> float:
    """Decode-only ms per token: the extra seconds of the long run over its extra tokens (sample medians).

    Raises:
        GptFastError: the runs have different prompts, or the long run is not longer.
    """
    if short.prompt_len != long.prompt_len or long.new_tokens <= short.new_tokens:
        raise GptFastError(f"need the same prompt and more new tokens in the long run: {short.prompt_len}/"
                           f"{short.new_tokens} vs {long.prompt_len}/{long.new_tokens}")
    extra = statistics.median(long.seconds) - statistics.median(short.seconds)
    return 1e3 * extra / (long.new_tokens - short.new_tokens)


# ---- the measurement -------------------------------------------------------------------------------------------

def git_blob_sha(path: Path) -> str:
    """The file's git blob id (``git ls-tree`` of the upstream commit shows the same id when it is unmodified)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def measure(checkout: Path, preset: str, *, context: int = 1024, short: int = 32, long: int = 160,
            samples: int = 5, workdir: Path, device: str = "cuda", compile: bool = True,
            timeout_s: float = 240.0) -> dict[str, Any]:
    """gpt-fast's ms per token at ``preset``'s shapes, batch 1 (see the module docstring); ``timeout_s`` bounds
    the checkpoint and both generate.py runs together.

    Returns:
        a JSON-able dict: model, config name, ModelArgs, differences, gpt-fast commit and file ids, both runs,
        ``decode_ms`` (decode only, by difference), ``reported_ms`` (1000 / tokens/s of the long run) and the
        KV-length window of ``decode_ms``.
    Raises:
        GptFastError: as ``gpt_fast_args``, ``build_checkpoint``, ``run_generate``, ``parse_generate_output``.
    """
    from lowlat.loader.checkpoint import resolve_model

    cfg = resolve_model(preset)
    args, diffs = gpt_fast_args(cfg)
    prompt = context - (short + long) // 2
    if not (1 <= short < long) or prompt < 1:
        raise GptFastError(f"need 1 <= short ({short}) < long ({long}) and context > (short + long) / 2")
    t0 = time.perf_counter()
    ckpt = build_checkpoint(checkout, preset, cfg, workdir, device=device)
    built = time.perf_counter() - t0
    runs, tails = {}, []
    for n in (short, long):
        text = run_generate(checkout, config_name(preset), args, generate_argv(ckpt, prompt, n, samples,
                            compile=compile, device=device), cache_dir=workdir / "inductor",
                            timeout_s=max(1.0, timeout_s - (time.perf_counter() - t0)))
        runs[n] = parse_generate_output(text, prompt_len=prompt, new_tokens=n)
        tails.append(text[-3000:])
        print(f"[gpt-fast] {preset} prompt {prompt} + {n} new: {statistics.median(runs[n].tokens_per_s):.2f} "
              f"tokens/sec (median of {samples}; compile {runs[n].compile_s} s)", flush=True)
    commit_file = checkout / ".commit"
    res = {"model": preset, "config_name": config_name(preset), "model_args": args, "differences": diffs,
           "gpt_fast_commit": commit_file.read_text().strip() if commit_file.is_file() else None,
           "gpt_fast_blobs": {f: git_blob_sha(checkout / f) for f in ("model.py", "generate.py", "tokenizer.py")},
           "device": device, "compile": compile, "checkpoint_build_s": round(built, 1),
           "runs": [{**asdict(runs[n]), "output_tail": tail} for n, tail in zip((short, long), tails)],
           "decode_ms": decode_ms(runs[short], runs[long]),
           "reported_ms": 1e3 / statistics.median(runs[long].tokens_per_s),
           "decode_kv_window": [prompt + short, prompt + long - 1]}
    print(f"[gpt-fast] {preset}: {res['decode_ms']:.3f} ms/token decode only (KV {res['decode_kv_window'][0]}-"
          f"{res['decode_kv_window'][1]}), {res['reported_ms']:.3f} ms/token as gpt-fast reports it "
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
    m.add_argument("--short", type=int, default=32, help="new tokens of the short run")
    m.add_argument("--long", type=int, default=160, help="new tokens of the long run")
    m.add_argument("--samples", type=int, default=5, help="timed samples per run after its compile run (median)")
    m.add_argument("--workdir", type=Path, default=None,
                   help="checkpoints and inductor cache (default /dev/shm/gpt-fast-peer when it has room, else /tmp)")
    m.add_argument("--device", default="cuda")
    m.add_argument("--no-compile", action="store_true", help="eager (CPU smoke runs)")
    m.add_argument("--timeout-s", type=float, default=240.0, help="limit per model: checkpoint and both runs")
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
