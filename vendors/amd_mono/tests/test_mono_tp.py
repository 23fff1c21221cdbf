"""amd_mono at tp_size 2 end to end on CPU (``lowlat run --tp 2``: rank 1 a spawned gloo worker, the kernels under
the Triton interpreter stage by stage, the peer buffers in /dev/shm): the same greedy tokens as the general path at
TP 2, its DECODE steps on the plugin, for the dense presets and Qwen3-MoE; a rank that never publishes
(LOWLAT_MONO_FAULT_NO_PUBLISH) stops the run within the step deadline with the rank, the peer and the call site named.
Run with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TP 2 on one machine runs on CPU under TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("lowlat.plugin.peer", reason="amd_mono at TP needs lowlat plugin API 4")

from lowlat.cli import run as run_cli  # noqa: E402
from lowlat_amd_mono.tp import FAULT_ENV  # noqa: E402


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
def test_tp2_gives_the_general_paths_tokens_with_decode_on_the_plugin(capsys, model: str) -> None:
    rc, want, _, err = _run(capsys, model, "none")
    assert rc == 0, err
    rc, got, stats, err = _run(capsys, model, "amd_mono")
    assert rc == 0, err
    assert got == want
    assert stats["by_path"]["plugin"]["DECODE"]["steps"] == 5, stats["by_path"]  # 6 tokens: 1 prefill + 5 decode


def test_a_rank_that_never_publishes_stops_the_run_naming_it(capsys, monkeypatch) -> None:
    """Rank 1's o_proj and down store their tiles but never release the flags: every rank's first reduce (layer 0's
    o_proj reduce, call site 0) gives up after half the step deadline, the engine raises PeerWaitTimeout naming
    this rank, peer 1, the stage and the call site, and the run ends with an error instead of hanging.

    20 s, not 4: on CPU the wait's half is counted in interpreter polls, while the step's own work before the wait
    slows with the machine's load; with 4 s a loaded CI run had the step deadline fire first (StepDeadlineExceeded,
    which names no site), as nvidia_mega's test did (1d8eb85). A wait that never gives up still fails here."""
    monkeypatch.setenv(FAULT_ENV, "1")
    start = time.monotonic()
    rc, _, _, err = _run(capsys, "tiny-llama", "amd_mono", "--step-timeout", "20")
    assert rc != 0
    assert ("PeerWaitTimeout" in err and "rank 0" in err and "rank 1's push" in err and "site 0" in err
            and "stage 'reduce'" in err), err
    assert time.monotonic() - start < 120


@pytest.mark.parametrize("value", ["2", "one"])
def test_a_fault_switch_naming_no_rank_is_refused(capsys, monkeypatch, value: str) -> None:
    monkeypatch.setenv(FAULT_ENV, value)
    rc, _, _, err = _run(capsys, "tiny-llama", "amd_mono")
    assert rc != 0 and f"{FAULT_ENV}=" in err and ("must name a rank in [0, 2)" in err or "must be a rank" in err), err


def test_the_moe_model_runs_at_tp_on_the_plugin_and_a_silent_rank_is_named(capsys, monkeypatch) -> None:
    """tiny-qwen3-moe at TP 2 is no longer refused (it builds and its DECODE steps take the plugin, above); with rank
    1's publishes held back, its first reduce (layer 0's o_proj, site 0) gives up and the run names rank 1."""
    monkeypatch.setenv(FAULT_ENV, "1")
    rc, _, _, err = _run(capsys, "tiny-qwen3-moe", "amd_mono", "--step-timeout", "20")
    assert rc != 0 and "UnsupportedConfiguration" not in err, err
    assert "PeerWaitTimeout" in err and "rank 1's push" in err and "site 0" in err, err
