"""The differential check at TP 2 (two gloo ranks on CPU) for representative variants.

Chosen for what TP shards differently: MLP biases (column-parallel gate/up bias, down bias added once after the
all-reduce), attention biases with q/k norm, one KV head replicated on both ranks, a tied vocab-parallel
lm_head, and MoE with both routings and a dense layer. Each rank loads the transformers-written checkpoint
through lowlat's loader; rank 0's greedy run must equal transformers at every step, as at TP 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from lowlat.models.variants import variant

pytest.importorskip("transformers")

TP_VARIANTS = ["llama-mlp-bias", "llama-mqa", "llama-tied", "qwen3-attention-bias", "moe-no-norm-topk",
               "moe-dense-layer-0"]


def _worker(rank: int, world: int, store: str, paths: list[str], out_dir: str) -> None:
    import torch.distributed as dist
    from lowlat.distributed import TPInfo
    from test_hf_differential import greedy, load_ours

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        tp = TPInfo(rank=rank, size=world, group=dist.group.WORLD)
        for p in paths:
            tokens, logits = greedy(load_ours(Path(p), tp=tp))
            if rank == 0:
                torch.save((tokens, logits), Path(out_dir) / f"{Path(p).name}.pt")
    finally:
        dist.destroy_process_group()


def test_tp2_matches_transformers(tmp_path) -> None:
    from test_hf_differential import assert_matches_hf, hf_logits, save

    saved = {name: save(variant(name), tmp_path) for name in TP_VARIANTS}
    paths = [str(p) for _, p in saved.values()]
    ctx = mp.spawn(_worker, args=(2, str(tmp_path / "store"), paths, str(tmp_path)), nprocs=2, join=False)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        while not ctx.join():
            pass
    finally:
        torch.set_num_threads(n)
    for name, (hf, _) in saved.items():
        tokens, logits = torch.load(tmp_path / f"{name}.pt")
        assert_matches_hf(tokens, logits, hf_logits(hf, tokens), f"{name} at tp=2")
