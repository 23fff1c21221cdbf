"""Diagnose the contract's alternating-paths test for a plugin on a MoE model: is a divergence a router flip?

For several prompt seeds it runs greedy decoding three ways (all general, plugin/general alternating, plugin
only), and prints per step the largest logit difference from the all-general run, each run's path, and the
smallest top-k boundary gap of the general run's routers (in ulps of the row's largest |router logit|, and the
layer). A divergence after a small gap is a router near-tie; one after only large gaps points at a bug.

    python3 bench/scripts/diag_alternating.py --plugin nvidia_mega --device cuda --seeds 6
"""

from __future__ import annotations

import argparse
import itertools

import torch
from lowlat.layers.moe import SparseMoeBlock
from lowlat.runtime import ModelRunner
from lowlat_contract.cases import build_cases
from lowlat_contract.harness import greedy_run
from lowlat_contract.router_ties import router_gap_ulps


class GapRecorder:
    """Forward hooks on every MoE gate: min top-k boundary gap (ulps) and its layer, per forward call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.calls: list[dict[int, tuple[float, int]]] = []  # per forward: row -> (gap ulps, layer)

    def hook(self, layer: int, top_k: int):
        def fn(_m, _i, out: torch.Tensor) -> None:
            gaps = router_gap_ulps(out.detach(), top_k).tolist()
            cur = self.calls[-1]
            for r, g in enumerate(gaps):
                if r not in cur or g < cur[r][0]:
                    cur[r] = (g, layer)
        return fn

    def __enter__(self) -> GapRecorder:
        self.handles = [b.gate.register_forward_hook(self.hook(i, b.top_k)) for i, b in enumerate(self.blocks)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plugin", default="nvidia_mega")
    ap.add_argument("--arch", default="Qwen3MoeForCausalLM")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=9)
    args = ap.parse_args()
    case = build_cases(args.plugin, [args.arch], None, args.device, None)[0]
    runner = ModelRunner(case.engine_config(), show_progress=False)
    fwd = runner.forward
    rec = GapRecorder(runner.model)

    def counted(batch):
        rec.calls.append({})
        return fwd(batch)

    runner.forward = counted
    print(f"case {case.id}; gap = min top-k boundary gap of the general run's routers, ulps (layer)")
    for seed in [9, *range(100, 100 + args.seeds - 1)]:
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, runner.model_config.vocab_size, (k,), generator=gen).tolist() for k in (5, 22)]
        runs = {}
        for name in ("general", "alternating", "plugin"):
            order = itertools.cycle(["plugin", "general"])
            force = {"general": lambda b: "general", "plugin": lambda b: None if b.forward_mode.name == "PREFILL"
                     else "plugin", "alternating": lambda b, o=order: None if b.forward_mode.name == "PREFILL"
                     else next(o)}[name]
            rec.calls = []
            with rec:
                run = greedy_run(runner, prompts, args.tokens, force_path=force)
            runs[name] = (run, rec.calls)
        want, gaps = runs["general"]
        print(f"--- seed {seed}")
        for name in ("alternating", "plugin"):
            got, _ = runs[name]
            for i in range(len(prompts)):
                diff = [float((got.logits[s][i] - want.logits[s][i]).abs().max()) for s in range(args.tokens)]
                first = next((s for s, (a, b) in enumerate(zip(got.tokens[i], want.tokens[i])) if a != b), None)
                # step s's router rows: prefill rows are the prompt tokens (request i's last row), decode row i
                g = []
                for s in range(args.tokens):
                    row = (sum(len(p) for p in prompts[:i + 1]) - 1) if s == 0 else i
                    gl = gaps[s].get(row) if s < len(gaps) else None
                    g.append(f"{gl[0]:.0f}(L{gl[1]})" if gl else "-")
                print(f"{name:11s} req {i} first divergence {first}; paths {''.join(p[0] for p in got.paths)}")
                print(f"    max|dlogit| per step {' '.join(f'{d:.3f}' for d in diff)}")
                print(f"    general gaps        {' '.join(g)}")
    runner.close()


if __name__ == "__main__":
    main()
