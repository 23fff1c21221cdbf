"""Plugin API 3's sampled-ids pieces on their own: ``SamplingInputs`` (the step's SamplingInfo in fixed buffers),
``SamplingCoverage`` (which steps a plugin samples in) and ``coverage.sampling`` parsed from a plain mapping, each
with broken inputs that must be refused (CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from lowlat.errors import SpecError
from lowlat.forward_batch import ForwardMode, SamplingInfo
from lowlat.plugin.spec import Coverage, SamplingCoverage, spec_from_mapping
from lowlat.runtime.sampling import SamplingParams
from lowlat.runtime.sampling_inputs import SamplingInputs

D, V, P = ForwardMode.DECODE, ForwardMode.VERIFY, ForwardMode.PREFILL
VOCAB = 100


def _si(rows: int = 6) -> SamplingInputs:
    return SamplingInputs(device="cpu", max_rows=rows, vocab=VOCAB)


# -- SamplingInputs ------------------------------------------------------------------------------------------------


def test_fill_writes_each_row_as_the_runtime_rules_say() -> None:
    si = _si()
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
              SamplingParams(temperature=1.3, top_k=VOCAB), SamplingParams(temperature=0.0, top_k=3, top_p=0.5)]
    info = si.fill(params, [7, -1, 2**64 - 1, 3], [0, 4, 9, 2], pad_to=6)
    assert torch.equal(info.temperature, torch.tensor([0.0, 0.7, 1.3, 0.0]))
    # top_k >= vocab is off (0); a greedy row's top-k and top-p are off whatever it asked
    assert info.top_k.tolist() == [0, 5, 0, 0] and info.top_k.dtype == torch.int32
    assert torch.equal(info.top_p, torch.tensor([1.0, 0.9, 1.0, 1.0]))
    assert info.seeds.tolist() == [0, 2**63 - 1, 2**63 - 1, 0]  # 63 bits, never negative; greedy rows: 0
    assert info.offsets.tolist() == [0, 4 * VOCAB, 9 * VOCAB, 0]  # greedy rows draw nothing
    assert (info.all_greedy, info.max_top_k, info.any_top_p, info.top_p_alone) == (False, 5, True, False)
    assert info.variant == "filter"
    pad = si.info(6)  # rows 4 and 5: greedy padding a larger graph reads
    assert pad.temperature[4:].tolist() == [0.0, 0.0] and pad.top_p[4:].tolist() == [1.0, 1.0]
    assert pad.top_k[4:].tolist() == [0, 0] and pad.offsets[4:].tolist() == [0, 0]


def test_fill_summaries_and_variants() -> None:
    si = _si()
    assert si.fill([SamplingParams()] * 2, [0, 0], [1, 1]).variant == "greedy"
    info = si.fill([SamplingParams(temperature=1.0), SamplingParams()], [1, 0], [1, 1])
    assert (info.all_greedy, info.max_top_k, info.any_top_p, info.variant) == (False, 0, False, "sample")
    info = si.fill([SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.0, top_k=9)], [1, 2],
                   [1, 1])
    assert (info.max_top_k, info.any_top_p, info.top_p_alone, info.variant) == (9, True, True, "filter")


def test_buffers_keep_their_addresses_and_rows_are_rewritten() -> None:
    si = _si()
    a = si.fill([SamplingParams(temperature=2.0)] * 3, [1, 2, 3], [5, 5, 5])
    ptrs = [t.data_ptr() for t in (a.temperature, a.top_k, a.top_p, a.seeds, a.offsets)]
    b = si.fill([SamplingParams()], [0], [1])
    assert [t.data_ptr() for t in (b.temperature, b.top_k, b.top_p, b.seeds, b.offsets)] == ptrs
    assert si.info(3).temperature.tolist() == [0.0, 2.0, 2.0]  # rows past the fill keep their last values
    assert len({p for p in ptrs}) == 5, "the five fields must not overlap"


class _CountingRows:
    """Stands in for a mirror field (a ctypes array): counts slice stores, forwards them."""

    def __init__(self, arr: object) -> None:
        self.arr, self.stores = arr, 0

    def __setitem__(self, key: object, value: object) -> None:
        self.stores += 1
        self.arr[key] = value  # type: ignore[index]

    def __getitem__(self, key: object) -> object:
        return self.arr[key]  # type: ignore[index]


def test_a_fill_the_buffers_already_hold_writes_nothing() -> None:
    si = _si()
    si._host = {name: _CountingRows(arr) for name, arr in si._host.items()}
    stores = lambda: sum(r.stores for r in si._host.values())  # noqa: E731
    greedy = [SamplingParams()] * 3
    si.fill(greedy, [1, 2, 3], [9, 10, 11], pad_to=4)
    assert stores() == 0, "fresh buffers already hold greedy rows"
    si.fill([SamplingParams(temperature=1.0)] * 3, [1, 2, 3], [9, 10, 11], pad_to=4)
    si.fill(greedy, [1, 2, 3], [10, 11, 12], pad_to=4)
    first = stores()
    assert first > 0
    info = si.fill(greedy, [1, 2, 3], [11, 12, 13], pad_to=4)  # the next greedy step: same rows
    assert stores() == first, "a greedy step rewrote (and would upload) rows the buffers already hold"
    assert info.variant == "greedy" and info.temperature.tolist() == [0.0] * 3
    si.fill([SamplingParams(temperature=1.0)] + greedy[1:], [1, 2, 3], [11, 12, 13], pad_to=4)
    assert stores() > first, "a changed row must be written"


@pytest.mark.parametrize("field", ["temperature", "top_k", "top_p", "seeds", "offsets", "padding"])
def test_a_change_in_any_one_field_reaches_the_buffers(field: str) -> None:
    si = _si()
    base = SamplingParams(temperature=0.5, top_k=4, top_p=0.8)
    si.fill([base] * 2, [5, 6], [3, 4], pad_to=2)
    change = {"temperature": dict(temperature=0.9), "top_k": dict(top_k=7), "top_p": dict(top_p=0.6)}
    params = [base, SamplingParams(**{**dict(temperature=0.5, top_k=4, top_p=0.8), **change.get(field, {})})]
    seeds = [5, 9] if field == "seeds" else [5, 6]
    positions = [3, 8] if field == "offsets" else [3, 4]
    info = si.fill(params, seeds, positions, pad_to=3 if field == "padding" else 2)
    want = SamplingInputs(device="cpu", max_rows=6, vocab=VOCAB).fill(params, seeds, positions,
                                                                       pad_to=3 if field == "padding" else 2)
    for name in ("temperature", "top_k", "top_p", "seeds", "offsets"):
        assert getattr(info, name).tolist() == getattr(want, name).tolist(), name
    if field == "padding":
        assert si.info(3).temperature.tolist()[2] == 0.0


def test_padding_rows_of_an_earlier_larger_fill_are_rewritten() -> None:
    """A padded graph reads rows past the step: a row an earlier, larger sampled fill wrote there must become
    greedy padding again (the comparison covers every row written, padding included)."""
    si = _si()
    sampled = SamplingParams(temperature=0.9, top_k=4)
    si.fill([sampled] * 3, [1, 2, 3], [5, 6, 7])
    si.fill([sampled] * 2, [1, 2], [5, 6], pad_to=3)
    row = si.info(3)
    assert row.temperature.tolist()[2] == 0.0 and row.top_k.tolist()[2] == 0
    assert row.seeds.tolist()[2] == 0 and row.offsets.tolist()[2] == 0


@pytest.mark.parametrize(("variant", "temp", "k", "p"), [("greedy", 0.0, 0, 1.0), ("sample", 1.0, 0, 1.0),
                                                         ("filter", 1.0, 32, 0.9)])
def test_static_info_holds_its_variants_values(variant: str, temp: float, k: int, p: float) -> None:
    info = _si().static(4, variant, max_top_k=32)
    assert info.variant == variant
    assert info.temperature.tolist() == pytest.approx([temp] * 4) and info.top_k.tolist() == [k] * 4
    assert info.top_p.tolist() == pytest.approx([p] * 4)


def test_static_filter_clamps_top_k_below_the_vocabulary() -> None:
    assert _si().static(2, "filter", max_top_k=1 << 30).top_k.tolist() == [VOCAB - 1] * 2


@pytest.mark.parametrize("kw", [{"max_rows": 0, "vocab": 5}, {"max_rows": 2, "vocab": 0}])
def test_sampling_inputs_refuse_empty_sizes(kw: dict) -> None:
    with pytest.raises(ValueError, match="max_rows >= 1 and vocab >= 1"):
        SamplingInputs(device="cpu", **kw)


@pytest.mark.parametrize(("n", "seeds", "positions", "pad_to"), [
    (3, 2, 3, None),  # a seed missing
    (3, 3, 4, None),  # a position too many
    (7, 7, 7, None),  # more rows than max_rows
    (3, 3, 3, 2),  # pad_to below the rows
    (3, 3, 3, 7),  # pad_to past max_rows
])
def test_fill_refuses_mismatched_entries(n: int, seeds: int, positions: int, pad_to: int | None) -> None:
    with pytest.raises(ValueError, match="SamplingInputs.fill got"):
        _si().fill([SamplingParams()] * n, [0] * seeds, [0] * positions, pad_to=pad_to)


# -- SamplingCoverage ----------------------------------------------------------------------------------------------


def _info(*, greedy: bool = False, k: int = 0, top_p: bool = False, alone: bool = False) -> SamplingInfo:
    z = torch.zeros(1)
    return SamplingInfo(z, z.int(), z, z.long(), z.long(), all_greedy=greedy, max_top_k=k, any_top_p=top_p,
                        top_p_alone=alone)


@pytest.mark.parametrize(("cov", "info", "served"), [
    (SamplingCoverage(temperature=False), _info(greedy=True), True),  # greedy is always served
    (SamplingCoverage(temperature=False), _info(), False),
    (SamplingCoverage(), _info(), True),
    (SamplingCoverage(), _info(k=1), False),  # max_top_k 0: top-k needs logits
    (SamplingCoverage(max_top_k=32), _info(k=32), True),
    (SamplingCoverage(max_top_k=32), _info(k=33), False),
    (SamplingCoverage(max_top_k=32), _info(k=8, top_p=True), False),  # top_p "none"
    (SamplingCoverage(max_top_k=32, top_p="with_top_k"), _info(k=8, top_p=True), True),
    (SamplingCoverage(max_top_k=32, top_p="with_top_k"), _info(k=8, top_p=True, alone=True), False),
    (SamplingCoverage(max_top_k=32, top_p="any"), _info(k=8, top_p=True, alone=True), True),
])
def test_covers_truth_table(cov: SamplingCoverage, info: SamplingInfo, served: bool) -> None:
    assert cov.covers(D, info) is served


def test_covers_only_its_modes_and_lists_its_variants() -> None:
    cov = SamplingCoverage(max_top_k=32, top_p="with_top_k")
    assert not cov.covers(V, _info(greedy=True)) and not cov.covers(P, _info(greedy=True))
    assert SamplingCoverage(modes=frozenset({D, V})).covers(V, _info())
    assert cov.variants() == ("greedy", "sample", "filter")
    assert SamplingCoverage().variants() == ("greedy", "sample")
    assert SamplingCoverage(temperature=False).variants() == ("greedy",)
    assert cov.describe() == "sampled ids in DECODE (greedy, temperature, top_k <= 32, top_p with top_k)"


@pytest.mark.parametrize(("kw", "match"), [
    ({"modes": frozenset()}, "DECODE and/or VERIFY"),
    ({"modes": frozenset({P, D})}, "DECODE and/or VERIFY"),
    ({"modes": frozenset({"DECODE"})}, "frozenset of ForwardMode"),
    ({"modes": {D}}, "frozenset of ForwardMode"),
    ({"top_p": "some"}, "top_p is 'some'"),
    ({"max_top_k": -1}, "max_top_k must be >= 0"),
    ({"max_top_k": "32"}, "max_top_k must be an int"),
    ({"max_top_k": True}, "max_top_k must be an int"),
    ({"temperature": 1}, "temperature must be True or False"),
    ({"temperature": False, "max_top_k": 4}, "only with temperature=True"),
    ({"temperature": False, "top_p": "any"}, "only with temperature=True"),
])
def test_sampling_coverage_refuses_broken_fields(kw: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        SamplingCoverage(**kw)


def test_coverage_refuses_sampling_outside_its_modes_or_of_another_type() -> None:
    with pytest.raises(SpecError, match="among coverage.modes"):
        Coverage(modes=frozenset({D}), max_tokens=8, sampling=SamplingCoverage(modes=frozenset({V})))
    with pytest.raises(SpecError, match="must be a SamplingCoverage or a mapping"):
        Coverage(modes=frozenset({D}), max_tokens=8, sampling="yes")  # type: ignore[arg-type]


# -- coverage.sampling from a plain mapping ----------------------------------------------------------------------

SPEC = {
    "architecture": "LlamaForCausalLM", "build": "pkg.mod:build",
    "requirements": {"platforms": [{"kind": "cpu"}], "dtypes": ["float32"]},
    "coverage": {"modes": ["Decode"], "max_tokens": 8,
                 "sampling": {"modes": ["decode"], "max_top_k": 16, "top_p": "with_top_k"}},
}


def _with_sampling(sampling: object) -> dict:
    spec = copy.deepcopy(SPEC)
    spec["coverage"]["sampling"] = sampling
    return spec


def test_sampling_parses_from_a_mapping() -> None:
    sc = spec_from_mapping(SPEC).coverage.sampling
    assert sc == SamplingCoverage(modes=frozenset({D}), temperature=True, max_top_k=16, top_p="with_top_k")
    assert spec_from_mapping(_with_sampling({})).coverage.sampling == SamplingCoverage()  # every default
    assert spec_from_mapping(_with_sampling(None)).coverage.sampling is None
    obj = SamplingCoverage(max_top_k=4)
    assert spec_from_mapping(_with_sampling(obj)).coverage.sampling is obj


@pytest.mark.parametrize(("sampling", "match"), [
    ({"max_topk": 16}, r"coverage.sampling has unknown field\(s\) max_topk"),
    ({"modes": ["decode", "speculate"]}, "coverage.sampling.modes: unknown forward mode 'speculate'"),
    ({"modes": "DECODE"}, "coverage.sampling.modes must be a list of mode names"),
    ({"modes": 3}, "coverage.sampling.modes must be a list of mode names"),
    ({"modes": ["prefill"]}, "DECODE and/or VERIFY"),
    ({"modes": ["verify"]}, "among coverage.modes"),
    ({"top_p": "sometimes"}, "top_p is 'sometimes'"),
    ({"max_top_k": "16"}, "max_top_k must be an int"),
    ({"temperature": "yes"}, "temperature must be True or False"),
    ("on", "must be a SamplingCoverage or a mapping"),
    ([("max_top_k", 4)], "must be a SamplingCoverage or a mapping"),
])
def test_sampling_mapping_refuses_broken_input(sampling: object, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        spec_from_mapping(_with_sampling(sampling))
