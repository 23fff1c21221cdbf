"""The plugin in the runtime: order at start, dispatch, fallback, faults (issue 4's behaviour)."""

from __future__ import annotations

import re

import pytest
import torch
from lowlat import Engine, EngineConfig, ForwardMode, SamplingParams
from lowlat.plugin import PluginBuildError, PluginStepError, UnsupportedConfiguration
from lowlat.plugin.binding import KVPoolNotReady
from plugin_dists import activate, make_plugin_dist
from plugin_fakes import mirror_source

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


@pytest.fixture
def install(tmp_path, monkeypatch):
    site = tmp_path / "site"
    activate(site, monkeypatch)

    def _install(name: str, fault: str = "") -> str:
        make_plugin_dist(site, name, mirror_source(fault))
        monkeypatch.setenv("LOWLAT_PLUGINS", name)
        return name

    return _install


def engine(plugin: str, **kw) -> Engine:
    return Engine(EngineConfig(model=kw.pop("model", "tiny-llama"), device="cpu", dtype="float32", plugin=plugin,
                               max_batch_size=4, max_context_len=64, **kw))


def greedy(e: Engine, n: int = 6) -> list[list[int]]:
    return [c.token_ids for c in e.generate(PROMPTS, SamplingParams(max_new_tokens=n))]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe"])
def test_plugin_serves_decode_and_general_serves_prefill(install, model):
    install("mirror")
    with engine("none", model=model) as e:
        want = greedy(e)
    with engine("mirror", model=model) as e:
        assert greedy(e) == want
        paths = e.stats.paths_as_dict()
        assert set(paths["general"]) == {"PREFILL"} and set(paths["plugin"]) == {"DECODE"}
        steps = e.runner.plugin_host.dispatcher.stats.steps
        assert steps[("plugin", ForwardMode.DECODE)] == paths["plugin"]["DECODE"]["steps"] > 0


def test_auto_selects_and_says_why(install):
    install("mirror")
    with engine("auto") as e:
        sel = e.runner.plugin_host.selection
        assert sel is not None and sel.plugin.name == "mirror" and sel.reason.startswith("auto")


def test_verify_runs_on_plugin_and_matches(install):
    install("mirror")
    outs = []
    for plugin in ("none", "mirror"):
        with engine(plugin) as e:
            rid = e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=8))
            e.step()  # prefill
            res = e.verify({rid: [1, 2, 3]})
            outs.append(res.accepted)
            if plugin == "mirror":
                assert e.runner.last_path == "plugin"
    assert outs[0] == outs[1]


def test_alternating_paths_equal_all_general(install):
    install("mirror")
    with engine("none") as e:
        want = greedy(e, 8)
    with engine("mirror") as e:
        d = e.runner.plugin_host.dispatcher
        flips = iter(range(1000))
        d.force_path = lambda b: "plugin" if next(flips) % 2 else "general"
        assert greedy(e, 8) == want
        assert {p for p, _ in e.stats.by_path} == {"plugin", "general"}


def test_explicit_plugin_on_unsupported_dtype_is_refused_before_weights_load(install, monkeypatch):
    install("mirror")
    import lowlat.runtime.model_runner as mr

    def boom(self):
        raise AssertionError("weights must not load")

    monkeypatch.setattr(mr.ModelRunner, "load_model", boom)
    with pytest.raises(UnsupportedConfiguration, match="dtype: needs dtype bfloat16/float32; the engine runs float16"):
        Engine(EngineConfig(model="tiny-llama", device="cpu", dtype="float16", plugin="mirror"))


def test_explicit_plugin_on_unsupported_tp_is_refused(install):
    install("mirror")
    with pytest.raises(UnsupportedConfiguration, match="tp_size"):
        Engine(EngineConfig(model="tiny-llama", device="cpu", dtype="float32", plugin="mirror", tp_size=4))


@pytest.mark.parametrize(("fault", "error", "message"), [
    ("build_raises", PluginBuildError, "plugin 'bad' failed to build for LlamaForCausalLM: ValueError: unsupported"),
    ("build_too_big", PluginBuildError, "plugin 'bad' asked for workspace 'scratch'"),
    ("reads_kv_early", KVPoolNotReady, "before the KV pool exists"),
])
def test_build_faults_are_clear_errors(install, fault, error, message):
    install("bad", fault)
    with pytest.raises(error, match=message):
        engine("bad")


