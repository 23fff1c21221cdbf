"""nvidia_mega at tp_size 2 end to end on CPU (``lowlat run --tp 2``: rank 1 a spawned gloo worker, the kernels
under the Triton interpreter, the peer buffers in /dev/shm): the same greedy tokens as the general path at TP 2,
its DECODE steps on the plugin; a rank that never publishes stops the run within the step deadline with the rank,
the peer and the call site named. The MoE model publishes its experts' partial sums the same way.
"""

from __future__ import annotations

import argparse
import json
import time

import pytest
from lowlat_nvidia_mega.kernels import pdl

if not pdl.interpreting():
    pytest.skip("TP 2 on one machine runs on CPU under TRITON_INTERPRET=1 (two GPUs: bench/gpu_jobs.py)",
                allow_module_level=True)
pytest.importorskip("lowlat.plugin.peer", reason="nvidia_mega at TP needs lowlat plugin API 4")

from lowlat.cli import run as run_cli  # noqa: E402
from lowlat_nvidia_mega.kernels.moe import CONFIG_ENV  # noqa: E402
from lowlat_nvidia_mega.tp import FAULT_ENV, TP_REDUCE_ENV  # noqa: E402


def _run(capsys, model: str, plugin: str, *extra: str) -> tuple[int, list[list[int]], dict, str]:
    parser = argparse.ArgumentParser(prog="lowlat")
    run_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["run", "--model", model, "--tp", "2", "--device", "cpu", "--dtype", "bfloat16", "--json",
                              "--plugin", plugin, "--max-new-tokens", "6", "--max-batch-size", "2",
                              "--max-context-len", "64", "--prompt", "The quick brown fox", "--prompt", "Hi", *extra])
    rc = run_cli.run(args)
    cap = capsys.readouterr()
    lines = [json.loads(line) for line in cap.out.splitlines() if line.startswith("{")]
    stats = next((ln for ln in lines if ln["type"] == "stats"), {})
    return rc, [ln["token_ids"] for ln in lines if ln["type"] == "completion"], stats, cap.err


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"])
def test_tp2_gives_the_general_paths_tokens_with_decode_on_the_plugin(capsys, monkeypatch, model: str) -> None:
    """Epilogue publishing (the default), then LOWLAT_MEGA_TP_REDUCE=nccl (the comparison row: partials stored,
    summed by torch.distributed, then the residual add and the norm): the general path's tokens both ways, every
    DECODE step on the plugin, and the nccl run makes two more torch.distributed sums per layer and DECODE step on
    rank 0 (this process) than publishing. A bad value of the switch is refused at build."""
    import torch.distributed as dist

    rc, want, _, err = _run(capsys, model, "none")
    assert rc == 0, err
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    rc, got, stats, err = _run(capsys, model, "nvidia_mega")
    assert rc == 0 and got == want, err
    assert stats["by_path"]["plugin"]["DECODE"]["steps"] == 5, stats["by_path"]  # 6 tokens: 1 prefill + 5 decode
    if model == "tiny-qwen3":
        return  # the nccl variant runs on the dense and the MoE model; tiny-qwen3 adds nothing to it
    publish_calls, calls[:] = len(calls), []
    monkeypatch.setenv(TP_REDUCE_ENV, "nccl")
    rc, got, stats, err = _run(capsys, model, "nvidia_mega")
    assert rc == 0 and got == want, err
    assert stats["by_path"]["plugin"]["DECODE"]["steps"] == 5, stats["by_path"]
    assert len(calls) - publish_calls == 2 * 2 * 5, (len(calls), publish_calls)  # 2 layers, 5 DECODE steps
    if model == "tiny-qwen3-moe":  # a MoE config from the environment: the reduce counts the down's own tiles
        monkeypatch.setenv(TP_REDUCE_ENV, "publish")
        monkeypatch.setenv(CONFIG_ENV, "down_block_n=128")
        rc, got, _, err = _run(capsys, model, "nvidia_mega")
        assert rc == 0 and got == want, err
        return  # the bad value below: check_switches refuses it (the guard's, then build's) and reads no model
    monkeypatch.setenv(TP_REDUCE_ENV, "nvls")
    rc, _, _, err = _run(capsys, model, "nvidia_mega")
    assert rc != 0 and f"{TP_REDUCE_ENV}='nvls': use one of publish, nccl" in err and "PluginBuildError" in err, err


def test_a_rank_that_never_publishes_stops_the_run_naming_it(capsys, monkeypatch) -> None:
    """Rank 1's o_proj and down store their tiles but never release the flags: every rank's first reduce gives up
    after half the step deadline, the engine raises PeerWaitTimeout naming this rank, peer 1 and call site 0
    (layer 0's o_proj), and the run ends with an error instead of hanging.

    On CPU the wait's half is counted in interpreter polls (``CPU_POLLS_PER_S``, a floor of 100/s; a few hundred
    are usual), and the step's own work before the wait slows with the load as well: with a 4 s deadline, a CI run
    of five processes on two cores had the step deadline fire first (StepDeadlineExceeded, not PeerWaitTimeout).
    20 s leaves the step 10 s for that work even at the poll floor, for ~1.2 s more here (1000 polls). A wait
    that never gives up still fails this test: the step deadline then ends the run, and its error names no site."""
    monkeypatch.setenv(FAULT_ENV, "1")
    start = time.monotonic()
    rc, _, _, err = _run(capsys, "tiny-llama", "nvidia_mega", "--step-timeout", "20")
    assert rc != 0
    assert "PeerWaitTimeout" in err and "rank 0" in err and "rank 1's push" in err and "site 0" in err, err
    assert time.monotonic() - start < 120


def test_a_fault_switch_naming_no_rank_is_refused(capsys, monkeypatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "2")
    rc, _, _, err = _run(capsys, "tiny-llama", "nvidia_mega")
    assert rc != 0 and f"{FAULT_ENV}='2' must name a rank in [0, 2)" in err, err
