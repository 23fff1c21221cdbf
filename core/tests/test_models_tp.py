"""Tensor parallelism on CPU: two gloo ranks give the same logits as one process."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from _models_util import random_model, script, tiny_config, tp_worker

# llama: kv heads sharded (2 over 2 ranks), llama3 rope; qwen3: tied vocab-parallel lm_head, q/k norm;
# qwen3_moe: its 1 kv head replicated on both ranks, experts sharded. Vocab 97 pads the last rank's shard.
ARCHS = ["llama", "qwen3", "qwen3_moe"]


def test_tp2_matches_tp1(tmp_path):
    ctx = mp.spawn(tp_worker, args=(2, str(tmp_path / "store"), ARCHS, str(tmp_path)), nprocs=2, join=False)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = {arch: script(random_model(tiny_config(arch))) for arch in ARCHS}  # while the ranks start
    finally:
        torch.set_num_threads(n)
    while not ctx.join():
        pass
    for arch in ARCHS:
        got = torch.load(tmp_path / f"logits_{arch}.pt")
        assert len(got) == len(want[arch])
        for g, w in zip(got, want[arch]):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
