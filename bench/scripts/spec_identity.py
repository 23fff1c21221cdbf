"""Greedy identity of speculative decoding on one device: plain vs each drafter, batch 1 and 4, per path.

``python bench/scripts/spec_identity.py --model llama-3.2-1b --device cuda --paths none,nvidia_mega``
prints one line per (path, drafter, batch): identical or not, acceptance length, VERIFY steps per path, and
whether the KV pool got every page back. Exits 1 on any difference. The drafters are ngram and the target
drafting itself (draft:MODEL: every draft kept, the draft runner's graphs and plugin path exercised).

In bfloat16 a VERIFY row and a DECODE step are different kernels (and reduction orders), so a near-tie between
the two best tokens can flip: a difference here is a bug only if ``lowlat run --compare``-style logits are not
a near-tie at the first differing token (CPU float32 runs are exact: core/tests/test_spec_engine.py).
"""

from __future__ import annotations

import argparse
import sys

from lowlat import Engine, EngineConfig, SamplingParams

PROMPTS = [list(range(1, 40)), [7, 8, 9] * 12, [100, 200, 300] * 5 + [5] * 20, list(range(400, 430))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--paths", default="none,nvidia_mega")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=5)
    args = ap.parse_args()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    base = dict(model=args.model, device=args.device, dtype=args.dtype, max_batch_size=4, max_context_len=512)
    bad = 0
    for path in args.paths.split(","):
        with Engine(EngineConfig(plugin=path, **base)) as e:
            plain = {b: [c.token_ids for c in e.generate(PROMPTS[:b], params)] for b in (1, 4)}
        for method in ("ngram", f"draft:{args.model}"):
            cfg = EngineConfig(plugin=path, speculative_method=method, num_draft_tokens=args.k,
                               speculative_adaptive=False, **base)
            with Engine(cfg) as e:
                pool = e.runner.kv_pool
                free = pool.free_pages
                for b in (1, 4):
                    e.speculator.stats.reset()
                    e.stats.reset()
                    got = [c.token_ids for c in e.generate(PROMPTS[:b], params)]
                    d = e.speculator.as_dict(e)
                    same = got == plain[b]
                    bad += not same or pool.free_pages != free
                    first = [next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), None)
                             for g, w in zip(got, plain[b])]
                    what = "identical" if same else f"DIFFERENT (first differing token per request: {first})"
                    print(f"path={path} {method} batch={b}: {what}, acceptance "
                          f"length {d['acceptance_length']:.2f}, VERIFY steps {d['verify_steps_by_path']}, "
                          f"pages back {pool.free_pages == free}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
