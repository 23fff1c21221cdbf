"""The speculative parts on their own: n-gram lookup, simulated acceptance, the adaptive controller, the CLI flags
(CPU; the engine runs are tiny presets of a few dozen steps)."""

from __future__ import annotations

import argparse
import re
import time

import numpy as np
import pytest
from lowlat.cli import run as run_cli
from lowlat.cli.spec_args import add_speculative_args, speculative_config
from lowlat.config import ConfigError, EngineConfig
from lowlat.runtime import Engine, SamplingParams
from lowlat.runtime.speculative.controller import Controller
from lowlat.runtime.speculative.ngram import lookup
from lowlat.runtime.speculative.simulated import SimulatedDrafter, acceptance_rate

# -- n-gram ----------------------------------------------------------------------------------------------------


def test_ngram_lookup_prefers_long_recent_matches_and_repeats_periods():
    t = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3], dtype=np.int64)
    assert lookup(t, 3, 3, 1024) == [7, 8, 5]  # suffix "2 3": latest earlier "2 3" is followed by 7 8 5
    assert lookup(t, 3, 3, 4) == []  # the window [8, 5, 2, 3] holds no earlier "3", "2 3"
    loop = np.array([4, 5, 6, 4, 5, 6, 4], dtype=np.int64)
    assert lookup(loop, 3, 7, 1024) == [5, 6, 4, 5, 6, 4, 5]  # period 3 continued past the end
    assert lookup(np.array([1, 1], dtype=np.int64), 3, 4, 1024) == [1, 1, 1, 1]
    assert lookup(np.array([1, 2, 3], dtype=np.int64), 3, 4, 1024) == []
    assert lookup(np.array([7], dtype=np.int64), 3, 4, 1024) == []


def naive_lookup(t: list[int], n: int, k: int, window: int) -> list[int]:
    """The definition, by brute force: longest suffix (n..1) matched earlier, most recent, cyclic continuation."""
    t = t[-window:]
    for m in range(min(n, len(t) - 1), 0, -1):
        starts = [j for j in range(len(t) - m) if t[j:j + m] == t[len(t) - m:]]
        if starts:
            ext = list(t)
            start = starts[-1] + m
            for j in range(k):
                ext.append(ext[start + j])
            return ext[len(t):]
    return []


def test_ngram_lookup_equals_the_brute_force_definition():
    rng = np.random.default_rng(7)
    for _ in range(400):
        size, vocab = int(rng.integers(1, 40)), int(rng.integers(2, 6))
        t = rng.integers(0, vocab, size).tolist()
        n, k, window = int(rng.integers(1, 5)), int(rng.integers(1, 8)), int(rng.integers(2, 50))
        assert lookup(np.array(t, dtype=np.int64), n, k, window) == naive_lookup(t, n, k, window), (t, n, k, window)


def test_ngram_lookup_cost_is_microseconds_at_the_default_window():
    t = np.random.default_rng(0).integers(0, 50_000, 4096).astype(np.int64)
    lookup(t, 3, 5, 1024)
    start = time.perf_counter()
    for _ in range(200):
        lookup(t, 3, 5, 1024)
    per_call = (time.perf_counter() - start) / 200
    assert per_call < 5e-4  # ~5 us here (random 50k-vocab text); a decode step is milliseconds


# -- simulated -------------------------------------------------------------------------------------------------


def test_simulated_acceptance_has_the_configured_mean():
    assert acceptance_rate(1.0, 5) == pytest.approx(0.0, abs=1e-9)
    assert acceptance_rate(6.0, 5) == pytest.approx(1.0, abs=1e-9)
    d = SimulatedDrafter(3.51, k=5, vocab_size=100, seed=1)
    n = np.array([d.accept_counts(64, 5) for _ in range(300)]).ravel()
    assert abs((n + 1).mean() - 3.51) < 0.05 and n.min() >= 0 and n.max() <= 5
    with pytest.raises(ValueError, match="lies in"):
        acceptance_rate(7.0, 5)


def test_simulated_run_is_labelled_and_has_its_mean():
    kw = dict(model="tiny-llama", device="cpu", max_context_len=160, max_batch_size=4, page_size=4, plugin="none")
    with Engine(EngineConfig(speculative_method="simulated:4", speculative_adaptive=False, **kw)) as e:
        e.generate([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=120, stop_at_eos=False))
        d = e.speculator.as_dict(e)
        assert d["simulated"] and "SIMULATED" in d["label"] and "SIMULATED" in e.speculator.header()
        assert "SIMULATED" in e.speculator.summary(e)[0]
        assert abs(d["acceptance_length"] - 4.0) < 0.4  # ~100 request-steps; the last few have k < 5


