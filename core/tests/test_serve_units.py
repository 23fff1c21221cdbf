"""The serve pieces without HTTP: incremental detokenization and stop strings, chat templates (against
transformers' own rendering), HF cache resolution, request validation."""

from __future__ import annotations

import json

import pytest
from lowlat.config import ConfigError
from lowlat.loader import load_tokenizer
from lowlat.serve.chat_template import DEFAULT_TEMPLATE, ChatTemplate, ChatTemplateError, find_template
from lowlat.serve.detokenizer import IncrementalDetokenizer
from lowlat.serve.hf_cache import looks_like_repo_id, resolve_model_path

TOK = load_tokenizer(None)  # byte-level: a multi-byte character spans several tokens


def _stream(ids, stop=(), step=1):
    d = IncrementalDetokenizer(TOK, stop)
    out = [d.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    out.append(d.finish())
    return out, d


def test_multibyte_characters_are_never_split():
    text = "naïve 日本語 🙂 done"
    pieces, d = _stream(TOK.encode(text))
    assert "".join(pieces) == text and d.text == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_split_over_tokens_is_held_back_and_cut():
    text = "alpha beta STOP gamma"
    pieces, d = _stream(TOK.encode(text), stop=["STOP", "zzz"])
    assert "".join(pieces) == "alpha beta " and d.stopped
    assert not any("S" in p for p in pieces)


def test_chat_template_matches_transformers(tmp_path):
    from lowlat.loader import make_byte_tokenizer
    from transformers import PreTrainedTokenizerFast

    tmpl = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
            "{% endif %}\n  <{{ m['role'] }}>{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
    hf = PreTrainedTokenizerFast(tokenizer_object=make_byte_tokenizer(), bos_token="<|bos|>", eos_token="<|eos|>")
    hf.chat_template = tmpl
    msgs = [{"role": "system", "content": " sys "}, {"role": "user", "content": "héllo"}]
    ours = ChatTemplate(tmpl, "test", {"bos_token": "<|bos|>", "eos_token": "<|eos|>"})
    for gen in (True, False):
        assert ours.render(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen)
    with pytest.raises(ChatTemplateError, match="no tools"):
        ours.render([{"role": "tool", "content": "x"}])


def test_template_sources_in_order(tmp_path):
    assert find_template(None)[0] == DEFAULT_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
         "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    assert find_template(str(tmp_path))[0] == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ bos_token }}")
    t = ChatTemplate.load(str(tmp_path))
    assert t.source == "J{{ bos_token }}" and t.render([]) == "J<s>"
    over = tmp_path / "over.jinja"
    over.write_text("O")
    assert ChatTemplate.load(str(tmp_path), str(over)).render([]) == "O"
    with pytest.raises(ChatTemplateError, match="cannot read"):
        ChatTemplate.load(None, str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}", "bad", {})


def _fake_cache(root, repo="org/tiny", commit="a" * 40):
    d = root / f"models--{repo.replace('/', '--')}"
    (d / "refs").mkdir(parents=True)
    (d / "refs" / "main").write_text(commit)
    snap = d / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    return snap


def test_hf_repo_id_resolves_from_the_local_cache(tmp_path):
    snap = _fake_cache(tmp_path)
    assert resolve_model_path("org/tiny", cache_dir=str(tmp_path)) == str(snap)
    assert resolve_model_path("tiny-llama", cache_dir=str(tmp_path)) == "tiny-llama"
    assert resolve_model_path(str(tmp_path), cache_dir=str(tmp_path)) == str(tmp_path)
    with pytest.raises(ConfigError, match="not .* in the local HF cache|hf download org/absent"):
        resolve_model_path("org/absent", cache_dir=str(tmp_path))
    assert looks_like_repo_id("meta-llama/Llama-3.2-1B@main") and not looks_like_repo_id("./a/b")


def test_schema_rejections_name_the_field():
    from lowlat.serve.schemas import ChatCompletionRequest, CompletionRequest
    from pydantic import ValidationError

    assert CompletionRequest(model="m", prompt=[[1, 2]]).prompt == [1, 2]
    for kw, param in (({"prompt": "x", "presence_penalty": 1}, "presence_penalty"),
                      ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "", "n": 1}, "prompt")):
        with pytest.raises(ValidationError) as e:
            CompletionRequest(model="m", **kw)
        assert e.value.errors()[0]["ctx"]["error"].param == param
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}])


def test_unknown_ids_do_not_hold_the_text_back_for_ever():
    ids = [300] * 10 + list(b"ok")  # ids past the tokenizer's vocabulary decode to U+FFFD
    d = IncrementalDetokenizer(TOK)
    pieces = [d.add([i]) for i in ids]
    assert "".join(pieces) + d.finish() == TOK.decode(ids)
    assert sum(1 for p in pieces[:10] if p) >= 2  # emitted while it ran, not all at the end
    assert d._read - d._prefix <= 4


def test_serve_flags_and_their_errors(capsys, monkeypatch):
    import argparse

    from lowlat.cli import serve as serve_cli

    parser = argparse.ArgumentParser(prog="lowlat")
    serve_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve"])
    assert (args.host, args.port, args.model, args.plugin) == ("127.0.0.1", 8000, "tiny-llama", "auto")
    assert args.max_queued_requests == 256 and args.func is serve_cli.serve
    monkeypatch.delenv("LOWLAT_DEBUG", raising=False)
    for argv, msg in ((["--port", "70000"], "--port"), (["--max-queued-requests", "0"], "--max-queued-requests"),
                      (["--request-timeout", "0"], "--request-timeout"),
                      (["--model", "org/none", "--port", "0"], "local HF cache")):
        assert serve_cli.serve(parser.parse_args(["serve", "--device", "cpu", *argv])) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1
