"""The mutation campaign (issue 14): the suite must fail every single-defect mutant of the reference plugin, in
a contract expected to catch it; and every mutant must be real (its defect shows at its trigger).

- ``test_mutant_is_real[mutant-NAME]``: ``lowlat_contract.mutation_probe.probe`` runs the mutant at its trigger
  beside the reference and the general path; the mutant shows its defect there, the reference does not.
- ``test_mutant_fails_the_suite[mutant-NAME]``: the suite runs on the mutant (tiny preset of its architecture,
  in this process: ``lowlat_contract.mutation_run``), only the contracts that catch it (selected by their
  ``lowlat_contract`` marker: the registry's ``CAUGHT_BY_0_3`` entry, the measured catchers, else its
  ``expect``), up to the first failure; pytest must exit 1 with a failure in one of them (``"exit"``: the whole
  suite, any non-zero exit). A mutant those contracts stop catching makes the run exit 0, so the test fails.
  ``python -m lowlat_contract.mutation_run`` runs every contract on every mutant and prints which catch each (the
  table behind ESCAPES.md).
  A mutant that suite 0.2 misses carries ``escapes`` in the registry and is ``xfail(strict=True)`` here: once
  a suite catches it the XPASS fails this test, and the entry must be cleared. ``tests/mutants/ESCAPES.md``
  lists them with the condition that catches each; ``test_escapes_file_matches_the_registry`` keeps the two
  in step.
- ``control`` (HookedReference, no defect) passes the suite and matches the reference bit for bit.

The plugins are exposed through one dist-info in a temporary site dir (``install_mutant_plugins``). Each suite
run takes about a second (tiny presets, float32, CPU, plain torch, no Triton); the campaign about a minute.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lowlat_contract.mutation_run import SuiteRun, run_suite
from lowlat_contract.plugins.mutants import MUTANTS, install_mutant_plugins
from lowlat_contract.plugins.mutants.registry import CAUGHT_BY_0_3, EXIT

ESCAPES_MD = Path(__file__).parent / "mutants" / "ESCAPES.md"
DEFECTIVE = [n for n in MUTANTS if n != "control"]


def _param(name: str) -> object:
    m = MUTANTS[name]
    # raises=AssertionError: a broken run (RuntimeError from _check_run) fails even where an escape is expected
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=m.escapes)] if m.escapes else []
    return pytest.param(name, id=f"mutant-{name}", marks=marks)


@pytest.fixture(scope="module")
def suite_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SuiteRun]:
    """Runs of the suite per mutant, made on first use (so ``-k mutant-NAME`` runs one)."""
    site = tmp_path_factory.mktemp("mutant-site")
    install_mutant_plugins(site)
    work = tmp_path_factory.mktemp("mutant-runs")
    runs: dict[str, SuiteRun] = {}

    class Runs(dict):
        def __missing__(self, name: str) -> SuiteRun:
            m = MUTANTS[name]
            only = None if not m.expect or m.expect == (EXIT,) else (CAUGHT_BY_0_3.get(name) or m.expect)
            runs[name] = run_suite(name, site, work, arch=m.arch, extra=m.suite_args, unset_env=m.unset_env,
                                   contracts=only, first_failure=only is not None)
            self[name] = runs[name]
            return runs[name]

    return Runs()


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", [pytest.param(n, id=f"mutant-{n}") for n in DEFECTIVE])
def test_mutant_is_real(name: str) -> None:
    """At its trigger the mutant's logits, K/V or state differ from the general path's; the reference's do not."""
    from lowlat_contract.mutation_probe import probe

    m = MUTANTS[name]
    ev = probe(name)
    check = m.trigger.check
    assert ev.defect(check, "mutant"), (f"{name} is not real: at {m.trigger.describe()} its '{check}' evidence "
                                        f"shows no defect: {ev}")
    assert not ev.defect(check, "reference"), f"probe bug: the reference shows the '{check}' defect too: {ev}"


def _check_run(run: SuiteRun, expect: tuple[str, ...]) -> None:
    """Raise RuntimeError (not an expected failure) when the run itself broke: a usage or internal error, or a
    selection that kept no test although the suite has one of the expected contracts."""
    if run.rc not in (0, 1, 5):
        raise RuntimeError(f"the suite run broke (pytest exit {run.rc}):\n{run.summary()}")
    if run.rc == 5 and set(expect) & run.contracts:
        raise RuntimeError(f"no test of {sorted(set(expect) & run.contracts)} ran, though the suite has them")


