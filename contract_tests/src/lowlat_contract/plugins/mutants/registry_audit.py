"""The outside audit's mutants (``audit.py``, kinds 10-15): registry entries that ``registry.py`` merges into MUTANTS.

Kept apart so the first campaign's table stays as it was. Each entry's ``expect`` is the contract that catches
it in suite 0.3.1 (the cheapest first); ``escapes`` is None: the audit found which of them suite 0.3 missed
(tests/mutants/ESCAPES.md, "The outside audit") and the suite was fixed for each kind.
"""

from __future__ import annotations

from typing import Any

from lowlat_contract.plugins.mutants import audit


def audit_mutants(mutant: Any, trigger: Any) -> dict[str, Any]:
    """name -> Mutant for the audit's mutants (``mutant`` / ``trigger``: registry's Mutant and Trigger)."""
    M, T = mutant, trigger
    fo, kv, fb, sw, lr, var, mem = ("forward_outputs", "kv_writes", "fallback", "shape_sweeps", "long_run",
                                    "variants", "memory")
    return {
        # -- kind 10: model dimensions the tiny presets never take ------------------------------------------
        "layer2_reads_layer0_o_proj": M(audit.Layer2ReadsLayer0OProj, 10, T(model="tiny-llama+num_hidden_layers=3"),
                                        (var,)),
        "vocab_tail_tile_dropped": M(audit.VocabTailTileDropped, 10, T(model="tiny-llama+vocab_size=500"), (var,)),
        "mlp_k_tail_dropped": M(audit.MlpKTailDropped, 10, T(model="tiny-llama+intermediate_size=80"), (var,)),
        # -- kind 11: value range ----------------------------------------------------------------------------
        "softmax_without_max": M(audit.SoftmaxWithoutMax, 11, T(check="scaled", batch=3), (sw,)),
        "softmax_without_max_bf16": M(audit.SoftmaxWithoutMaxBf16, 11, T(check="scaled", batch=3, dtype="bfloat16"),
                                      (sw,), suite_args=("--lowlat-dtype", "bfloat16")),
        # -- kind 12: side effects two agreeing paths cannot show --------------------------------------------
        "drifts_final_norm": M(audit.DriftsFinalNorm, 12, T(check="params"), (fo, kv, sw, lr)),
        "global_scratch_workspace": M(audit.GlobalScratchWorkspace, 12, T(check="built"), (mem, lr)),
        "leaks_into_class_trace": M(audit.LeaksIntoClassTrace, 12, T(check="live", steps=6), (mem, lr)),
        # -- kind 13: one TP rank only -------------------------------------------------------------------------
        "rank1_spills_next_slot": M(audit.Rank1SpillsNextSlot, 13, T(check="tp_outside", batch=2), (fb,)),
        # -- kind 14: rows and pages as serving hands them out ---------------------------------------------------
        "rows_above_coverage_alias": M(audit.RowsAboveCoverageAlias, 14, T(check="high_rows", batch=2), (sw,)),
        "length_from_last_row": M(audit.LengthFromLastRow, 14, T(batch=2, prefix=(40, 3)), (sw, lr)),
        "last_page_len_modulo": M(audit.LastPageLenModulo, 14, T(batch=2, prefix=(15, 3)), (sw, lr)),
        "stale_tail_of_reused_page": M(audit.StaleTailOfReusedPage, 14, T(prefix=(3,), warmup=(30,)), (kv, sw, lr)),
        # -- kind 15: state that surfaces after ~200 calls -------------------------------------------------------
        "tuned_after_200_calls": M(audit.TunedAfter200Calls, 15, T(prefix=(40,), steps=201, context=256), (lr,)),
    }