# -- controller ------------------------------------------------------------------------------------------------


def drive(c: Controller, steps: int, t_decode: float, t_verify: float, tau: float, bs: int = 2, k1: int = 6) -> list:
    """Run the controller's decisions against a fake step cost; returns the decisions."""
    out = []
    for _ in range(steps):
        spec = c.speculate(bs, k1)
        out.append(spec)
        c.record(bs, k1, t_verify, tau=tau) if spec else c.record(bs, 1, t_decode)
    return out


def test_controller_turns_off_when_speculation_is_slower_and_probes():
    c = Controller(probe_every=10)
    d = drive(c, 100, t_decode=1.0, t_verify=2.0, tau=1.3)  # 1.3 tokens per step at twice the cost: off
    assert d[0] is False and not c.on and c.switches == 1 and "off" in c.reason
    # the line names the threshold that would switch it back: the ratio 2.00 plus the 10% hysteresis band
    assert "drafting excluded); plain DECODE is faster; back on above 2.20, the ratio plus the 10% hysteresis" \
        in c.reason, c.reason
    probes = [i for i, spec in enumerate(d) if spec][1:]  # VERIFY probes after switching off keep tau measured
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 2 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # backing off: 20, 40, ... steps


def test_controller_on_state_says_its_threshold():
    c = Controller(probe_every=10)
    drive(c, 50, t_decode=1.0, t_verify=2.0, tau=3.5)  # 3.5 tokens per step at twice the cost: stays on
    assert c.on and c.switches == 0
    # both moving averages say what they measure and in what unit: the acceptance length (tokens, kept drafts + 1,
    # over about how many steps) and the step-time ratio (its break-even), unlike the steps table's whole-run ms/step
    assert c.reason == ("on: recent acceptance length 3.50 tokens per request per VERIFY step (kept drafts + 1; "
                        "moving average, the last 8 VERIFY steps weigh 90%) vs step-time ratio 2.00 at batch 2 "
                        "((drafting + VERIFY) / plain DECODE step host time, moving averages of the loop's own steps: "
                        "the break-even acceptance length; the steps table's ms/step are whole-run means, drafting "
                        "excluded); speculation pays while the length is above the ratio; off below 1.80, the ratio "
                        "less the 10% hysteresis"), c.reason
    assert Controller(ewma=0.5).recent_steps == 3 and Controller(ewma=0.1).recent_steps == 22


def test_controller_stays_on_when_speculation_pays_and_turns_back_on():
    c = Controller(probe_every=10)
    d = drive(c, 60, t_decode=1.0, t_verify=1.5, tau=3.5)
    assert c.on and c.switches == 0 and sum(d) >= 50  # DECODE probes only (first step, then 1 in 10)
    drive(c, 60, t_decode=1.0, t_verify=1.5, tau=1.0)
    assert not c.on
    drive(c, 200, t_decode=1.0, t_verify=1.5, tau=3.0)  # the text became predictable: probes see it
    assert c.on and c.switches == 2


def test_controller_within_hysteresis_keeps_its_state_and_agrees_in_lockstep():
    calls = []

    def agree(values):
        calls.append(len(values))
        return values

    c = Controller(probe_every=1000, agree=agree, agree_every=8)
    drive(c, 80, t_decode=1.0, t_verify=2.0, tau=1.95)  # inside the 10% band around break-even: stays on
    assert c.on and c.switches == 0
    assert 9 <= len(calls) <= 11 and calls[-1] == 2  # every 8 measurements, both shapes at once


def test_controller_retries_a_probe_whose_time_did_not_count():
    c = Controller(probe_every=10)
    drive(c, 100, t_decode=1.0, t_verify=2.0, tau=1.3)
    assert not c.on
    while not c.speculate(2, 6):  # the next VERIFY probe while off
        c.record(2, 1, 1.0)
    c.retry(1.3)  # its drafter caught up on the steps it sat out: time not measured
    assert c.speculate(2, 6)  # so the very next step probes again
    c.record(2, 6, 2.0, tau=1.3)
    assert not c.speculate(2, 6)  # measured: still off, back to the backed-off interval


