"""The n-gram drafter on a repetitive workload: acceptance, tokens per step, speed-up over plain decoding and the
drafter's own cost per step, per path and batch size, in one table.

    python bench/scripts/spec_ngram.py --model llama-3.2-1b --paths none,nvidia_mega --json /tmp/out/ngram.json

The workload, and what it measures. The GPU machine has no real checkpoint: presets carry seeded random weights,
and a random-weight model does not copy a passage it is shown, so "repeat this text" prompts would measure
nothing. What such a model does under greedy decoding is fall into loops of its own. Each request's prompt is
therefore made by the model itself:

- ``copy``: a seed of ``--seed-len`` random ids plus the model's own greedy continuation of it (``--warmup-tokens``
  tokens, plain decoding on the first path). The measured run continues that text. Where the model's greedy
  trajectory entered a loop inside the prompt, the output copies from the prompt: the case prompt lookup is for.
- ``fresh``: the seed alone; the output is the model's free text from the start, loops included once it finds
  them.

How repetitive the measured output is comes from the plain run's tokens alone, beside the acceptance:
``copyable`` is the share of output tokens that a one-token prompt lookup (``ngram.lookup`` with the engine's n
and window, on the prompt and the output before that token) predicts. The text is the model's own: greedy
speculative output is checked equal to plain decoding's (``same``: requests with identical tokens; bfloat16
near-ties may flip at batch > 1, see bench/scripts/spec_identity.py).

Per (path, workload, batch), from one plain engine (the default loop: overlapped on CUDA) and one n-gram engine
(``lowlat run --speculative ngram``'s defaults: adaptive off-switch enabled), each warmed up first:

- per-request decode tok/s of each (``Completion.decode_tokens_per_s``, mean: output tokens, rejected drafts not
  counted) and their ratio, the speed-up;
- acceptance length (tokens appended per request per VERIFY step, the token after the drafts included) and
  tokens/step (per request over every decoding step, VERIFY and DECODE: what the speed-up is made of);
- drafting: host seconds in ``NgramDrafter.propose`` per VERIFY step (``SpecStats.draft_s``) and its share of a
  speculative step (drafting + VERIFY);
- auto-off at end: whether the adaptive off-switch had turned speculation off ("triggered") when the run ended.

Prints the markdown table; exits 1 when a path fails to run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import torch
from lowlat import Engine, EngineConfig, SamplingParams
from lowlat.runtime.speculative.ngram import lookup

HEADERS = ("path", "workload", "batch", "copyable", "plain tok/s/req", "ngram tok/s/req", "speed-up",
           "accept len", "tokens/step", "VERIFY/DECODE steps", "drafting us/step", "drafting % of step", "same",
           "auto-off at end")


def copyable(prompt: list[int], out: list[int], n: int, window: int) -> float:
    """Share of ``out``'s tokens that a one-token n-gram lookup on everything before each predicts."""
    seq = list(prompt)
    hits = 0
    for t in out:
        d = lookup(np.asarray(seq, dtype=np.int64), n, 1, window)
        hits += bool(d) and d[0] == t
        seq.append(t)
    return hits / len(out) if out else 0.0