@pytest.mark.parametrize("name", [_param(n) for n in DEFECTIVE])
def test_mutant_fails_the_suite(suite_runs: dict[str, SuiteRun], name: str) -> None:
    """The suite fails the mutant (pytest exit 1) in one of its expected contracts."""
    from lowlat_contract.plugins.mutants.registry import CUDA_ONLY

    if name in CUDA_ONLY and not torch.cuda.is_available():
        pytest.skip(CUDA_ONLY[name])  # its contract runs on CUDA only: bench/gpu_jobs.py mutants
    m = MUTANTS[name]
    run = suite_runs[name]
    if m.expect != (EXIT,):
        _check_run(run, m.expect)
    if m.expect == (EXIT,):
        assert run.rc != 0, f"{name}: the suite exited 0 (a false green):\n{run.summary()}"
        return
    assert run.rc == 1, f"{name}: pytest exit code {run.rc}, expected 1 (tests failed):\n{run.summary()}"
    hits = run.failed(m.expect)
    assert hits, (f"{name} ({m.defect}) fails no test of {', '.join(m.expect)}; it fails only "
                  f"{sorted({r.contract for r in run.failed()})}:\n{run.summary()}")


def test_greedy_ids_test_fails_a_wrong_argmax_on_its_own(tmp_path: Path) -> None:
    """``ids_greedy_argmax_plus_one`` (greedy ids one index past the argmax) fails ``test_greedy_ids_match_general``
    when that test runs alone: the greedy check needs none of the tie, NaN or distribution tests to catch it."""
    (tmp_path / "site").mkdir()
    install_mutant_plugins(tmp_path / "site", ["ids_greedy_argmax_plus_one"])
    m = MUTANTS["ids_greedy_argmax_plus_one"]
    run = run_suite("ids_greedy_argmax_plus_one", tmp_path / "site", tmp_path, arch=m.arch,
                    extra=("-k", "test_greedy_ids_match_general"), contracts=m.expect)
    _check_run(run, m.expect)
    ran = {r.name.split("[")[0] for r in run.results if r.outcome != "skipped"}
    assert ran == {"test_greedy_ids_match_general"}, f"the selection ran {sorted(ran)}:\n{run.summary()}"
    assert run.rc == 1 and run.failed(m.expect), f"test_greedy_ids_match_general passed argmax + 1:\n{run.summary()}"
    assert "picked" in run.failed(m.expect)[0].message, run.summary()


def test_control_passes_the_suite(suite_runs: dict[str, SuiteRun]) -> None:
    """HookedReference (every mutant's base, no defect) passes every contract: a failure of a mutant is its own."""
    run = suite_runs["control"]
    assert run.rc == 0 and not run.failed(), run.summary()
    ran = {r.contract for r in run.results if r.outcome == "passed"}
    assert {"compatibility", "weight_binding", "forward_outputs", "kv_writes", "fallback"} <= ran, run.summary()


def test_control_is_the_reference_bit_for_bit() -> None:
    """HookedReference's logits and K/V writes equal ReferenceForward's exactly (DECODE 3 and VERIFY 2 x 4)."""
    from lowlat.forward_batch import ForwardMode
    from lowlat.runtime import ModelRunner
    from lowlat_contract.harness import Requests, kv_at, kv_restore, kv_state, prefix_lens
    from lowlat_contract.mutation_probe import build_plugin, engine_config
    from lowlat_contract.plugins.mutants import Trigger
    from lowlat_contract.plugins.mutants._base import HookedReference
    from lowlat_contract.plugins.reference import ReferenceForward

    for model in ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"):
        runner = ModelRunner(engine_config(Trigger(model=model)), show_progress=False)
        try:
            hooked = build_plugin(runner, "control", HookedReference)[0]
            ref = build_plugin(runner, "reference", ReferenceForward)[0]
            for mode, b, n in ((ForwardMode.DECODE, 3, 1), (ForwardMode.VERIFY, 2, 4)):
                with Requests.with_prefixes(runner, prefix_lens(b)) as reqs:
                    batch = reqs.step(mode, n)
                    before = kv_state(runner.kv_pool)
                    outs = []
                    for fwd in (hooked, ref):
                        kv_restore(runner.kv_pool, before)
                        with torch.inference_mode():
                            outs.append((fwd.forward(batch), kv_at(runner.kv_pool, batch.out_cache_loc)))
                    assert torch.equal(outs[0][0], outs[1][0]), f"{model} {mode.name}: logits differ"
                    assert torch.equal(outs[0][1], outs[1][1]), f"{model} {mode.name}: K/V writes differ"
        finally:
            runner.close()


