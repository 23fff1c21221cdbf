"""``lowlat run`` through its own parser, in-process."""

from __future__ import annotations

import argparse
import io
import json

import pytest
from lowlat.cli import run as run_cli


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lowlat")
    run_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["run", *argv])


def test_defaults():
    args = _parse([])
    config, params, prompts = run_cli.configs_from_args(args)
    assert args.func is run_cli.run
    assert config.model == "tiny-llama" and config.cuda_graph and config.tp_size == 1
    assert params.max_new_tokens == 32 and params.greedy and prompts == [run_cli.DEFAULT_PROMPT]


def test_run_prints_completions_and_summary(capsys):
    args = _parse(["--device", "cpu", "--max-context-len", "64", "--max-new-tokens", "5", "--prompt", "hello",
                   "--prompt", "second prompt", "--temperature", "0.8", "--top-k", "50", "--top-p", "0.9",
                   "--seed", "3", "--page-size", "8", "--max-batch-size", "2", "--no-cuda-graph"])
    assert run_cli.run(args) == 0
    out = capsys.readouterr().out
    assert "[0] hello" in out and "[1] second prompt" in out
    for word in ("prefill ms", "decode tok/s", "PREFILL", "DECODE", "steps by forward mode"):
        assert word in out
    # tiny-llama's checkpoint is bf16; dtype auto computes in float32 on a CPU, and the summary says so
    assert "float32 (the checkpoint's bfloat16; --dtype bfloat16 keeps it)" in " ".join(out.split())


def test_dtype_help_says_what_auto_resolves_to():
    import dataclasses

    import torch
    from lowlat.config import EngineConfig
    from lowlat.loader.presets import get_preset

    parser = argparse.ArgumentParser(prog="lowlat")
    run_cli.add_parser(parser.add_subparsers(dest="command"))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    text = " ".join(sub.format_help().split())
    assert "auto (the default: the checkpoint's dtype on a GPU, always float32 on a CPU)" in text
    # what the help says: on a CPU auto is float32 whatever the checkpoint stores, float16 included
    fp16 = dataclasses.replace(get_preset("tiny-llama"), torch_dtype="float16")
    assert EngineConfig(device="cpu").resolved_dtype(fp16) == torch.float32


@pytest.mark.parametrize("argv, msg", [
    (["--model", "no-such-preset"], "neither a directory"),
    (["--device", "cpu", "--max-context-len", "8", "--prompt", "far too long a prompt"], "max_context_len=8"),
    (["--device", "cpu", "--top-p", "0"], "top_p"),
    (["--device", "cpu", "--max-batch-size", "0"], "max_batch_size"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, monkeypatch, argv, msg):
    monkeypatch.delenv("LOWLAT_DEBUG", raising=False)
    assert run_cli.run(_parse(argv)) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1 and "Traceback" not in err


def test_debug_shows_the_exception(monkeypatch):
    monkeypatch.setenv("LOWLAT_DEBUG", "1")
    with pytest.raises(ValueError, match="top_p"):
        run_cli.run(_parse(["--device", "cpu", "--top-p", "0"]))


def test_single_prompt_streams_and_json_lines(capsys):
    base = ["--device", "cpu", "--max-context-len", "64", "--max-new-tokens", "6", "--page-size", "8",
            "--no-cuda-graph", "--ignore-eos"]
    assert run_cli.run(_parse([*base, "--prompt", "stream me"])) == 0
    out = capsys.readouterr().out
    assert "[0] stream me" in out and "decode tok/s" in out
    assert run_cli.run(_parse([*base, "--prompt", "a", "--prompt", "bb", "--json"])) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["type"] for d in lines] == ["completion", "completion", "stats"]
    assert all(len(d["token_ids"]) == 6 and d["finish_reason"] == "length" for d in lines[:2])
    assert lines[0]["prompt"] == "a" and "decode_s" in lines[0]["timings"] and lines[2]["by_path"]


def test_stop_string_and_prompt_file(tmp_path, capsys, monkeypatch):
    base = ["--device", "cpu", "--max-context-len", "64", "--max-new-tokens", "16", "--page-size", "8",
            "--no-cuda-graph", "--ignore-eos", "--json"]
    assert run_cli.run(_parse([*base, "--prompt", "stop"])) == 0
    full = json.loads(capsys.readouterr().out.splitlines()[0])
    stop = full["text"][4:6]
    f = tmp_path / "prompts.txt"
    f.write_text("stop\n\n")
    assert run_cli.run(_parse([*base, "--prompt-file", str(f), "--stop", stop])) == 0
    got = json.loads(capsys.readouterr().out.splitlines()[0])
    assert got["finish_reason"] == "stop" and got["text"] == full["text"][:full["text"].find(stop)]
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin\n"))
    assert run_cli.run(_parse([*base, "--prompt-file", "-"])) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["prompt"] == "from stdin"
