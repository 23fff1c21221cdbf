"""The byte tokenizer, load_tokenizer, and the make-checkpoint subcommand."""

from __future__ import annotations

import argparse
import json
import re

import pytest
from lowlat.cli import make_checkpoint
from lowlat.loader import (
    CheckpointReader,
    get_preset,
    load_tokenizer,
    make_byte_tokenizer,
    with_layers,
    write_checkpoint,
)
from lowlat.loader.tokenizer import UNKNOWN_PLACEHOLDER

TEXTS = ["hello world", "", "  two leading spaces\n\ttab", "héllo 日本語 🎉", "\x00\x7f\r\n", "Ġ ċ <|bos", "a" * 300]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = load_tokenizer(None)
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert make_byte_tokenizer().decode(ids) == text


def test_byte_tokenizer_specials_and_unknown_ids() -> None:
    tok = load_tokenizer(None)
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids, tok.vocab_size) == (256, 257, (257,), 258)
    assert tok.note and "byte-level" in tok.note
    assert tok.decode([104, 256, 105, 257]) == "hi"
    assert tok.decode([104, 256], skip_special_tokens=False) == "h<|bos|>"
    assert tok.decode([104, 258, 100000, -1, 105]) == "h" + UNKNOWN_PLACEHOLDER * 3 + "i"
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a cut multi-byte character does not raise
    with pytest.raises(TypeError, match="takes a str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_load_tokenizer_from_directory(tmp_path) -> None:
    out = write_checkpoint(get_preset("tiny-llama"), tmp_path, seed=0)
    tok = load_tokenizer(out)
    assert tok.note is None
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)
    assert tok.decode(tok.encode("héllo")) == "héllo"
    (out / "tokenizer.json").unlink()
    fallback = load_tokenizer(out)
    assert "has no tokenizer.json" in fallback.note and fallback.vocab_size == 258
    (out / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer.json is not a valid"):
        load_tokenizer(out)


def test_load_tokenizer_eos_list_from_generation_config(tmp_path) -> None:
    make_byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [10, 257], "bos_token_id": 256}))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_ids == (10, 257) and tok.eos_token_id == 10 and tok.bos_token_id == 256


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowlat")
    make_checkpoint.add_parser(parser.add_subparsers(dest="command"))
    return parser


def test_cli_make_checkpoint(tmp_path, capsys) -> None:
    out = tmp_path / "ckpt"
    args = _parser().parse_args(["make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", str(out), "--seed", "7",
                                 "--dtype", "float16", "--layers", "1"])
    assert args.func is make_checkpoint.run
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "wrote tiny-qwen3-moe (1 layers, float16, seed 7" in printed
    assert re.search(r", \d+\.\d KB\) to ", printed) and "0.000 GB" not in printed, printed  # a tiny preset's size
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["torch_dtype"] == "float16"
    CheckpointReader(out).check_matches(with_layers(get_preset("tiny-qwen3-moe"), 1))

    again = _parser().parse_args(["make-checkpoint", "--preset", "tiny-llama", "--out", str(out)])
    assert again.func(again) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    bad = _parser().parse_args(["make-checkpoint", "--preset", "nope", "--out", str(tmp_path / "x")])
    assert bad.func(bad) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=["022", "077", "002"])
def test_cli_make_checkpoint_files_follow_the_umask(tmp_path, capsys, umask) -> None:
    """Every file written, the safetensors shards included (safetensors itself writes 0600), gets a new file's
    mode: 0644 under umask 022, as config.json does."""
    import os
    import stat

    out = tmp_path / "ckpt"
    args = _parser().parse_args(["make-checkpoint", "--preset", "tiny-llama", "--out", str(out),
                                 "--max-shard-gb", "0.0001"])  # several shards
    old = os.umask(umask)
    try:
        assert args.func(args) == 0
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert sum(n.endswith(".safetensors") for n in modes) > 1 and "config.json" in modes, modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), {n: oct(m) for n, m in modes.items()}


@pytest.mark.parametrize("nbytes, text", [(512, "512 bytes"), (1500, "1.5 KB"), (428_900, "428.9 KB"),
                                          (999_950, "1.0 MB"), (64_000_000, "64.0 MB"), (2_470_000_000, "2.47 GB")])
def test_make_checkpoint_size_has_the_right_unit(nbytes, text) -> None:
    assert make_checkpoint.human_size(nbytes) == text