def test_campaign_covers_every_kind() -> None:
    """At least 30 defective mutants; every kind 1-8 has several; each class's docstring starts with its name."""
    kinds = [MUTANTS[n].kind for n in DEFECTIVE]
    assert len(DEFECTIVE) >= 30, len(DEFECTIVE)
    thin = {k: kinds.count(k) for k in range(1, 9) if kinds.count(k) < 3}
    assert not thin, f"kinds with fewer than 3 mutants: {thin}"
    for n in DEFECTIVE:
        doc = MUTANTS[n].cls.__doc__ or ""
        assert re.search(rf"\b{n}\b", doc.split(":")[0]), f"{n}: its docstring must open with its name: {doc[:80]}"


def test_expected_contracts_are_known() -> None:
    """Every ``expect`` names a contract of this suite (its modules' ``lowlat_contract`` markers) or one the
    rewrite is to add (memory, variants, inputs) or ``exit``: a typo would make a mutant escape for good."""
    import importlib.util

    from lowlat_contract.plugins.mutants.registry import INPUTS, MEMORY, VARIANTS

    # read, not imported: the inner suite runs must be the first to import (and assertion-rewrite) the contracts
    spec = importlib.util.find_spec("lowlat_contract.contracts")
    assert spec is not None and spec.submodule_search_locations
    sources = "".join(p.read_text() for d in spec.submodule_search_locations for p in Path(d).glob("test_*.py"))
    known = {EXIT, MEMORY, VARIANTS, INPUTS} | set(re.findall(r'mark\.lowlat_contract\("([a-z_]+)"', sources))
    unknown = {n: m.expect for n, m in MUTANTS.items() if not set(m.expect) <= known}
    assert not unknown, f"expected contracts that are no contract: {unknown}; known: {sorted(known)}"


def test_escapes_file_matches_the_registry() -> None:
    """ESCAPES.md lists exactly the mutants whose ``escapes`` is set (one ``| `name` |`` table row each)."""
    listed = set(re.findall(r"^\| `([a-z0-9_]+)` \|", ESCAPES_MD.read_text(), flags=re.M))
    want = {n for n in DEFECTIVE if MUTANTS[n].escapes}
    assert listed == want, f"ESCAPES.md lists {sorted(listed - want)} too many, misses {sorted(want - listed)}"


def test_a_broken_run_is_no_expected_failure(tmp_path: Path) -> None:
    """A run that cannot start (here: a plugin name nothing registers) is an error, never an expected failure."""
    (tmp_path / "site").mkdir()
    run = run_suite("no_such_mutant", tmp_path / "site", tmp_path, arch="LlamaForCausalLM")
    assert run.rc == 4, run.summary()  # pytest.UsageError from the suite's session start
    with pytest.raises(RuntimeError, match="broke"):
        _check_run(run, ("forward_outputs",))


AUDIT2_WEIGHT_MUTANTS = ("ignores_final_norm_weight", "ignores_layer1_post_norm", "ignores_layer1_q_norm",
                         "layer1_k_norm_from_layer0", "moe_ignores_expert3_down", "moe_layer0_ignores_expert1_down",
                         "moe_expert_ids_off_by_one", "moe_layer1_router_from_layer0")
COVERING_WEIGHT_MUTANTS = ("layer1_o_proj_from_layer0", "q_norm_layers_swapped", "ignores_k_norm",
                           "moe_last_expert_aliased", "packed_weights_cached_by_name", *AUDIT2_WEIGHT_MUTANTS)
"""Weight mutants (kind 4, and the packed-weights cache of kind 3) that ``weight_binding``'s covering form (all
parameters perturbed at once, as vendors' Triton plugins run under the interpreter) must fail on its own."""


@pytest.mark.parametrize("name", [pytest.param(n, id=f"mutant-{n}") for n in COVERING_WEIGHT_MUTANTS])
def test_weight_mutant_fails_covering_weight_binding(tmp_path: Path, name: str) -> None:
    """``weight_binding`` under ``--lowlat-sweep covering`` alone fails each weight mutant: one rebuild with
    every parameter perturbed catches what the per-parameter form of full sweeps catches."""
    (tmp_path / "site").mkdir()
    install_mutant_plugins(tmp_path / "site", [name])
    m = MUTANTS[name]
    run = run_suite(name, tmp_path / "site", tmp_path, arch=m.arch,
                    extra=(*m.suite_args, "--lowlat-sweep", "covering", "-k", "test_every_weight_changes_output"),
                    contracts=("weight_binding",))
    _check_run(run, ("weight_binding",))
    assert run.rc == 1 and run.failed(("weight_binding",)), f"{name} passed covering weight_binding:\n{run.summary()}"
    assert "every parameter perturbed" in run.failed(("weight_binding",))[0].message, run.summary()


