"""``lowlat run --compare``'s MoE router near-tie excuse (cli/compare_router.py): the general path's router ties
recorded with hooks in an eager run, and the verdict that accepts one divergence per run after such a tie."""

from __future__ import annotations

import pytest
import torch
from lowlat import Engine, EngineConfig, SamplingParams
from plugin_dists import activate, make_plugin_dist
from plugin_fakes import mirror_source

MOE = dict(model="tiny-qwen3-moe", device="cpu", dtype="bfloat16", max_batch_size=4, max_context_len=64)


@pytest.fixture
def noisy(tmp_path, monkeypatch):
    """The noisy mirror plugin installed (its logits drift: greedy tokens diverge far from any logit near-tie)."""
    site = tmp_path / "site"
    activate(site, monkeypatch)
    make_plugin_dist(site, "noisy", mirror_source("noisy"))
    monkeypatch.setenv("LOWLAT_PLUGINS", "noisy")
    return "noisy"


def test_recorder_attributes_each_tie_to_its_request_and_token():
    """Every router row tied (all gate rows equal: gap 0 ulps): each DECODE step's rows give a tie for each request
    at the token that step produced (1, 2, ...), in every MoE layer; the prefill's rows are not recorded."""
    from lowlat.cli.compare_router import moe_blocks, record_router_ties

    with Engine(EngineConfig(plugin="none", cuda_graph=False, overlap=False, **MOE)) as e:
        blocks = moe_blocks(e.runner.model)
        assert blocks
        with torch.no_grad():
            for b in blocks:
                b.gate.weight.copy_(b.gate.weight[:1].expand_as(b.gate.weight))
        got = record_router_ties(e, [[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=4, stop_at_eos=False))
        assert e.logits_observer is None and all(not b.gate._forward_hooks for b in blocks)  # hooks removed
    assert [len(t) for t in got.token_ids] == [4, 4]
    for i in (0, 1):
        ties = got.ties[i]
        assert sorted({t.token for t in ties}) == [1, 2, 3]  # 3 DECODE steps after the prefill's token 0
        assert sorted({t.layer for t in ties}) == list(range(len(blocks))) and all(t.gap_ulps == 0 for t in ties)
    assert got.before(0, 2).token == 1 and got.before(0, 0) is None


def test_ties_go_to_the_request_whose_row_tied(monkeypatch):
    """Only the first row of each forward ties: in a DECODE step of two requests that is request 0's, so request
    1 has none, and each of request 0's DECODE steps counts once per MoE layer (the prefill's ties are dropped)."""
    import lowlat.cli.compare_router as cr
    from lowlat.cli.compare_router import RouterTie, RouterTies, moe_blocks, record_router_ties

    monkeypatch.setattr(cr, "router_near_tie_rows", lambda logits, top_k: [0])
    with Engine(EngineConfig(plugin="none", cuda_graph=False, overlap=False, **MOE)) as e:
        layers = len(moe_blocks(e.runner.model))
        got = record_router_ties(e, [[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=3, stop_at_eos=False))
    assert set(got.ties) == {0} and [t.token for t in got.ties[0]] == [1] * layers + [2] * layers
    assert RouterTies({0: [RouterTie(0, 0, 0.0)]}, [[1, 2]]).before(0, 1) is None  # token 0: the prefill's


def test_ties_keep_their_prompt_index_when_a_request_ends_at_its_prefill(monkeypatch):
    """Request 0's first token is its EOS, so it never takes a DECODE step: request 1's ties are still request 1's
    (they were filed under index 0, the order of first DECODE appearance, so its divergence lost its excuse and
    a third request's ties would have excused request 1's)."""
    import lowlat.cli.compare_router as cr
    from lowlat.cli.compare_router import record_router_ties

    prompts, params = [[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=4, stop_at_eos=False)
    with Engine(EngineConfig(plugin="none", cuda_graph=False, overlap=False, **MOE)) as e:
        first = e.generate(prompts, params)[0].token_ids[0]
        e.eos_ids = frozenset({first})  # request 0 stops at the token its prefill made
        monkeypatch.setattr(cr, "router_near_tie_rows", lambda logits, top_k: [0])  # the first row of a forward
        got = record_router_ties(e, prompts, SamplingParams(max_new_tokens=4, stop_at_eos=True))
    assert len(got.token_ids[0]) == 1 and len(got.token_ids[1]) == 4 and first not in got.token_ids[1]
    assert set(got.ties) == {1} and {t.token for t in got.ties[1]} == {1, 2, 3}
    assert got.before(0, 3) is None and got.before(1, 3).token == 1


def test_a_verify_rows_tie_goes_to_the_token_that_row_made(monkeypatch):
    """A VERIFY step's rows make tokens first, first + 1, ...: a tie in its last row (of 3) is a tie at that row's
    token, not the step's first (which no later row can move: attention is causal), and a row past the step's last
    kept token (cut here by max_new_tokens) made no token, so it counts for none. The draft model is the target's
    own preset, so every draft is kept."""
    import lowlat.cli.compare_router as cr
    from lowlat.cli.compare_router import record_router_ties

    monkeypatch.setattr(cr, "router_near_tie_rows", lambda logits, top_k: [logits.shape[0] - 1])  # the last row
    cfg = EngineConfig(plugin="none", cuda_graph=False, overlap=False, speculative_method="draft:tiny-qwen3-moe",
                       num_draft_tokens=2, speculative_adaptive=False, **MOE)
    with Engine(cfg) as e:
        got = record_router_ties(e, [[5, 6, 7]], SamplingParams(max_new_tokens=9, stop_at_eos=False))
        assert e.speculator.stats.accept_hist == [0, 0, 3] and e.step_observer is None
    # VERIFY steps made tokens 1-3, 4-6 and 7-8 (its row for token 9 was cut)
    assert sorted({t.token for t in got.ties[0]}) == [3, 6]
    assert got.before(0, 2) is None and got.before(0, 3).token == 3


def test_router_run_is_eager_on_the_general_path(monkeypatch):
    import lowlat.cli.compare_router as cr

    seen = []

    class FakeEngine:
        def __init__(self, cfg):
            seen.append(cfg)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr("lowlat.runtime.engine.Engine", FakeEngine)
    monkeypatch.setattr(cr, "record_router_ties", lambda engine, prompts, params: "recorded")
    assert cr.router_ties(EngineConfig(plugin="noisy", **MOE), None, ["abc"]) == "recorded"
    assert (seen[0].plugin, seen[0].cuda_graph, seen[0].overlap) == ("none", False, False)


def test_dense_models_record_nothing():
    from lowlat.cli.compare_router import moe_blocks

    with Engine(EngineConfig(model="tiny-llama", device="cpu", dtype="bfloat16", plugin="none",
                             max_context_len=64)) as e:
        assert moe_blocks(e.runner.model) == []


def _tie_bound(monkeypatch, ulps: float):
    """Set the near-tie bound the recorder uses: 1e9 ulps makes every router row a tie, -1 none (the tiny bf16
    model has a real 3.5-ulp tie at its first DECODE step: the default rule excuses its divergence)."""
    import lowlat.cli.compare_router as cr
    from lowlat.plugin.tolerance import router_near_tie_rows

    monkeypatch.setattr(cr, "router_near_tie_rows", lambda logits, top_k: router_near_tie_rows(logits, top_k, ulps))


def test_compare_accepts_one_divergence_after_a_router_near_tie(noisy, monkeypatch):
    from lowlat.cli.compare import compare

    cfg = EngineConfig(plugin=noisy, **MOE)
    params = SamplingParams(max_new_tokens=6, stop_at_eos=False)
    _tie_bound(monkeypatch, -1)
    report = compare(cfg, params, ["abc"])  # no router near-tie before the divergence
    assert not report.identical and report.needs_router and report.router is not None
    assert report.exit_status() == 1 and "no router excuse: no MoE router of the general path had a near-tie" \
        in "\n".join(report.lines())
    _tie_bound(monkeypatch, 1e9)
    report = compare(cfg, params, ["abc"])
    text = "\n".join(report.lines())
    assert report.router_excuse(0) is not None and report.exit_status() == 0, text
    assert "after a router near-tie: the general path's MoE layer 0 had a top-k boundary gap of" in text
    assert "accepted as the run's one router excuse" in text
    assert report.verdict().startswith("verdict: tokens differ in 1 of 1 request, each first at a near-tie within "
                                       "the documented bound, or (request 0) after a router near-tie")
    assert report.exit_status(strict=True) == 1
    two = compare(cfg, params, ["abc", "xyz"])  # both diverge: only one router excuse per run
    assert [two.router_excuse(i) is not None for i in (0, 1)] == [True, False] and two.exit_status() == 1
    assert "another request already took the run's one router excuse" in "\n".join(two.lines())
    assert "the first difference of request 1 is not a near-tie" in two.verdict(), two.verdict()


def test_no_router_run_for_float32_or_a_dense_model(noisy, monkeypatch):
    import lowlat.cli.compare as compare_mod

    calls = []
    monkeypatch.setattr(compare_mod, "router_ties", lambda *a: calls.append(a))
    report = compare_mod.compare(EngineConfig(plugin=noisy, **{**MOE, "dtype": "float32"}),
                                 SamplingParams(max_new_tokens=6, stop_at_eos=False), ["abc"])
    assert not report.identical and not report.needs_router and report.router is None and calls == []
    assert report.exit_status() == 1
    dense = compare_mod.compare(EngineConfig(plugin=noisy, **{**MOE, "model": "tiny-llama"}),
                                SamplingParams(max_new_tokens=6, stop_at_eos=False), ["abc"])
    assert not dense.identical and not dense.needs_router and calls == []  # bf16, but no MoE layer


def test_a_run_that_did_not_retrace_the_general_tokens_is_no_excuse(noisy, monkeypatch):
    import lowlat.cli.compare as compare_mod
    from lowlat.cli.compare_router import RouterTie, RouterTies

    def other_tokens(config, params, prompts):
        return RouterTies({0: [RouterTie(1, 0, 0.0)]}, [[-1] * 6 for _ in prompts])
    monkeypatch.setattr(compare_mod, "router_ties", other_tokens)
    report = compare_mod.compare(EngineConfig(plugin=noisy, **MOE), SamplingParams(max_new_tokens=6,
                                                                                     stop_at_eos=False), ["abc"])
    assert report.router_excuse(0) is None and report.exit_status() == 1
    assert "did not retrace the general run's tokens" in "\n".join(report.lines())


def _diverged(tokens_g, tokens_p, router_ties, retraced=None):
    """A bf16 MoE --compare report: request i's general tokens ``tokens_g[i]``, the plugin's ``tokens_p[i]``; at each
    differing position the general logits are 10 for its token and 8 for the plugin's (no near-tie); the eager
    run's ties ``router_ties`` and tokens ``retraced`` (default: the general tokens)."""
    from lowlat.cli.compare import CompareReport, RunRecord
    from lowlat.cli.compare_router import RouterTies

    def row(a, b):
        lg = torch.zeros(16)
        lg[a], lg[b] = 10.0, 8.0
        return lg

    div = []
    for a, b in zip(tokens_g, tokens_p):
        d = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        div.append(min(len(a), len(b)) if d is None and len(a) != len(b) else d)
    g_logits = {i: [row(x, p[k] if k < len(p) else x) for k, x in enumerate(a)]
                for i, (a, p) in enumerate(zip(tokens_g, tokens_p))}
    p_logits = {i: [torch.zeros(16) for _ in b] for i, b in enumerate(tokens_p)}
    general = RunRecord("general", None, [list(t) for t in tokens_g], g_logits, 1.0, [1.0] * len(tokens_g), {},
                        torch.bfloat16, 2)
    plugin = RunRecord("plugin p", "p", [list(t) for t in tokens_p], p_logits, 1.0, [1.0] * len(tokens_p), {},
                       torch.bfloat16, 2)
    report = CompareReport(general, plugin, all(d is None for d in div), div, 0.0)
    report.router = RouterTies(router_ties, [list(t) for t in (retraced or tokens_g)])
    return report


def test_the_one_router_excuse_goes_to_the_first_request_with_a_tie():
    """Request 0 diverges with no router tie, request 1 after one: as in the contract suite (compare_greedy excuses
    the first divergence a tie precedes), request 1 takes the run's excuse and only request 0 fails; its line said
    "another request already took the run's one router excuse" though none had."""
    from lowlat.cli.compare_router import RouterTie

    report = _diverged([[1, 3, 4], [1, 3, 4]], [[1, 5, 4], [1, 5, 4]], {1: [RouterTie(1, 0, 0.0)]})
    assert report.needs_router and report.router_excuse(0) is None and report.router_excuse(1) is not None
    assert [report.excused(i) for i in (0, 1)] == [False, True] and report.exit_status() == 1
    text = "\n".join(report.lines())
    assert "another request already took" not in text, text
    assert "accepted as the run's one router excuse" in text
    assert "the first difference of request 0 is not a near-tie" in report.verdict(), report.verdict()
    both = _diverged([[1, 3, 4], [1, 3, 4]], [[1, 5, 4], [1, 5, 4]],
                     {0: [RouterTie(1, 0, 0.0)], 1: [RouterTie(1, 0, 0.0)]})
    assert [both.router_excuse(i) is not None for i in (0, 1)] == [True, False]
    assert "no router excuse: another request already took the run's one router excuse (request 0)" in \
        "\n".join(both.lines())


def test_no_router_excuse_where_one_side_ended_with_the_same_tokens():
    """The plugin run made one token more than the general run, every shared token equal: no token differs for a
    flipped expert to explain (the same tokens stop both runs alike), so it is no excuse and needs no router run;
    it was accepted (exit 0) after a tie at token 1."""
    from lowlat.cli.compare_router import RouterTie

    report = _diverged([[1, 3]], [[1, 3, 7]], {0: [RouterTie(1, 0, 0.0)]})
    assert report.first_divergence == [2] and not report.needs_router
    assert report.router_excuse(0) is None and report.exit_status() == 1
    assert "no router excuse: one side ended there" in "\n".join(report.lines())


def test_no_tie_line_names_the_tokens_it_searched():
    """Without a tie the line names the tokens searched; at a first difference at token 0 there are none (it said
    "at tokens 1-0"), at token 1 one."""
    lines = {d: "\n".join(_diverged([[1, 3, 4]], [[1, 3, 4][:d] + [9] + [1, 3, 4][d + 1:]], {}).lines())
             for d in (0, 1, 2)}
    assert "for this request at tokens 1-2" in lines[2], lines[2]
    assert "for this request at token 1" in lines[1] and "1-1" not in lines[1], lines[1]
    assert "1-0" not in lines[0] and "token 0 came from the prefill" in lines[0], lines[0]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_tie_before_the_plugins_first_step_for_the_request_is_no_excuse(tmp_path, monkeypatch, overlap):
    """The plugin declines the steps that make tokens 1-3 (so they run on the general path in both runs, from the
    same inputs: their routing cannot differ) and serves from token 4, where its noise makes the tokens diverge. A
    router tie at token 1 is no excuse (the contract counts ties from the first step the plugin ran); one at token
    4 is. It took "token >= 1" for "a step the plugin ran". Overlapped DECODE (CUDA's default) reads a step's
    tokens after the next one launched: the path is still the step's own."""
    import lowlat.cli.compare as compare_mod
    import lowlat.cli.compare_router as cr
    from lowlat.cli.compare_router import RouterTie

    site = tmp_path / "site"
    activate(site, monkeypatch)
    late = mirror_source("noisy").replace("    def supports(self, batch):\n",
                                          "    def supports(self, batch):\n"
                                          "        if int(batch.positions.min()) < 6:  # prompt 3 + tokens 0-2\n"
                                          "            return False\n")
    make_plugin_dist(site, "late", late)
    monkeypatch.setenv("LOWLAT_PLUGINS", "late")
    tie_at = []

    def ties_at(config, params, prompts):  # the eager run's tokens, with one tie at token tie_at[0]
        monkeypatch.setattr(cr, "router_near_tie_rows", lambda logits, top_k: [])
        got = cr.router_ties(config, params, prompts)
        got.ties = {0: [RouterTie(tie_at[0], 0, 0.0)]}
        return got
    monkeypatch.setattr(compare_mod, "router_ties", ties_at)
    cfg = EngineConfig(plugin="late", overlap=overlap, **MOE)
    params = SamplingParams(max_new_tokens=10, stop_at_eos=False)
    for at, rc in ((1, 1), (4, 0)):
        tie_at[:] = [at]
        report = compare_mod.compare(cfg, params, [[5, 6, 7]])
        d = report.first_divergence[0]
        assert d is not None and d >= 4 and report.plugin.path_steps["general"]["DECODE"]["steps"] == 3, d
        text = "\n".join(report.lines())
        assert report.exit_status() == rc, text
    assert report.plugin.plugin_from == {0: 4} and report.general.plugin_from == {}
    report.router.ties = {0: [RouterTie(1, 0, 0.0)]}
    where = f"tokens 4-{d}" if d > 4 else "token 4"
    assert f"for this request at {where} (the plugin's first step for it made token 4)" in "\n".join(report.lines())
