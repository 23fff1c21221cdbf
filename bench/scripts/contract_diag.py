"""One-off GPU diagnosis of two contract failures (not a product path).

    python3 bench/scripts/contract_diag.py kv      # large attention scores, tiny-qwen3: where K differs
    python3 bench/scripts/contract_diag.py mem     # long run memory growth, qwen3-30b-a3b: who allocated it
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

OUT = os.environ.get("OUT", "/tmp/out")


class KVDiag:
    """Wrap check_step in test_sweeps: save got/want K/V and logits of every step."""

    def __init__(self) -> None:
        self.n = 0

    def pytest_configure(self, config):  # noqa: ANN001
        import lowlat_contract.contracts.test_sweeps as ts
        from lowlat_contract import oracle

        real = oracle.check_step

        def wrapped(runner, batch, tol, what, **kw):  # noqa: ANN001
            res = real(runner, batch, tol, what, **kw)
            torch.save({"what": what, "got": res.logits.cpu(), "want": res.want.cpu(), "got_kv": res.kv.cpu(),
                        "want_kv": res.want_kv.cpu(), "positions": batch.positions.cpu(),
                        "problems": res.problems}, f"{OUT}/kv_{self.n}.pt")
            print(f"[diag] saved kv_{self.n}.pt {what} problems={len(res.problems)}", flush=True)
            self.n += 1
            return res

        ts.check_step = wrapped


class MemDiag:
    """Record allocator history; at each _allocated call keep the active blocks; print the new ones' stacks."""

    def __init__(self) -> None:
        self.snaps: list[dict[int, tuple[int, list]]] = []

    def pytest_configure(self, config):  # noqa: ANN001
        import lowlat_contract.contracts.test_long_run as tl

        torch.cuda.memory._record_memory_history(max_entries=200000, context="all", stacks="python")
        real = tl._allocated

        def wrapped(device):  # noqa: ANN001
            v = real(device)
            snap = torch.cuda.memory._snapshot()
            blocks = {}
            for seg in snap["segments"]:
                for b in seg["blocks"]:
                    if b["state"] == "active_allocated":
                        blocks[b["address"]] = (b["size"], b.get("frames", []))
            self.snaps.append(blocks)
            if len(self.snaps) >= 2:
                a, b = self.snaps[-2], self.snaps[-1]
                new = [(b[k][0], b[k][1]) for k in b.keys() - a.keys()]
                gone = sum(a[k][0] for k in a.keys() - b.keys())
                print(f"[diag] call {len(self.snaps)}: allocated {v}; {len(new)} new blocks "
                      f"{sum(s for s, _ in new)} B, {gone} B freed", flush=True)
                for size, frames in sorted(new, key=lambda x: -x[0])[:12]:
                    fr = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames
                          if "python" not in f["filename"] or "site-packages" in f["filename"]]
                    fr = [f for f in fr if "pytest" not in f and "pluggy" not in f][:14]
                    print(f"   {size} B: " + " <- ".join(fr), flush=True)
            return v

        tl._allocated = wrapped


def main() -> int:
    what = sys.argv[1]
    base = ["-q", "-p", "no:cacheprovider", "-s", "--pyargs", "lowlat_contract", "--lowlat-plugin",
            sys.argv[2] if len(sys.argv) > 2 else "nvidia_mega", "--lowlat-device",
            os.environ.get("DIAG_DEVICE", "cuda")]
    if what == "kv":
        return pytest.main([*base, "--lowlat-arch", "Qwen3ForCausalLM", "--lowlat-arch", "LlamaForCausalLM",
                            "-k", "large_attention_scores and bfloat16"], plugins=[KVDiag()])
    return pytest.main([*base, "--lowlat-model", "qwen3-30b-a3b", "--lowlat-arch", "Qwen3MoeForCausalLM", "-k",
                        "long_run_matches_general and qwen3-30b"], plugins=[MemDiag()])


if __name__ == "__main__":
    raise SystemExit(main())