@pytest.mark.parametrize("name", [pytest.param(n, id=f"mutant-{n}") for n in AUDIT2_WEIGHT_MUTANTS])
def test_weight_mutant_fails_covering_weight_binding_in_bfloat16(tmp_path: Path, name: str) -> None:
    """The covering form in bfloat16 too, where MoE rows whose routing differs between the paths may be excused:
    only at a router near-tie (``router_ties.routing_excuses``). Before that, ``moe_layer0_ignores_expert1_down``
    (its damage moves layer 1's routing of the very rows it damages) and ``moe_expert_ids_off_by_one`` (every
    row's routing differs) passed with every damaged row excused."""
    (tmp_path / "site").mkdir()
    install_mutant_plugins(tmp_path / "site", [name])
    m = MUTANTS[name]
    run = run_suite(name, tmp_path / "site", tmp_path, arch=m.arch,
                    extra=("--lowlat-dtype", "bfloat16", "--lowlat-sweep", "covering", "-k",
                           "test_every_weight_changes_output"), contracts=("weight_binding",))
    _check_run(run, ("weight_binding",))
    assert run.rc == 1 and run.failed(("weight_binding",)), f"{name} passed covering weight_binding:\n{run.summary()}"


LARGE_SCORE_MUTANTS = ("softmax_without_max_bf16", "softmax_first_tile_max", "softmax_first_tile_max_clamped",
                       "softmax_saturating_exp", "softmax_max_init_zero")
"""Softmax defects exact at the tiny presets' scores that the large-score check alone must fail, in bfloat16
(its bound widened by the step's conditioning) and float32. ``softmax_max_init_zero`` needs the DECODE step's
request with no cached token (one key, its own: all of a row's scores below about -100)."""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", [pytest.param(n, id=f"mutant-{n}") for n in LARGE_SCORE_MUTANTS])
def test_softmax_mutant_fails_the_large_score_check(tmp_path: Path, name: str, dtype: str) -> None:
    """``test_large_attention_scores`` on its own fails each large-score softmax mutant."""
    (tmp_path / "site").mkdir()
    install_mutant_plugins(tmp_path / "site", [name])
    m = MUTANTS[name]
    run = run_suite(name, tmp_path / "site", tmp_path, arch=m.arch,
                    extra=("--lowlat-dtype", dtype, "-k", "test_large_attention_scores"), contracts=("shape_sweeps",))
    _check_run(run, ("shape_sweeps",))
    assert run.rc == 1 and run.failed(("shape_sweeps",)), f"{name} passed the large-score check:\n{run.summary()}"


@pytest.mark.parametrize("name", [pytest.param(n, id=f"mutant-{n}")
                                  for n in ("ids_top_k_off_by_one", "ids_temperature_ignored")])
def test_sampling_mutant_fails_covering_sampled_ids(tmp_path: Path, name: str) -> None:
    """The distribution test at ``COVERING_DRAWS`` (covering sweeps) alone still fails the kind-9 mutants whose
    defect is in the distribution."""
    (tmp_path / "site").mkdir()
    install_mutant_plugins(tmp_path / "site", [name])
    m = MUTANTS[name]
    run = run_suite(name, tmp_path / "site", tmp_path, arch=m.arch,
                    extra=("--lowlat-sweep", "covering", "-k", "test_sampled_ids_follow_distribution"),
                    contracts=m.expect)
    _check_run(run, m.expect)
    assert run.rc == 1 and run.failed(m.expect), f"{name} passed the covering distribution test:\n{run.summary()}"
    assert "160 draws" in run.failed(m.expect)[0].message or "never draws" in run.failed(m.expect)[0].message, (
        run.summary())


PACKED_CONTROL = '''
from lowlat_contract.plugins.mutants._base import HookedReference, specs
from lowlat_contract.plugins.reference import SpecHooks


class PackedControl(HookedReference):
    """Correct, but it copies its o_proj weights at build: it sees new weights only when rebuilt."""

    def __init__(self, binding):
        super().__init__(binding)
        for w in self.layers:
            w.o_t = w.o_t.clone()


def build(binding):
    return PackedControl(binding)


HOOKS = SpecHooks(lambda: specs("packed_control:build"))
'''


def test_covering_weight_binding_rebuilds_a_plugin_that_copies_its_weights(tmp_path: Path) -> None:
    """The covering form checks a plugin rebuilt from the perturbed weights: a correct plugin that copies its
    weights at build passes it (checked against the one built before the perturbation, it would fail)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "packed_control.py").write_text(PACKED_CONTROL)
    run = run_suite("packed_control:HOOKS", tmp_path / "site", tmp_path, arch="LlamaForCausalLM",
                    extra=("--lowlat-sweep", "covering", "-k", "test_every_weight_changes_output"),
                    contracts=("weight_binding",))
    _check_run(run, ("weight_binding",))
    assert run.rc == 0 and any(r.outcome == "passed" for r in run.results), run.summary()
