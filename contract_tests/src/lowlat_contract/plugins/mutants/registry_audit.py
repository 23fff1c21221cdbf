"""The outside audit's mutants (``audit.py``, kinds 9-14): registry entries that ``registry.py`` merges into MUTANTS.

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
        # -- kind 9: model dimensions the tiny presets never take ------------------------------------------
        "layer2_reads_layer0_o_proj": M(audit.Layer2ReadsLayer0OProj, 9, T(model="tiny-llama+num_hidden_layers=3"),
                                        (var,)),
        "vocab_tail_tile_dropped": M(audit.VocabTailTileDropped, 9, T(model="tiny-llama+vocab_size=500"), (var,)),
        "mlp_k_tail_dropped": M(audit.MlpKTailDropped, 9, T(model="tiny-llama+intermediate_size=80"), (var,)),
        # -- kind 10: value range ----------------------------------------------------------------------------
        "softmax_without_max": M(audit.SoftmaxWithoutMax, 10, T(check="scaled", batch=3), (sw,)),
        # -- kind 11: side effects two agreeing paths cannot show --------------------------------------------
        "drifts_final_norm": M(audit.DriftsFinalNorm, 11, T(check="params"), (fo, kv, sw, lr)),
        "global_scratch_workspace": M(audit.GlobalScratchWorkspace, 11, T(check="built"), (mem, lr)),
        "leaks_into_class_trace": M(audit.LeaksIntoClassTrace, 11, T(check="live", steps=6), (mem, lr)),
        # -- kind 12: one TP rank only -------------------------------------------------------------------------
        "rank1_spills_next_slot": M(audit.Rank1SpillsNextSlot, 12, T(check="tp_outside", batch=2), (fb,)),
        # -- kind 13: rows and pages as serving hands them out ---------------------------------------------------
        "rows_above_coverage_alias": M(audit.RowsAboveCoverageAlias, 13, T(check="high_rows", batch=2), (sw,)),
        "length_from_last_row": M(audit.LengthFromLastRow, 13, T(batch=2, prefix=(40, 3)), (sw, lr)),
        "last_page_len_modulo": M(audit.LastPageLenModulo, 13, T(batch=2, prefix=(15, 3)), (sw, lr)),
        "stale_tail_of_reused_page": M(audit.StaleTailOfReusedPage, 13, T(prefix=(3,), warmup=(30,)), (kv, sw, lr)),
        # -- kind 14: state that surfaces after ~200 calls -------------------------------------------------------
        "tuned_after_200_calls": M(audit.TunedAfter200Calls, 14, T(prefix=(40,), steps=201, context=256), (lr,)),
    }
