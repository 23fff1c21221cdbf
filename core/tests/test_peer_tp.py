"""The general path's all-reduce choice (``EngineConfig.all_reduce``, ``lowlat run --all-reduce``): "peer" sums the
row-parallel outputs of DECODE/VERIFY-sized steps through the peer all-reduce (``lowlat.runtime.peer_reduce``),
everything else through torch.distributed. On CPU: TP 2 with a spawned gloo worker, the peer kernel under the
Triton interpreter. Mutation pass: bench/scripts/mutate_peer_allreduce.py.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from lowlat.cli import run as run_cli
from lowlat.config import ConfigError, EngineConfig
from lowlat.distributed import TPInfo, all_reduce
from lowlat.runtime.step_guard import NonFiniteLogits, checked_picks


def _run_json(capsys, *extra: str) -> tuple[list[list[int]], dict]:
    parser = argparse.ArgumentParser(prog="lowlat")
    run_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["run", "--model", "tiny-llama", "--tp", "2", "--device", "cpu", "--json",
                              "--max-new-tokens", "6", "--max-batch-size", "2", "--max-context-len", "64",
                              "--prompt", "The quick brown fox", "--prompt", "Hi", *extra])
    assert run_cli.run(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return [ln["token_ids"] for ln in lines if ln["type"] == "completion"], lines[-1]


def test_tp2_peer_gives_the_same_tokens_as_nccl(capsys) -> None:
    """TP 2 on CPU: the same greedy tokens with --all-reduce peer as with the default (gloo), and the peer run's
    DECODE steps took the peer buffers (2 sites x 2 layers per step; the 19-token prefill does not fit 2 x 8 rows
    and takes gloo)."""
    want, stats = _run_json(capsys)
    assert stats["all_reduce"] == {"mode": "nccl", "peer_sums": 0}
    got, stats = _run_json(capsys, "--all-reduce", "peer")
    assert got == want
    assert stats["all_reduce"]["mode"] == "peer" and stats["all_reduce"]["peer_sums"] >= 4 * 5, stats


def test_the_choice_is_validated_naming_the_field_and_the_values() -> None:
    with pytest.raises(ConfigError, match=r"all_reduce must be one of nccl, peer \(--all-reduce\), got 'nvls'"):
        EngineConfig(all_reduce="nvls")
    parser = argparse.ArgumentParser(prog="lowlat")
    run_cli.add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--all-reduce", "nvls"])
    assert run_cli.engine_config_from_args(parser.parse_args(["run", "--all-reduce", "peer"])).all_reduce == "peer"


def test_peer_on_a_cpu_without_the_interpreter_is_refused_at_start(monkeypatch) -> None:
    from lowlat.kernels import _launch
    from lowlat.loader import resolve_model
    from lowlat.runtime.peer_reduce import PeerAllReduce

    monkeypatch.setattr(_launch, "interpreting", lambda kernel: False)
    with pytest.raises(ValueError, match=r"all_reduce='peer' \(--all-reduce peer\) on a CPU got CPU tensors but "
                                         "Triton is not in interpreter mode"):
        PeerAllReduce().open(TPInfo(0, 2), EngineConfig(), resolve_model("tiny-llama"), torch.float32,
                             torch.device("cpu"))


def test_all_reduce_takes_the_peer_for_sites_only_and_falls_back_when_it_declines() -> None:
    seen: list[int] = []

    def peer(x: torch.Tensor, site: int) -> torch.Tensor | None:
        seen.append(site)
        return x.mul_(2) if x.numel() <= 4 else None

    tp = TPInfo(0, 2, None, peer=peer)
    assert all_reduce(torch.ones(4), tp, site=3).tolist() == [2.0] * 4 and seen == [3]
    with pytest.raises(RuntimeError, match="not initialized"):  # declined: torch.distributed (none here)
        all_reduce(torch.ones(5), tp, site=5)
    with pytest.raises(RuntimeError, match="not initialized"):  # no site: never the peer
        all_reduce(torch.ones(4), tp)
    assert seen == [3, 5] and tp == TPInfo(0, 2, None)  # the peer is not part of equality


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe"])
def test_row_parallel_sites_are_2_layer_plus_k(model: str) -> None:
    from lowlat.loader import resolve_model
    from lowlat.models import build_model

    m = build_model(resolve_model(model), dtype=torch.float32, device=torch.device("cpu"), tp=TPInfo(),
                    max_context_len=32)
    for i, layer in enumerate(m.model.layers):
        assert layer.self_attn.o_proj.site == 2 * i
        mlp = layer.mlp
        assert (mlp.down_proj.site if hasattr(mlp, "down_proj") else mlp.site) == 2 * i + 1
    assert any(not hasattr(layer.mlp, "down_proj") for layer in m.model.layers) == (model == "tiny-qwen3-moe")


def test_non_finite_logits_first_ask_the_peer_record() -> None:
    """A peer wait that gave up leaves NaN: the finiteness check raises the cause's error instead of its own."""
    class Timeout(Exception):
        pass

    def cause() -> None:
        raise Timeout("peer all-reduce: rank 1 timed out")

    with pytest.raises(Timeout):
        checked_picks([7, 0], lambda: "step 1", cause)
    with pytest.raises(NonFiniteLogits):
        checked_picks([7, 0], lambda: "step 1", lambda: None)
    assert checked_picks([7, 1], lambda: "step 1", cause) == [7]