def test_controller_drops_the_first_step_at_each_shape():
    """The step right after a prefill (the first at a new batch size) is slow; as the first sample of the moving
    average it made plain decoding look slow and kept speculation on. Its time is dropped, its acceptance kept."""
    c = Controller(probe_every=10)
    assert not c.speculate(2, 6)
    c.record(2, 1, 6.0)  # the warm-up DECODE step: six times the real cost
    assert not c.speculate(2, 6)  # still unmeasured: a second plain step
    c.record(2, 1, 1.0)
    assert c.speculate(2, 6)
    c.record(2, 6, 9.0, tau=1.3)  # the warm-up VERIFY step: its acceptance counts, its time does not
    assert c.tau == 1.3 and c.ratio(2, 6) is None and c.speculate(2, 6)
    c.record(2, 6, 2.0, tau=1.3)
    assert c.ratio(2, 6) == 2.0  # 2 / 1, neither warm-up in it
    assert not c.speculate(2, 6) and not c.on  # 1.3 tokens per step at twice the cost: off
    c2 = Controller(probe_every=10)
    for seconds in (6.0, 1.0):  # the same DECODE steps, the VERIFY steps at 1.5x: on, at the real ratio
        c2.speculate(2, 6)
        c2.record(2, 1, seconds)
    for _ in range(2):
        c2.record(2, 6, 1.5, tau=1.8)
    assert c2.ratio(2, 6) == 1.5 and c2.speculate(2, 6) and c2.on


def test_controller_probes_again_after_a_warm_up_probe_while_off():
    """Off, at a new batch size: its first VERIFY probe is that shape's warm-up, whose time is dropped, so like a
    probe whose drafter caught up (retry) it is followed by another at once; it counted as a probe that found the
    state unchanged, doubling the interval before the shape was ever measured."""
    c = Controller(probe_every=10)
    drive(c, 100, t_decode=1.0, t_verify=2.0, tau=1.3)  # batch 2: off
    assert not c.on
    while not c.speculate(1, 6):  # batch 1 now: plain steps (its DECODE warm-up and measurement) until a probe
        c.record(1, 1, 1.0)
    c.record(1, 6, 9.0, tau=1.3)  # the warm-up VERIFY step at (1, 6): time dropped
    assert c.ratio(1, 6) is None and c.speculate(1, 6)  # probe again on the next step
    c.record(1, 6, 2.0, tau=1.3)
    assert c.ratio(1, 6) == 2.0 and not c.speculate(1, 6) and not c.on


def test_controller_off_takes_a_new_batch_size_plainly():
    """While off, a new batch size's two plain DECODE steps (a warm-up, then its measurement) bring no early VERIFY
    probe: only a VERIFY warm-up re-probes."""
    c = Controller(probe_every=10)
    drive(c, 100, t_decode=1.0, t_verify=2.0, tau=1.3)
    while not c.speculate(2, 6):
        c.record(2, 1, 1.0)
    c.record(2, 6, 2.0, tau=1.3)  # a probe just ran: the interval starts again
    assert drive(c, 4, t_decode=1.0, t_verify=2.0, tau=1.3, bs=3) == [False] * 4


def test_not_adaptive_always_speculates():
    c = Controller(adaptive=False)
    assert all(drive(c, 20, t_decode=1.0, t_verify=9.0, tau=1.0)) and c.on


def test_engine_falls_back_to_decode_when_nothing_is_ever_accepted():
    kw = dict(model="tiny-llama", device="cpu", max_context_len=200, max_batch_size=2, page_size=4, plugin="none",
              dtype="float32")
    with Engine(EngineConfig(**kw)) as e:
        want = [c.token_ids for c in e.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=150,
                                                                                   stop_at_eos=False))]
    with Engine(EngineConfig(speculative_method="ngram", **kw)) as e:
        c = e.speculator.controller
        c.probe_every = 16
        c.tau = 1.0  # measured acceptance: nothing kept
        for _ in range(2):  # the first step at a shape is a warm-up: its time is dropped
            c.record(2, 1, 1e-3)  # plain DECODE: 1 ms; VERIFY (draft + verify) pretended at 3 ms
            c.record(2, 6, 3e-3)
        c.record = lambda bs, k1, s, tau=None: None  # freeze the model: the real CPU timings are noise here
        got = [x.token_ids for x in e.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=150,
                                                                                   stop_at_eos=False))]
        st = e.speculator.stats
        assert got == want and not c.on and "off" in c.reason
        assert st.decode_steps > 5 * st.verify_steps and st.verify_steps >= 1  # probes only
        summary = "\n".join(e.speculator.summary(e))
        # the off-switch's state says what it means: triggered (plain DECODE) or not (speculating)
        assert "adaptive off-switch (plain DECODE while it measures faster): triggered: plain DECODE steps at the " \
               "end, speculation off; recent acceptance length" in summary, summary
        assert "off-switch: off" not in summary and "not triggered" not in summary
        # the run's mean and the off-switch's moving average are two figures: each line says which it is
        assert re.search(r"mean acceptance length \d\.\d\d tokens per request per VERIFY step \(kept drafts \+ 1\) "
                         r"over the run", summary), summary
        assert re.search(r"recent acceptance length \d\.\d\d tokens per request per VERIFY step \(kept drafts \+ 1; "
                         r"moving average, the last 8 VERIFY steps weigh 90%\) < step-time ratio 3\.00 at batch 2 "
                         r"\(\(drafting \+ VERIFY\) / plain DECODE step host time", c.reason), c.reason


