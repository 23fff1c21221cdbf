"""bench/scripts/spec_identity.py's divergence classifier on CPU: a forced real difference is a bug, a forced
near-tie is not, on synthetic rows and through two real engines (tiny-llama, float32, n-gram drafts)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from lowlat import Engine, EngineConfig, SamplingParams
from lowlat.runtime import ForwardMode

ROOT = Path(__file__).resolve().parents[2]
KW = dict(model="tiny-llama", device="cpu", dtype="float32", max_context_len=96, max_batch_size=4, page_size=4)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [9, 8, 7], [5, 5, 5, 5, 5, 5], [100, 200, 300, 100, 200, 7, 8, 9, 10]]
AT = 9  # the output index of request 0 where the broken cases act


@pytest.fixture(scope="module")
def si():
    spec = importlib.util.spec_from_file_location("spec_identity", ROOT / "bench" / "scripts" / "spec_identity.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["spec_identity"] = mod
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["spec_identity"]


def _row(best: int, second: int, gap: float, vocab: int = 16) -> torch.Tensor:
    row = torch.linspace(-1.0, 0.0, vocab)
    row[best], row[second] = 3.0, 3.0 - gap
    return row


def test_synthetic_rows_near_tie_and_bug(si):
    bound = 5.08e-2 * 3.0  # bfloat16 per-element bound at scale max |row| = 3
    tie = si.classify([[1, 4, 2]], [{1: _row(4, 7, 0.3 * bound)}], [[1, 7, 2]], [{1: _row(7, 4, 0.2 * bound)}],
                      "bfloat16")
    assert len(tie) == 1 and tie[0].index == 1 and tie[0].near_tie and "near-tie" in tie[0].line()
    # the speculative row is far from a tie: its pick beats the plain pick by 3 bounds
    bug = si.classify([[1, 4]], [{1: _row(4, 7, 0.3 * bound)}], [[1, 7]], [{1: _row(7, 4, 3 * bound)}], "bfloat16")
    assert not bug[0].near_tie and "BUG" in bug[0].line() and bug[0].gap_spec > bug[0].bound_spec
    # the plain side far from a tie is a bug as well, whatever the speculative row says
    assert not si.classify([[4]], [{0: _row(4, 7, 2 * bound)}], [[7]], [{0: _row(7, 4, 0.0)}], "bfloat16")[0].near_tie
    # a row whose argmax is not the token it supposedly picked cannot be classified: counted as a bug
    odd = si.classify([[4]], [{0: _row(4, 7, 0.1)}], [[7]], [{0: _row(4, 7, 0.1)}], "bfloat16")[0]
    assert odd.problem and not odd.near_tie
    assert si.classify([[1, 2]], [{}], [[1, 2]], [{}], "bfloat16") == []  # identical: nothing to classify


def _nudge(si, target, sign):
    """An edit that, at request ``target``'s output index AT, moves its second-best logit to best + sign * delta
    (delta a quarter of the float32 bound when sign is +-1; 1.0 when sign is 'far')."""
    from lowlat_contract.cases import Tolerance

    tol = Tolerance.for_dtype("float32")

    def edit(step, logits):
        for row, r, idx in si.row_targets(step):
            if r.prompt_ids == target and idx == AT:
                top = torch.topk(logits[row], 2).indices
                delta = 1.0 if sign == "far" else sign * tol.atol(logits[row]) / 4
                with torch.inference_mode():  # the engine's logits are inference tensors
                    logits[row, top[1]] = logits[row, top[0]] + delta

    return edit


@pytest.fixture(scope="module")
def plain_run(si):
    with Engine(EngineConfig(plugin="none", **KW)) as e:
        return si.generate_recorded(e, PROMPTS, SamplingParams(max_new_tokens=20, stop_at_eos=False))


def _spec(si, edit=None):
    cfg = EngineConfig(plugin="none", speculative_method="ngram", speculative_adaptive=False, **KW)
    with Engine(cfg) as e:
        got = si.generate_recorded(e, PROMPTS, SamplingParams(max_new_tokens=20, stop_at_eos=False), edit)
        assert e.speculator.stats.verify_steps > 0
        return got


def test_engines_unbroken_are_identical_and_rows_recorded(si, plain_run):
    spec = _spec(si)
    assert spec[0] == plain_run[0] and si.classify(*plain_run, *spec, "float32") == []
    for toks, rows in ((plain_run[0], plain_run[1]), spec):
        for t, r in zip(toks, rows):  # every token has the row that picked it, and that row's argmax is the token
            assert sorted(r) == list(range(len(t))) and [int(r[j].argmax()) for j in range(len(t))] == t


def test_engine_forced_real_difference_is_a_bug(si, plain_run):
    spec = _spec(si, _nudge(si, PROMPTS[0], "far"))  # speculative run: the second-best token wins by 1.0
    divs = si.classify(*plain_run, *spec, "float32")
    assert [(v.request, v.index) for v in divs] == [(0, AT)]
    assert not divs[0].near_tie and divs[0].gap_spec == pytest.approx(1.0, abs=1e-5)


def test_engine_forced_near_tie_is_not_a_bug(si):
    # both runs see request 0's two best tokens within a quarter bound of each other, ordered differently
    with Engine(EngineConfig(plugin="none", **KW)) as e:
        plain = si.generate_recorded(e, PROMPTS, SamplingParams(max_new_tokens=20, stop_at_eos=False),
                                     _nudge(si, PROMPTS[0], -1))
    spec = _spec(si, _nudge(si, PROMPTS[0], +1))
    divs = si.classify(*plain, *spec, "float32")
    assert [(v.request, v.index) for v in divs] == [(0, AT)]
    assert divs[0].near_tie and 0 < divs[0].gap_plain <= divs[0].bound_plain


def test_recording_refuses_the_overlapped_loop(si):
    with Engine(EngineConfig(plugin="none", overlap=True, **KW)) as e, pytest.raises(ValueError, match="overlap"):
        si.generate_recorded(e, PROMPTS[:1], SamplingParams(max_new_tokens=2))


def test_script_main_on_cpu_exits_0(si, capsys):
    rc = si.main(["--model", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--paths", "none",
                  "--drafters", "ngram", "--max-new-tokens", "12", "--k", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("identical") == 2 and "0 bugs" in out


@pytest.mark.gpu  # python bench/gpu_jobs.py gpu-tests
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the Triton attention need a CUDA device")
@pytest.mark.parametrize("method", ["ngram", "draft:tiny-llama"])
def test_cuda_float32_batch4_diverges_at_near_ties_only(si, method):
    """What CPU runs cannot reach: CUDA graphs of VERIFY at (4, k+1) and of smaller padded batches as requests
    leave, the Triton VERIFY attention, rollback over 4-token pages. In float32 speculative greedy output must equal
    plain decoding's up to float32 near-ties (GEMM shapes differ), and every page must come back."""
    kw = {**KW, "device": "cuda"}
    params = [SamplingParams(max_new_tokens=n, stop_at_eos=False) for n in (40, 23, 57, 31)]
    with Engine(EngineConfig(plugin="none", overlap=False, **kw)) as e:
        plain = si.generate_recorded(e, PROMPTS, params)
    cfg = EngineConfig(plugin="none", speculative_method=method, speculative_adaptive=False, **kw)
    with Engine(cfg) as e:
        free = e.runner.kv_pool.free_pages
        spec = si.generate_recorded(e, PROMPTS, params)
        assert e.runner.kv_pool.free_pages == free and e.stats.by_path[("general", ForwardMode.VERIFY)].graph_steps
    bugs = [v.line() for v in si.classify(*plain, *spec, "float32") if not v.near_tie]
    assert not bugs, bugs