def make_workloads(engine: Engine, args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """``{"copy": prompts, "fresh": prompts}``, ``max(batch sizes)`` of each (see the module docstring)."""
    g = torch.Generator().manual_seed(args.seed)
    vocab = engine.model_config.vocab_size
    b = max(args.batch_sizes)
    seeds = [torch.randint(1, vocab, (args.seed_len,), generator=g).tolist() for _ in range(b)]
    cont = engine.generate(seeds, SamplingParams(max_new_tokens=args.warmup_tokens, stop_at_eos=False))
    return {"copy": [s + list(c.token_ids) for s, c in zip(seeds, cont)], "fresh": seeds}


def measure(engine: Engine, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float]:
    """Greedy ``new`` tokens per prompt after a short warm-up; (tokens, mean per-request decode tok/s)."""
    engine.generate(prompts, SamplingParams(max_new_tokens=8, stop_at_eos=False))  # warm-up (first-call costs)
    if engine.speculator is not None:
        engine.speculator.stats.reset()
    done = engine.generate(prompts, SamplingParams(max_new_tokens=new, stop_at_eos=False))
    return [list(c.token_ids) for c in done], sum(c.decode_tokens_per_s for c in done) / len(done)


def spec_row(d: dict[str, Any]) -> dict[str, Any]:
    """Acceptance, tokens per step and the drafter's cost from ``Speculator.as_dict``."""
    vs = d["verify_steps"]
    req_steps = d["request_steps"] + d["decode_tokens"]
    step_s = (d["draft_s"] + d["verify_s"]) / vs if vs else 0.0
    return {"acceptance_length": d["acceptance_length"], "acceptance_rate": d["acceptance_rate"],
            "tokens_per_step": (d["emitted"] + d["decode_tokens"]) / req_steps if req_steps else 0.0,
            "verify_steps": vs, "decode_steps": d["decode_steps"],
            "draft_us_per_step": 1e6 * d["draft_s"] / vs if vs else 0.0,
            "draft_share": d["draft_s"] / vs / step_s if vs and step_s else 0.0,
            "controller": d.get("controller", {})}


def run_path(path: str, args: argparse.Namespace, workloads: dict[str, list[list[int]]] | None,
             base: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, list[list[int]]]]:
    rows: list[dict[str, Any]] = []
    plain: dict[tuple[str, int], tuple[list[list[int]], float]] = {}
    with Engine(EngineConfig(plugin=path, **base)) as e:
        if workloads is None:
            workloads = make_workloads(e, args)
        for w, prompts in workloads.items():
            for b in args.batch_sizes:
                plain[(w, b)] = measure(e, prompts[:b], args.new_tokens)
    cfg = EngineConfig(plugin=path, speculative_method="ngram", num_draft_tokens=args.k, **base)
    with Engine(cfg) as e:
        n, window = cfg.ngram_n, cfg.ngram_window
        for w, prompts in workloads.items():
            for b in args.batch_sizes:
                toks, tok_s = measure(e, prompts[:b], args.new_tokens)
                ref, ref_tok_s = plain[(w, b)]
                s = spec_row(e.speculator.as_dict(e))
                rows.append({"path": path, "workload": w, "batch": b, "plain_tok_s": ref_tok_s, "ngram_tok_s": tok_s,
                             "speedup": tok_s / ref_tok_s if ref_tok_s else 0.0,
                             "copyable": sum(copyable(p, o, n, window) for p, o in zip(prompts, ref)) / b,
                             "same": sum(a == r for a, r in zip(toks, ref)), **s})
    return rows, workloads


def off_switch(c: dict[str, Any]) -> str:
    """The adaptive off-switch's state at the end of the run: "not triggered" (speculating) or "triggered" (plain
    DECODE steps), with its switches; "-" without a controller (``--no-spec-adaptive``)."""
    if "on" not in c:
        return "-"
    return ("not triggered" if c["on"] else "triggered") + (f", {c['switches']} switches" if c.get("switches") else "")


def render(rows: list[dict[str, Any]]) -> str:
    """The markdown table; tok/s/req are each request's own output tokens per second (kept tokens only: rejected
    drafts are not counted), the mean over the batch's requests."""
    out = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for r in rows:
        sw = off_switch(r["controller"])
        out.append("| " + " | ".join([
            r["path"], r["workload"], str(r["batch"]), f"{100 * r['copyable']:.0f}%", f"{r['plain_tok_s']:.1f}",
            f"{r['ngram_tok_s']:.1f}", f"{r['speedup']:.2f}x", f"{r['acceptance_length']:.2f}",
            f"{r['tokens_per_step']:.2f}", f"{r['verify_steps']}/{r['decode_steps']}",
            f"{r['draft_us_per_step']:.0f}", f"{100 * r['draft_share']:.1f}%", f"{r['same']}/{r['batch']}", sw]) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--paths", default="none,nvidia_mega", help="plugin values: none (general path) or a plugin")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--k", type=int, default=5, help="draft tokens per VERIFY step (default 5: 6 rows)")
    ap.add_argument("--seed-len", type=int, default=16)
    ap.add_argument("--warmup-tokens", type=int, default=256, help="the model's own tokens in a copy prompt")
    ap.add_argument("--new-tokens", type=int, default=256, help="measured tokens per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    ctx = args.seed_len + args.warmup_tokens + args.new_tokens + 16
    base = dict(model=args.model, device=args.device, dtype=args.dtype, max_batch_size=max(args.batch_sizes),
                max_context_len=max(512, ctx))
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    workloads = None
    failed = []
    for path in args.paths.split(","):
        try:
            got, workloads = run_path(path, args, workloads, base)
            rows += got
        except Exception as e:  # report the path and go on with the others
            failed.append(path)
            print(f"path {path} failed: {type(e).__name__}: {e}", flush=True)
    print(f"n-gram drafter, k={args.k}, {args.model} {args.dtype} on {args.device}: prompts = {args.seed_len} random "
          f"ids (+ the model's own {args.warmup_tokens} greedy tokens for 'copy'), {args.new_tokens} measured "
          f"tokens per request; random weights: the text is the model's own greedy output; tok/s/req: per request "
          f"(mean over the batch), output tokens only, rejected drafts not counted; auto-off at end: whether the "
          f"adaptive off-switch had turned speculation off (triggered) when the run ended")
    print(render(rows))
    print(f"({time.monotonic() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
