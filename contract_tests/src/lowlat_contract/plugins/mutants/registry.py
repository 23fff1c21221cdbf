"""MUTANTS: name -> Mutant (class, kind, trigger, expected contracts, what suite 0.2 does with it), and the
dist-info writer that exposes them as plugins.

``expect`` names the contract(s) (the ``lowlat_contract`` marker names, as in the "lowlat contract" summary)
any one of which must fail on the mutant; ``"exit"`` means the suite's exit status must be non-zero whatever
fails (a false green: nothing fails, so no contract can be named). ``escapes`` is None when suite 0.2 already
fails the mutant in an expected contract, else why it does not: ``test_mutants.py`` then marks the test
``xfail(strict=True)``, so the entry must be cleared (set to None) the moment a suite catches it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowlat_contract.plugins.mutants import false_green, hygiene, kv, masks, sampling, shapes, state, weights
from lowlat_contract.plugins.mutants._base import HookedReference, specs
from lowlat_contract.plugins.mutants.registry_audit import audit_mutants
from lowlat_contract.plugins.mutants.registry_audit2 import audit2_mutants
from lowlat_contract.plugins.reference import SpecHooks

LLAMA, QWEN3, MOE = "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
FO, KV, FB, WB, GE = "forward_outputs", "kv_writes", "fallback", "weight_binding", "graph_execution"
MEMORY, VARIANTS, INPUTS, EXIT = "memory", "variants", "inputs", "exit"
IDS = "sampled_ids"


@dataclass(frozen=True)
class Trigger:
    """Where the defect shows (``lowlat_contract.mutation_probe.probe`` runs it against the general path).

    check: "outputs" (logits or K/V at out_cache_loc beyond tolerance at the last step), "outside" (K/V
        written outside out_cache_loc), "inputs" (a ForwardBatch tensor changed by the call), "growth"
        (tensors held by the plugin grow with steps), "unaccounted" (plugin-held bytes beyond
        binding.workspace_bytes), "raises" (the forward raises a BaseException that is no Exception),
        "second_engine" (outputs after the mutant was built on an engine with other weights),
        "replay" (after prepare_for_capture, steps with seq_lens_cpu None as in graph replays),
        "recycle" (a request row reused by a request with other pages), "tp" (2 gloo ranks at tp_size 2),
        "ids" (the ``sample`` stage on constructed logits fails an ``ids_check`` check: ties, NaN, distribution).
    model: a preset, a ``lowlat.models.variants`` name or ``PRESET+FIELD=INT``; prefix: cached tokens per
        request before the steps (default ``harness.prefix_lens(batch)``); steps: consecutive steps, compared
        at the last;
        warmup: prefixes of one plugin step on other requests before the trigger (state mutants).
    """

    check: str = "outputs"
    model: str = "tiny-llama"
    dtype: str = "float32"
    page_size: int = 16
    mode: str = "DECODE"
    batch: int = 1
    tokens: int = 1
    prefix: tuple[int, ...] | None = None
    steps: int = 1
    warmup: tuple[int, ...] | None = None
    context: int = 128

    def describe(self) -> str:
        d = dataclasses.asdict(self)
        base = dataclasses.asdict(Trigger())
        return ", ".join(f"{k}={v}" for k, v in d.items() if k != "check" and (v != base[k] or k in ("mode", "batch")))


@dataclass(frozen=True)
class Mutant:
    """One single-defect plugin: ``cls`` (a HookedReference subclass whose docstring names the defect)."""

    cls: type[HookedReference]
    kind: int  # 1 shape, 2 KV, 3 state, 4 weights, 5 masks/rope, 6 hygiene, 7 variants, 8 false green, 9 ids;
    # 10-15: audit.py
    trigger: Trigger
    expect: tuple[str, ...]
    escapes: str | None = None
    arch: str = LLAMA
    requirements: dict[str, Any] = field(default_factory=dict)  # spec requirement fields replaced
    suite_args: tuple[str, ...] = ()  # extra suite options (e.g. a dtype) for the run that must fail
    unset_env: tuple[str, ...] = ()  # environment variables removed for the suite run

    @property
    def defect(self) -> str:
        doc = (self.cls.__doc__ or "").strip()
        return " ".join(doc.split(":", 1)[-1].split())

    def hooks(self, build: str) -> SpecHooks:
        return SpecHooks(lambda: specs(build, **self.requirements))


def _cpu_interpreter_only() -> dict[str, Any]:
    from lowlat.plugin import PlatformRequirement

    return {"platforms": (PlatformRequirement("cuda"), PlatformRequirement("cpu", triton_interpreter=True))}


T = Trigger


def esc(kind: int, why: str) -> str:
    """The ``escapes`` text (also the xfail reason): kind and what suite 0.2 lacks."""
    return f"escapes suite 0.2: kind {kind}: {why}"


MUTANTS: dict[str, Mutant] = {
    # -- the control: no defect, must pass every contract ------------------------------------------------
    "control": Mutant(HookedReference, 0, T(), ()),
    # -- kind 1: shape-specific -------------------------------------------------------------------------
    "batch5_tail": Mutant(shapes.Batch5Tail, 1, T(batch=5), (FO,), esc(1, "DECODE runs B = 1, 3, 16 only")),
    "full_tile_strict_mask": Mutant(shapes.FullTileStrictMask, 1, T(batch=16), (FO,)),
    "verify_tpr4_layout": Mutant(shapes.VerifyTpr4Layout, 1, T(mode="VERIFY", batch=3, tokens=4), (FO,),
                                 esc(1, "VERIFY runs k+1 = 2 (B=8) and 16 (B=1) only")),
    "splitkv64_drops_tail": Mutant(shapes.SplitKvDropsTail, 1, T(prefix=(70,)), (FO,),
                                   esc(1, "contexts stay below 49 tokens")),
    "splitkv256_drops_tail": Mutant(shapes.SplitKv256DropsTail, 1, T(prefix=(300,), context=512), (FO,),
                                    esc(1, "max_context_len is 128")),
    "page16_hardcoded": Mutant(shapes.PageSize16Hardcoded, 1, T(page_size=8, batch=2, prefix=(6, 6), steps=4),
                               (FO,), esc(1, "page size is always 16")),
    "contiguous_pages": Mutant(shapes.ContiguousPages, 1, T(batch=2, prefix=(15, 15), steps=3), (FO,)),
    "fp16_double_scale": Mutant(shapes.Float16DoubleScale, 1, T(dtype="float16"), (FO,),
                                esc(1, "CPU runs float32 only (no dtype sweep)"),
                                requirements={"dtypes": frozenset({"float32", "bfloat16", "float16"})}),
    "bf16_gate_up_swapped": Mutant(shapes.Bf16GateUpSwapped, 1, T(dtype="bfloat16"), (FO,),
                                   esc(1, "CPU runs float32 only (no dtype sweep)")),
    "tp2_verify_no_reduce": Mutant(shapes.Tp2VerifyNoReduce, 1, T(check="tp", mode="VERIFY", tokens=2), (FB, FO),
                                   esc(1, "the TP check runs DECODE steps only")),
    "tp2_mlp_double_count": Mutant(shapes.Tp2MlpDoubleCount, 1, T(check="tp"), (FB,)),
    # -- kind 2: KV ------------------------------------------------------------------------------------------
    "k_before_rope": Mutant(kv.KBeforeRope, 2, T(prefix=(5,)), (KV, FO)),
    "v_scaled": Mutant(kv.VScaled, 2, T(), (KV, FO)),
    "slot_minus_one": Mutant(kv.SlotMinusOne, 2, T(check="outside"), (KV,)),
    "spill_single_request": Mutant(kv.SpillSingleRequest, 2, T(check="outside"), (KV,),
                                   esc(2, "kv_writes steps have B = 3 (DECODE) and 8 (VERIFY)")),
    "spill_page_end": Mutant(kv.SpillPageEnd, 2, T(check="outside", batch=2, prefix=(15, 3)), (KV,),
                             esc(2, "kv_writes stores no page-end slot; greedy notices only by luck of layout")),
    "verify_spills_one_slot": Mutant(kv.VerifySpillsOneSlot, 2, T(check="outside", mode="VERIFY", batch=2,
                                                                  tokens=2), (KV,)),
    "verify_store_assumes_contiguous": Mutant(kv.VerifyStoreAssumesContiguous, 2,
                                              T(check="outside", mode="VERIFY", batch=2, tokens=4, prefix=(14, 14)),
                                              (KV,), esc(2, "kv_writes' VERIFY step (8 x 2) crosses no page boundary")),
    "first_request_only": Mutant(kv.FirstRequestOnly, 2, T(batch=3), (KV,)),
    "k_halves_swapped_at_page_end": Mutant(kv.KHalvesSwappedAtPageEnd, 2, T(prefix=(15,)), (KV,),
                                           esc(2, "kv_writes stores no page-end slot (FO sees the downstream effect)")),
    # -- kind 3: state across calls --------------------------------------------------------------------------
    "rope_cached_per_shape": Mutant(state.RopeCachedPerShape, 3, T(steps=2), (FO, FB)),
    "packed_weights_cached_by_name": Mutant(state.PackedWeightsCachedByName, 3, T(check="second_engine"), (WB, FO)),
    "workspace_sized_at_first_call": Mutant(state.WorkspaceSizedAtFirstCall, 3, T(prefix=(70,), warmup=(3,)),
                                            (FO, FB), esc(3, "no context above 64 after a short first step")),
    "tuned_after_16_calls": Mutant(state.TunedAfter16Calls, 3, T(prefix=(40,), steps=17), (FO, FB),
                                   esc(3, "no token count runs more than 16 steps on one plugin instance")),
    "host_len_frozen_at_capture": Mutant(state.HostLenFrozenAtCapture, 3, T(check="replay", prefix=(40,),
                                                                            warmup=(3,)), (GE,),
                                         esc(3, "graph_execution runs on CUDA only; nothing emulates a replay")),
    "page_table_cache": Mutant(state.PageTableCache, 3, T(check="recycle", prefix=(20,)), (FO, FB, KV)),
    # -- kind 4: weights -------------------------------------------------------------------------------------
    "layer1_o_proj_from_layer0": Mutant(weights.Layer1OProjFromLayer0, 4, T(), (WB, FO)),
    "q_norm_layers_swapped": Mutant(weights.QNormLayersSwapped, 4, T(model="tiny-qwen3"), (FO,), arch=QWEN3),
    "ignores_k_norm": Mutant(weights.IgnoresKNorm, 4, T(model="tiny-qwen3"), (WB, FO, KV), arch=QWEN3),
    "moe_last_expert_aliased": Mutant(weights.MoeLastExpertAliased, 4, T(model="tiny-qwen3-moe", batch=3),
                                      (FO, KV), arch=MOE),
    "ignores_o_proj_bias": Mutant(weights.IgnoresOProjBias, 4, T(model="llama-attention-bias"), (VARIANTS, FO),
                                  esc(4, "runs the tiny preset only (no bias)")),
    # -- kind 5: masks / RoPE --------------------------------------------------------------------------------
    "verify_mask_at_3": Mutant(masks.VerifyMaskAt3, 5, T(mode="VERIFY", tokens=3), (FO,),
                               esc(5, "VERIFY runs k+1 = 2 and 16 only")),
    "rope_page_start": Mutant(masks.RopePageStart, 5, T(prefix=(16,)), (FO, KV)),
    "rope_block64": Mutant(masks.RopeBlock64, 5, T(prefix=(64,)), (FO, KV), esc(5, "no new token at position 64")),
    # -- kind 6: hygiene -------------------------------------------------------------------------------------
    "writes_next_tokens_into_input": Mutant(hygiene.WritesNextTokensIntoInput, 6, T(check="inputs"),
                                            (INPUTS, FO, KV)),
    "extend_lens_as_scratch": Mutant(hygiene.ExtendLensAsScratch, 6, T(check="inputs", batch=3), (INPUTS,),
                                     esc(6, "nothing compares the batch before and after a step")),
    "keeps_hidden_states": Mutant(hygiene.KeepsHiddenStates, 6, T(check="growth", steps=6), (MEMORY,),
                                  esc(6, "no memory contract")),
    "unaccounted_workspace": Mutant(hygiene.UnaccountedWorkspace, 6, T(check="unaccounted"), (MEMORY,),
                                    esc(6, "no memory contract")),
    # -- kind 7: claims a variant it cannot serve ------------------------------------------------------------
    "ignores_qkv_bias": Mutant(weights.IgnoresQkvBias, 7, T(model="llama-attention-bias"), (VARIANTS,),
                               esc(7, "runs the tiny preset only (no bias)")),
    "llama_tied_separate_head": Mutant(weights.LlamaTiedSeparateHead, 7, T(model="llama-tied"), (VARIANTS,),
                                       esc(7, "runs the tiny preset only (untied)")),
    "moe_always_norm_topk": Mutant(weights.MoeAlwaysNormTopk, 7, T(model="moe-no-norm-topk"), (VARIANTS,),
                                   esc(7, "runs the tiny preset only (norm_topk_prob=True)"), arch=MOE),
    "rope_linear_ignored": Mutant(weights.RopeLinearIgnored, 7, T(model="llama-rope-linear", prefix=(20,)),
                                  (VARIANTS,), esc(7, "runs the tiny preset only (llama3 rope)")),
    # -- kind 8: false-green attempts ------------------------------------------------------------------------
    "refuses_poisoned_pool": Mutant(false_green.RefusesPoisonedPool, 8, T(check="outside", mode="VERIFY", batch=2,
                                                                          tokens=2), (KV,),
                                    esc(8, "a supports() refusal after poisoning skips the VERIFY KV check")),
    "skips_long_verify": Mutant(false_green.SkipsLongVerify, 8, T(check="raises", mode="VERIFY", tokens=4),
                                (FO,), esc(8, "a skip raised by the plugin's forward passes as a skip")),
    "head_dim_64_only_v_scaled": Mutant(false_green.HeadDim64OnlyVScaled, 8, T(model="tiny-llama+head_dim=64"),
                                        (EXIT,), esc(8, "the guard refuses every tiny preset; all model contracts "
                                                        "skip and pytest exits 0"),
                                        requirements={"model": (("head_dim", (64, 128)),)}),
    "interpreter_only_v_scaled": Mutant(false_green.InterpreterOnlyVScaled, 8, T(), (EXIT,),
                                        esc(8, "every model contract skips and pytest exits 0"),
                                        requirements=_cpu_interpreter_only(), unset_env=("TRITON_INTERPRET",)),
    # -- kind 9: sampled ids (plugin API 3) ------------------------------------------------------------------
    "ids_tie_last_index": Mutant(sampling.IdsTieLastIndex, 9, T(check="ids"), (IDS,)),
    "ids_top_k_off_by_one": Mutant(sampling.IdsTopKOffByOne, 9, T(check="ids"), (IDS,)),
    "ids_temperature_ignored": Mutant(sampling.IdsTemperatureIgnored, 9, T(check="ids"), (IDS,)),
    "ids_nonfinite_unflagged": Mutant(sampling.IdsNonFiniteUnflagged, 9, T(check="ids"), (IDS,)),
    "ids_greedy_argmax_plus_one": Mutant(sampling.IdsGreedyArgmaxPlusOne, 9, T(check="ids"), (IDS,)),
    "ids_temperature_reciprocal_in_place": Mutant(sampling.IdsTemperatureReciprocalInPlace, 9, T(check="ids"),
                                                  (IDS,)),
}

MUTANTS.update(audit_mutants(Mutant, Trigger))  # the outside audit's mutants (kinds 10-15, registry_audit.py)
MUTANTS.update(audit2_mutants(Mutant, Trigger))  # the second audit's (registry_audit2.py)

# What suite 0.3 fails each mutant in (``python -m lowlat_contract.mutation_run``, CPU, float32, full sweep, run on
# 2026-12-01 at main after the 0.3 merge): these contracts join the mutant's ``expect`` and clear its ``escapes``.
# ``escapes`` thereby means "escapes the current suite"; the 0.2 reasons stay in git history and ESCAPES.md.
SW, LR = "shape_sweeps", "long_run"
CAUGHT_BY_0_3: dict[str, tuple[str, ...]] = {
    "batch5_tail": (SW,), "full_tile_strict_mask": (KV, SW), "verify_tpr4_layout": (SW,),
    "splitkv64_drops_tail": (LR, SW), "splitkv256_drops_tail": (SW,), "page16_hardcoded": (SW,),
    "fp16_double_scale": (SW,), "bf16_gate_up_swapped": (SW,), "tp2_verify_no_reduce": (FB,),
    "spill_single_request": (SW,), "spill_page_end": (LR, SW), "verify_store_assumes_contiguous": (LR, SW),
    "k_halves_swapped_at_page_end": (FO, LR, SW), "workspace_sized_at_first_call": (LR, SW),
    "tuned_after_16_calls": (LR,), "ignores_o_proj_bias": (VARIANTS,), "verify_mask_at_3": (SW,),
    "rope_page_start": (LR, SW), "rope_block64": (LR, SW), "writes_next_tokens_into_input": (FB, LR, SW),
    "extend_lens_as_scratch": (LR, SW), "keeps_hidden_states": (LR,), "ignores_qkv_bias": (VARIANTS,),
    "llama_tied_separate_head": (VARIANTS,), "moe_always_norm_topk": (VARIANTS,), "rope_linear_ignored": (VARIANTS,),
    "refuses_poisoned_pool": (LR, SW), "skips_long_verify": (SW,),
    "head_dim_64_only_v_scaled": (), "interpreter_only_v_scaled": (),  # false greens: the suite now exits non-zero
}
# Caught only on CUDA (the graph_execution and workspace-accounting contracts run there): escapes on the CPU.
CUDA_ONLY = {
    "host_len_frozen_at_capture": esc(3, "CPU: graph_execution runs on CUDA only (bench/gpu_jobs.py mutants)"),
}
# Suite 0.3.1 (the outside audit) checks the workspace accounting on a CPU too (new live tensor storages at build).
CAUGHT_BY_0_3["unaccounted_workspace"] = (LR,)
MUTANTS = {n: dataclasses.replace(m, expect=tuple(dict.fromkeys(m.expect + CAUGHT_BY_0_3.get(n, ()))),
                                  escapes=CUDA_ONLY.get(n) if (n in CUDA_ONLY or n in CAUGHT_BY_0_3) else m.escapes)
           for n, m in MUTANTS.items()}


def install_mutant_plugins(site_dir: str | Path, names: list[str] | None = None) -> list[str]:
    """Write one dist-info into ``site_dir`` whose ``lowlat.plugins`` entry points are the mutants ``names``
    (default all), each ``NAME = lowlat_contract.plugins.mutants:hooks_NAME``, declaring the suite's core range.

    Returns:
        The names written. Raises KeyError for an unknown name; FileExistsError if the dist-info exists.
    """
    from lowlat_contract import __version__
    from lowlat_contract.fixtures import core_range

    names = list(MUTANTS) if names is None else names
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        raise KeyError(f"{unknown} are not mutants; known: {', '.join(MUTANTS)}")
    info = Path(site_dir) / f"lowlat_contract_mutants-{__version__}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: lowlat-contract-mutants\nVersion: {__version__}\n"
                                   f"Summary: lowlat contract-suite mutants\nRequires-Dist: lowlat{core_range()}\n")
    eps = "".join(f"{n} = lowlat_contract.plugins.mutants:hooks_{n}\n" for n in names)
    (info / "entry_points.txt").write_text(f"[lowlat.plugins]\n{eps}")
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/entry_points.txt,,\n{info.name}/RECORD,,\n")
    return names