# -- CLI -------------------------------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lowlat")
    run_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["run", *argv])


def test_spec_args_on_any_parser():
    p = argparse.ArgumentParser()
    add_speculative_args(p)
    assert speculative_config(p.parse_args([])) == {}
    kw = speculative_config(p.parse_args(["--speculative", "draft:/ckpt", "--num-draft-tokens", "3",
                                          "--no-spec-adaptive"]))
    cfg = EngineConfig(**kw)
    assert cfg.speculative and cfg.speculative_spec.path == "/ckpt" and cfg.draft_tokens == 3
    assert not cfg.speculative_adaptive
    with pytest.raises(ConfigError, match="needs --speculative"):
        speculative_config(p.parse_args(["--num-draft-tokens", "3"]))


def test_run_with_speculation_prints_acceptance(capsys):
    args = _parse(["--device", "cpu", "--max-context-len", "64", "--max-new-tokens", "20", "--prompt", "abcabcabc",
                   "--speculative", "ngram", "--num-draft-tokens", "3", "--plugin", "none"])
    assert run_cli.run(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    for word in ("speculative: ngram, k=3", "VERIFY steps", "mean acceptance length", "VERIFY", "tok/s"):
        assert word in out, word
    # each tok/s figure says what it counts: per request (the table) or the whole batch (the summary)
    assert "decode tok/s: per request, its tokens after the first over its decode time (rejected drafts not " \
           "counted)" in out, out
    assert re.search(r"whole batch \d+\.\d tok/s \(tokens all requests gained: kept drafts, the token after them "
                     r"and DECODE tokens; rejected drafts not counted\), per request \d+\.\d{3} ms per token", out), out
    assert "tokens: rows the steps ran (VERIFY: every verified row, rejected drafts included)" in out, out
    # the off-switch line names its state: triggered or not, never a bare "off-switch: on"
    assert re.search(r"adaptive off-switch \(plain DECODE while it measures faster\): (not )?triggered: ", out), out
    assert "off-switch: on" not in out and "off-switch: off" not in out


def test_run_json_stats_carry_the_speculative_stats(capsys):
    import json

    base = ["--device", "cpu", "--max-context-len", "64", "--max-new-tokens", "20", "--prompt", "abcabcabc",
            "--plugin", "none", "--json"]
    assert run_cli.run(_parse([*base, "--speculative", "ngram", "--num-draft-tokens", "3"])) == 0
    stats = json.loads(capsys.readouterr().out.splitlines()[-1])
    spec = stats["speculative"]
    assert stats["type"] == "stats" and spec["method"] == "ngram" and spec["k"] == 3
    assert spec["verify_steps"] > 0 and spec["verify_steps_by_path"] == {"general": spec["verify_steps"]}
    assert spec["acceptance_length"] >= 1.0 and "on" in spec["controller"] and not spec["simulated"]
    assert run_cli.run(_parse(base)) == 0  # speculation off: null, not a missing key
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["speculative"] is None


def test_run_rejects_a_bad_method(capsys, monkeypatch):
    monkeypatch.delenv("LOWLAT_DEBUG", raising=False)
    assert run_cli.run(_parse(["--device", "cpu", "--speculative", "eagle"])) == 2
    assert "not one of" in capsys.readouterr().err


def test_scheduler_prefill_pending_and_decoding():
    kw = dict(model="tiny-llama", device="cpu", max_context_len=64, max_batch_size=2, page_size=4, plugin="none")
    with Engine(EngineConfig(**kw)) as e:
        s = e.scheduler
        assert not s.prefill_pending() and s.decoding() == []
        rids = [e.add_request([1, 2, 3], SamplingParams(max_new_tokens=4)) for _ in range(3)]
        assert s.prefill_pending()
        e.step()  # prefills two (max_batch_size), the third waits for a row
        assert [r.rid for r in s.decoding()] == rids[:2] and not s.prefill_pending()
        while e.has_unfinished():
            e.step()
        assert not s.prefill_pending() and s.decoding() == []
