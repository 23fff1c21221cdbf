"""The second audit's mutants (``audit2.py``: the bfloat16 large-score bound and covering weight_binding), merged
into MUTANTS by ``registry.py``. ``expect``: the contract that must catch each."""

from __future__ import annotations

from typing import Any

from lowlat_contract.plugins.mutants import audit2

QWEN3, MOE = "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
BF16 = ("--lowlat-dtype", "bfloat16")


def audit2_mutants(mutant: Any, trigger: Any) -> dict[str, Any]:
    """name -> Mutant for the second audit's mutants (``mutant`` / ``trigger``: registry's Mutant and Trigger)."""
    M, T = mutant, trigger
    sw, wb, fo = "shape_sweeps", "weight_binding", "forward_outputs"
    scaled = T(check="scaled", batch=3, prefix=(1, 40, 70))
    fresh = T(check="scaled", batch=3, prefix=(0, 0, 0))  # one key per request: its own
    scaled_bf16 = T(check="scaled", batch=3, prefix=(1, 40, 70), dtype="bfloat16")
    return {
        # -- kind 11: finite softmax defects at large scores (bf16: the widened bound) ----------------------
        "softmax_first_tile_max": M(audit2.SoftmaxFirstTileMax, 11, scaled, (sw,), suite_args=BF16),
        "softmax_first_tile_max_clamped": M(audit2.SoftmaxFirstTileMaxClamped, 11, scaled, (sw,), suite_args=BF16),
        "softmax_saturating_exp": M(audit2.SoftmaxSaturatingExp, 11, scaled, (sw,), suite_args=BF16),
        "softmax_max_init_zero": M(audit2.SoftmaxMaxInitZero, 11, fresh, (sw,), suite_args=BF16),
        "softmax_bf16_accumulate": M(audit2.SoftmaxBf16Accumulate, 11, scaled_bf16, (sw,), suite_args=BF16),
        # -- kind 4: weight defects for covering weight_binding -----------------------------------------------
        "ignores_final_norm_weight": M(audit2.IgnoresFinalNorm, 4, T(), (wb, fo)),
        "ignores_layer1_post_norm": M(audit2.IgnoresLayer1PostNorm, 4, T(), (wb, fo)),
        "ignores_layer1_q_norm": M(audit2.IgnoresLayer1QNorm, 4, T(model="tiny-qwen3"), (wb, fo), arch=QWEN3),
        "layer1_k_norm_from_layer0": M(audit2.Layer1KNormFromLayer0, 4, T(model="tiny-qwen3"), (wb, fo), arch=QWEN3),
        "moe_ignores_expert3_down": M(audit2.MoeIgnoresOneExpertDown, 4, T(model="tiny-qwen3-moe", batch=16),
                                      (wb, fo), arch=MOE),
        # escaped covering weight_binding in bfloat16 (every damaged row excused as a routing difference) until
        # router_ties.routing_excuses excused routing differences at near-ties only: run in bfloat16
        "moe_layer0_ignores_expert1_down": M(audit2.MoeLayer0IgnoresExpert1Down, 4,
                                             T(model="tiny-qwen3-moe", batch=3), (wb, fo), arch=MOE, suite_args=BF16),
        "moe_expert_ids_off_by_one": M(audit2.MoeExpertIdsOffByOne, 4, T(model="tiny-qwen3-moe", batch=3), (wb, fo),
                                       arch=MOE, suite_args=BF16),
        "moe_layer1_router_from_layer0": M(audit2.MoeLayer1RouterFromLayer0, 4, T(model="tiny-qwen3-moe", batch=3),
                                           (wb, fo), arch=MOE),
    }