@pytest.mark.parametrize(("fault", "message"), [
    ("raises", "plugin 'bad' failed during a DECODE step of 2 tokens over 2 requests: RuntimeError: kernel exploded"),
    ("wrong_shape", r"plugin 'bad' returned \(2, 511\) torch.float32.*float32 logits of shape \(2, 512\)"),
    ("wrong_dtype", r"returned \(2, 512\) torch.bfloat16"),
    ("nan", "non-finite logits"),
])
def test_step_faults_stop_the_engine_with_the_plugin_named(install, fault, message):
    install("bad", fault)
    with engine("bad") as e:
        with pytest.raises(PluginStepError, match=message):
            greedy(e)
        assert not e.has_unfinished()  # nothing keeps serving garbage


def test_tp_ranks_agree_when_one_rank_refuses(install, monkeypatch, tmp_path):
    install("mirror", "refuse_on_rank1")
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    with engine("none") as e:
        want = greedy(e, 4)
    with engine("mirror", tp_size=2) as e:
        assert greedy(e, 4) == want
        assert set(e.stats.paths_as_dict()) == {"general"}  # rank 0 could, rank 1 refused: none did


@pytest.mark.parametrize("interpreted", [False, True])
def test_compare_reports_identical_tokens_and_speed(install, capsys, monkeypatch, interpreted):
    install("mirror")
    import lowlat.cli.compare as compare_mod
    from lowlat.cli import main

    monkeypatch.setattr(compare_mod, "triton_interpreter_enabled", lambda: interpreted)
    rc = main(["run", "--compare", "--plugin", "mirror", "--device", "cpu", "--dtype", "float32",
               "--max-new-tokens", "5", "--prompt", "abc", "--max-context-len", "64"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0, out
    assert "tokens identical: yes" in out and "decode ms/step: general" in out and "plugin mirror" in out
    # how many tokens were compared and the tolerance the comparison uses (tokens: none; near-tie: float32's)
    assert "(5 tokens compared over 1 request; general made 5, plugin mirror 5; greedy, so tokens are compared " \
           "exactly: a request's first differing token is accepted only at a near-tie, below)" in out, out
    assert out.endswith("verdict: tokens identical (exit 0)"), out
    assert re.search(r"over matching steps: [0-9.e+-]+ \(5 logits rows compared; reported, not judged\)", out), out
    assert "near-tie tolerance at a differing token: the general path's logit of its token exceeds that of the " \
           "plugin's by <= 9.92e-05 x max(1, max |logit|) (float32: docs/contract.md's per-element bound)" in out, out
    # under the Triton interpreter the times are Python's, not the kernels': the line says so instead of a ratio
    assert bool(re.search(r"\(\d+\.\d\dx\)", out)) is not interpreted, out
    assert ("no speed ratio: under TRITON_INTERPRET=1" in out) is interpreted, out


def test_compare_shows_the_near_tie_at_a_divergence(install):
    install("noisy", "noisy")
    from lowlat.cli.compare import compare

    cfg = EngineConfig(model="tiny-llama", device="cpu", dtype="float32", plugin="noisy", max_context_len=64)
    report = compare(cfg, SamplingParams(max_new_tokens=12), ["abc"])
    assert not report.identical and report.first_divergence[0] is not None
    text = "\n".join(report.lines())
    assert "first differing token" in text and "top-2 gap" in text
    d = report.first_divergence[0]
    assert report.tokens_compared == d + 1 and f"({d + 1} tokens compared over 1 request;" in text
    assert report.logit_rows == d + 1  # the step that made the first differing token is compared too
    # the noisy plugin moves logits far beyond float32's near-tie bound (9.92e-5 x scale): the verdict says so
    assert "NOT a near-tie: general logit[" in text and "> 9.92e-05 x scale" in text
    assert report.exit_status() == 1 and report.verdict().startswith("verdict: DIVERGED: tokens differ in 1 of 1")


def _report(gap, *, dtype=torch.float32, plugin_tokens=(1, 5)):
    """A --compare report whose request differs at its 2nd token: the general path picks 3 (logit 10), the plugin
    5, whose general logit is 10 - ``gap`` (scale 10: float32's bound is 9.92e-4, bfloat16's 0.508)."""
    from lowlat.cli.compare import CompareReport, RunRecord

    lg = torch.zeros(8)
    lg[3], lg[5] = 10.0, 10.0 - gap
    lp = lg.clone()
    lp[5] = 10.5
    general = RunRecord("general", None, [[1, 3]], {0: [torch.zeros(8), lg]}, 1.0, [1.0], {}, dtype)
    plugin = RunRecord("plugin p", "p", [list(plugin_tokens)], {0: [torch.zeros(8), lp][:len(plugin_tokens)]}, 1.0,
                       [1.0], {}, dtype)
    div = None if plugin_tokens == (1, 3) else 1
    return CompareReport(general, plugin, div is None, [div], 0.5, logit_rows=2)


def test_tokens_compared_counts_positions_both_sides_have():
    """A request whose plugin side ended after 1 token with the same token (divergence at 1 = the shorter length):
    1 position compared, not 2."""
    ended = _report(0.0, plugin_tokens=(1,))
    assert ended.first_divergence == [1] and ended.tokens_compared == 1
    assert _report(0.1).tokens_compared == 2  # a differing 2nd token: both positions compared


@pytest.mark.parametrize("report,strict,rc,verdict", [
    (_report(0.0, plugin_tokens=(1, 3)), False, 0, "verdict: tokens identical (exit 0)"),
    (_report(0.0, plugin_tokens=(1, 3)), True, 0, "verdict: tokens identical (exit 0)"),
    (_report(5e-4), False, 0, "verdict: tokens differ in 1 of 1 request, each first at a near-tie within the "
                              "documented bound (docs/contract.md): accepted (exit 0; --compare-strict exits 1"),
    (_report(0.1875, dtype=torch.bfloat16), False, 0, "each first at a near-tie within the documented bound"),
    (_report(5e-4), True, 1, "each first at a near-tie within the documented bound (docs/contract.md): exit 1 "
                             "(--compare-strict: no difference accepted)"),
    (_report(0.1), False, 1, "verdict: DIVERGED: tokens differ in 1 of 1 request; the first difference of request 0 "
                             "is not a near-tie within the documented bound (exit 1)"),
    (_report(0.6, dtype=torch.bfloat16), False, 1, "verdict: DIVERGED"),
    (_report(0.0, plugin_tokens=(1,)), False, 1, "verdict: DIVERGED"),  # the plugin's side ended: nothing to judge
])
def test_compare_exit_status_accepts_near_ties_unless_strict(report, strict, rc, verdict, monkeypatch, capsys):
    """--compare exits 0 on identical tokens and on a first difference at a near-tie within the contract's bound
    (docs/contract.md), 1 on any other; --compare-strict exits 1 on any difference. The last line says which."""
    import lowlat.cli.compare as compare_mod
    from lowlat.cli import main

    monkeypatch.setattr(compare_mod, "compare", lambda *a, **k: report)
    args = ["run", "--compare-strict" if strict else "--compare", "--plugin", "p", "--device", "cpu"]
    assert main(args) == rc
    lines = capsys.readouterr().out.strip().splitlines()
    assert verdict in lines[-1], lines[-1]
    text = "\n".join(lines)
    if report.first_divergence[0] is not None:  # the divergence's own line says which it was
        assert ("    a near-tie: general logit[3] - logit[5] = " in text) is report.near_ties_only, text
        assert ("    NOT a near-tie: general logit[3]" in text or "    nothing to judge a near-tie by" in text) \
            is not report.near_ties_only, text


def test_auto_skips_a_plugin_whose_build_fails_and_says_why(install):
    install("bad", "build_raises")
    with engine("none") as e:
        want = greedy(e)
    with engine("auto") as e:
        host = e.runner.plugin_host
        assert host.selection is None and host.dispatcher is None
        assert any("bad: its guard passed but build failed" in r and "unsupported head_dim" in r
                   for r in host.rejections)
        assert greedy(e) == want and set(e.stats.paths_as_dict()) == {"general"}
