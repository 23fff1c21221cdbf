"""bench/peers/gpt_fast.py: shape mapping, tokenizer file, output parsing, the decode steps' CUDA-event timing
(gpt_fast_output.py, on a fake torch), the table, and (with a gpt-fast checkout in ``GPT_FAST_DIR`` or
.peers/gpt-fast) the checkpoint built with gpt-fast's own Transformer."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "bench" / "peers"
SAMPLE = PEERS / "testdata" / "generate_cpu_eager.txt"  # generate.py at tiny shapes on a CPU: prompt 40, 8 new
CHECKOUT = Path(os.environ.get("GPT_FAST_DIR", ROOT / ".peers" / "gpt-fast"))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, PEERS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gf():
    yield _load("gpt_fast")
    del sys.modules["gpt_fast"]


@pytest.fixture(scope="module")
def out(gf):
    yield sys.modules["gpt_fast_output"]  # loaded by gpt_fast.py, its sibling


@pytest.fixture(scope="module")
def table():
    yield _load("gpt_fast_table")
    del sys.modules["gpt_fast_table"]


def _preset(name: str, **changes):
    from lowlat.loader.presets import get_preset

    return dataclasses.replace(get_preset(name), **changes)


def test_llama_shapes_map_onto_model_args(gf):
    args, diffs = gf.gpt_fast_args(_preset("llama-3.2-1b"))
    assert args == dict(block_size=131072, vocab_size=128256, n_layer=16, n_head=32, n_local_heads=8, dim=2048,
                        intermediate_size=8192, rope_base=500000.0, norm_eps=1e-5,
                        rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192))
    assert diffs == ["embeddings stored untied (same bytes read per step)"]
    assert gf.config_name("llama-3.2-1b") == "llama-3.2-1b"


def test_qwen3_8b_runs_as_a_llama_style_model_and_says_so(gf):
    args, diffs = gf.gpt_fast_args(_preset("qwen3-8b"))
    assert (args["dim"], args["n_head"], args["n_local_heads"], args["n_layer"], args["intermediate_size"],
            args["vocab_size"], args["rope_base"], "rope_scaling" in args) == (4096, 32, 8, 36, 12288, 151936,
                                                                              1e6, False)
    assert any("q/k RMSNorm" in d for d in diffs)
    assert "llama-3" in gf.config_name("qwen3-8b")  # gpt-fast's get_tokenizer picks tiktoken by that substring


@pytest.mark.parametrize("preset,changes,why", [
    ("qwen3-30b-a3b", {}, "experts"),
    ("tiny-llama", {}, "head_dim"),  # 4 heads x 32 != hidden 64
    ("llama-3.2-1b", {"attention_bias": True}, "bias"),
    ("llama-3.2-1b", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "linear"),
    ("tiny-llama", {"head_dim": 16, "vocab_size": 512}, "synthetic prompt"),
])
def test_shapes_gpt_fast_cannot_express_are_refused(gf, preset, changes, why):
    with pytest.raises(gf.GptFastError, match=why):
        gf.gpt_fast_args(_preset(preset, **changes))


def test_tokenizer_file_has_distinct_ranks_and_every_id_decodes(gf, tmp_path):
    path = tmp_path / "tokenizer.model"
    gf.write_tokenizer(path, 1024)
    lines = path.read_text().splitlines()
    assert len(lines) == 1024 - gf.SPECIAL_TOKENS and [int(x.split()[1]) for x in lines] == list(range(768))
    assert len({x.split()[0] for x in lines}) == len(lines)
    with pytest.raises(gf.GptFastError, match="too small"):
        gf.write_tokenizer(path, 300)
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(path))
    special = {f"<|s{i}|>": len(ranks) + i for i in range(gf.SPECIAL_TOKENS)}  # as TiktokenWrapper adds them
    enc = tiktoken.Encoding(name="t", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens=special)
    assert enc.decode_bytes(list(range(1024)))  # raises KeyError on an id it cannot decode


def test_parser_reads_a_saved_generate_output(gf):
    run = gf.parse_generate_output(SAMPLE.read_text(), prompt_len=40, new_tokens=8)
    assert run.tokens_per_s == [0.07, 2.36] and run.average_tokens_per_s == 1.22 and run.compile_s is None
    assert run.seconds == pytest.approx([8 / 0.07, 8 / 2.36])


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.replace("Prompt Length: 40", "Prompt Length: 41"), "asked for"),
    (lambda t: t.replace("Batch Size: 1", "Batch Size: 2"), "asked for"),
    (lambda t: t.replace("Average tokens/sec", "Mean tokens/sec"), "Average tokens/sec"),
    (lambda t: t.replace("Time for inference", "Time of inference"), "no 'Time for inference"),
    (lambda t: t.replace("Time for inference 2:", "Time for inference 3:"), "out of order"),
    (lambda t: t.replace("2.36 tokens/sec", "0.00 tokens/sec"), "zero tokens/sec"),
    (lambda t: t[:t.index("==========")], "Batch Size"),  # cut off before its summary
])
def test_parser_rejects_broken_output(gf, edit, match):
    with pytest.raises(gf.GptFastError, match=match):
        gf.parse_generate_output(edit(SAMPLE.read_text()), prompt_len=40, new_tokens=8)


def _run(gf, prompt, new, tps):
    return gf.GenerateRun(prompt, new, tps, [new / t for t in tps], sum(tps) / len(tps), 30.0, 1.0)


def test_decode_ms_is_the_long_runs_extra_time_per_extra_token(gf):
    # 10 ms of prefill + 2 ms per token: 32 tokens in 74 ms, 160 in 330 ms
    short, long = _run(gf, 928, 32, [32 / 0.074] * 3), _run(gf, 928, 160, [160 / 0.330, 160 / 0.330, 100.0])
    assert gf.decode_ms(short, long) == pytest.approx(2.0)
    with pytest.raises(gf.GptFastError, match="same prompt"):
        gf.decode_ms(short, _run(gf, 900, 160, [500.0]))
    with pytest.raises(gf.GptFastError, match="more new tokens"):
        gf.decode_ms(long, short)


def test_checkout_missing_is_an_error_naming_the_fix(gf, tmp_path):
    with pytest.raises(gf.GptFastError, match="--checkout"):
        gf.load_gpt_fast_model(tmp_path)


@pytest.mark.skipif(not (CHECKOUT / "model.py").is_file(),
                    reason="no gpt-fast checkout (GPT_FAST_DIR, .peers/gpt-fast)")
def test_checkpoint_is_gpt_fasts_own_state_dict(gf, tmp_path):
    import torch

    cfg = _preset("tiny-llama", head_dim=16, vocab_size=1024)
    ckpt = gf.build_checkpoint(CHECKOUT, "tiny-llama-3-h16", cfg, tmp_path, device="cpu")
    assert (ckpt.parent.name, (ckpt.parent / "tokenizer.model").is_file()) == ("tiny-llama-3-h16", True)
    state = torch.load(ckpt, weights_only=True, mmap=True)
    mod = gf.load_gpt_fast_model(CHECKOUT)
    args, _ = gf.gpt_fast_args(cfg)
    with torch.device("meta"):
        model = mod.Transformer(mod.ModelArgs(**args))
    model.load_state_dict(state, assign=True, strict=True)  # every key, every shape
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert torch.equal(state["norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    w = state["layers.0.attention.wqkv.weight"].float()
    assert w.shape == ((4 + 2 * 2) * 16, 64) and 0.015 < w.std() < 0.025
    assert gf.build_checkpoint(CHECKOUT, "tiny-llama-3-h16", cfg, tmp_path, device="cpu") == ckpt  # reused
    with pytest.raises(gf.GptFastError, match="int8"):
        gf.build_checkpoint(CHECKOUT, "x", cfg, tmp_path / "int8", device="cpu")


def _peer(model="llama-3.2-1b", ms=1.335):
    return {"results": [{"model": model, "decode_ms": ms, "reported_ms": ms * 1.1, "decode_kv_window": [960, 1087],
                         "differences": ["embeddings stored untied"]}], "failed": []}


def _lowlat(model="llama-3.2-1b", rows=(("general", 2.1), ("general-fused", 1.4), ("nvidia_mega", 1.2))):
    return {"rows": [{"model": model, "path": p, "batch": b, "step_ms": ms * 0.98, "tpot_plain_ms": ms * 1.1,
                      "tpot_overlap_ms": ms} for p, ms in rows for b in (1, 8)], "failed": ["amd_mono"]}


def test_table_puts_lowlat_rows_beside_gpt_fast_with_ratios(table):
    text = table.render([_peer()], [_lowlat()])
    rows = [r for r in text.splitlines() if r.startswith("| llama")]
    assert len(rows) == 5  # two gpt-fast rows, then batch 1 only of each path
    general = next(r for r in rows if "| general |" in r)
    assert "| 2.100 | 1.335 | 0.64 | no |" in general
    assert "| 1.400 | 1.335 | 0.95 | yes |" in next(r for r in rows if "general-fused" in r)  # slower, within 10%
    assert "| 1.200 | 1.335 | 1.11 | yes |" in next(r for r in rows if "nvidia_mega" in r)
    assert "amd_mono: failed" in text and "embeddings stored untied" in text
    assert "(decode only, by difference, KV 960-1087)" in rows[0]
    timed = _peer()
    timed["results"][0]["decode_method"] = "gpu-events"
    assert "(decode only, GPU-timed steps, KV 960-1087)" in table.render([timed], [_lowlat()])


def test_table_without_a_peer_figure_says_so_and_rejects_wrong_files(table):
    text = table.render([], [_lowlat()])
    assert "no gpt-fast figure" in text and "| - | - | - |" in text
    with pytest.raises(ValueError, match="measure"):
        table.render([_lowlat()], [])
    with pytest.raises(ValueError, match="e2e_tpot"):
        table.render([_peer()], [_peer()])


def test_table_cli_writes_the_table_and_names_missing_files(table, tmp_path, capsys):
    import json

    peer, low, out = tmp_path / "p.json", tmp_path / "l.json", tmp_path / "t.md"
    peer.write_text(json.dumps(_peer()))
    low.write_text(json.dumps(_lowlat()))
    assert table.main([str(peer), "--lowlat", str(low), "--out", str(out)]) == 0
    assert "| llama-3.2-1b | nvidia_mega |" in out.read_text() and "x gpt-fast" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        table.main([str(tmp_path / "absent.json")])
    assert "absent.json" in capsys.readouterr().err


class _FakeTorch:
    """Enough of torch for gpt_fast_output.install: compile, and CUDA events on a clock the test advances."""

    def __init__(self) -> None:
        self.now, self.compiled = 0.0, []
        fake = self

        class Event:
            def __init__(self, enable_timing: bool) -> None:
                assert enable_timing
                self.t = None

            def record(self) -> None:
                self.t = fake.now

            def elapsed_time(self, other) -> float:  # ms, as torch.cuda.Event.elapsed_time
                return other.t - self.t

        self.cuda = type("cuda", (), {"Event": Event, "is_available": staticmethod(lambda: True),
                                      "synchronize": staticmethod(lambda: None)})

    def compile(self, model=None, **kwargs):
        self.compiled.append((getattr(model, "__name__", None), kwargs))
        return model if model is not None else (lambda f: f)


def test_decode_steps_are_timed_on_the_event_clock(out, capsys):
    torch = _FakeTorch()
    report = out.install(torch, at_exit=False)

    def decode_one_token(step_ms):  # a step that takes step_ms on the "GPU"
        torch.now += step_ms

    def create_block_mask():
        torch.now += 100.0

    step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
    assert torch.compile(create_block_mask) is create_block_mask  # only the decode step is wrapped
    assert step is not decode_one_token and torch.compiled[0] == ("decode_one_token", {"mode": "reduce-overhead",
                                                                                       "fullgraph": True})
    # 3 generate() calls (the first the compile run) of 4 new tokens: 3 decode steps each, 1 ms between steps
    # (gpt-fast's own ops), 50 ms between calls (the next prefill); steps of 2, 3, 4 and 2, 5, 8 ms in the timed runs
    for steps in ((40.0, 9.0, 9.0), (2.0, 3.0, 4.0), (2.0, 5.0, 8.0)):
        for ms in steps:
            step(ms)
            torch.now += 1.0
        torch.now += 50.0
    report()
    intervals = out.step_intervals(capsys.readouterr().out)
    assert intervals == ([41.0, 10.0, 60.0, 3.0, 4.0, 55.0, 3.0, 6.0], [40.0, 9.0, 9.0, 2.0, 3.0, 4.0, 2.0, 5.0, 8.0])
    # prompt 10: steps attend over 11, 12, 13 tokens; the last step of a call counts its own time
    ms, per_run = out.decode_ms_per_token(intervals, runs=3, new_tokens=4, prompt_len=10, kv_window=(11, 13))
    assert per_run == [pytest.approx(11 / 3), pytest.approx(17 / 3)] and ms == pytest.approx(14 / 3)
    assert out.decode_ms_per_token(intervals, runs=3, new_tokens=4, prompt_len=10, kv_window=(12, 12)) == (5.0,
                                                                                                          [4.0, 6.0])
    with pytest.raises(ValueError, match="expected 2 generate"):
        out.decode_ms_per_token(intervals, runs=2, new_tokens=4, prompt_len=10, kv_window=(11, 13))
    with pytest.raises(ValueError, match="KV length"):
        out.decode_ms_per_token(intervals, runs=3, new_tokens=4, prompt_len=10, kv_window=(20, 30))
    with pytest.raises(ValueError, match="compile run"):
        out.decode_ms_per_token(([], [1.0, 1.0, 1.0]), runs=1, new_tokens=4, prompt_len=10, kv_window=(11, 13))


def test_no_timing_without_cuda_or_without_the_step(out, capsys):
    torch = _FakeTorch()
    torch.cuda.is_available = staticmethod(lambda: False)
    report = out.install(torch, at_exit=False)

    def decode_one_token():
        pass
    assert torch.compile(decode_one_token) is decode_one_token  # no CUDA: not wrapped, nothing printed
    decode_one_token()
    report()
    assert out.step_intervals(capsys.readouterr().out) is None


@pytest.mark.parametrize("line,match", [
    ('[gpt-fast-timing] {"next": [1.0], "own": [1.0, 2.0]}\n[gpt-fast-timing] {"next": [], "own": [1.0]}', "2 "),
    ("[gpt-fast-timing] not json", "unreadable"),
    ('[gpt-fast-timing] {"next": [1.0]}', "unreadable"),
    ('[gpt-fast-timing] {"next": [-1.0], "own": [1.0, 2.0]}', "non-negative"),
    ('[gpt-fast-timing] {"next": [1.0, 1.0], "own": [1.0, 2.0]}', "one fewer"),
    ('[gpt-fast-timing] {"next": [true], "own": [1.0, 2.0]}', "non-negative"),  # JSON true: no milliseconds
    ('[gpt-fast-timing] {"next": [1.0], "own": [1.0, Infinity]}', "non-negative"),  # json.loads reads it as inf
    ('[gpt-fast-timing] {"next": [NaN], "own": [1.0, 2.0]}', "non-negative"),
])
def test_timing_line_is_checked(out, line, match):
    with pytest.raises(ValueError, match=match):
        out.step_intervals("generate.py output\n" + line + "\n")
