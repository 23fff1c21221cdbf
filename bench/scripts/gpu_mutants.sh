#!/usr/bin/env bash
# One device call: the contract suite on CUDA against a few mutants of the campaign (contract_tests/tests/mutants):
# the control (must pass every contract there too), host_len_frozen_at_capture (only graph_execution, CUDA only,
# can catch it), bf16_gate_up_swapped (CUDA's default dtype is bfloat16) and splitkv64_drops_tail (a shape no
# configuration of suite 0.2 reaches, so it should escape on CUDA as well).
source "$(dirname "$0")/gpu_common.sh"
SITE=/tmp/mutant-site
python3 -c "from lowlat_contract.plugins.mutants import install_mutant_plugins as i; i('$SITE')"
for m in ${MUTANTS:-control host_len_frozen_at_capture bf16_gate_up_swapped splitkv64_drops_tail}; do
  step "contract $m on cuda" ${CONTRACT_S:-120} env PYTHONPATH=$SITE python3 -m pytest -q -p no:cacheprovider \
    --pyargs lowlat_contract --lowlat-plugin $m --lowlat-arch LlamaForCausalLM --lowlat-device cuda \
    > $OUT/contract_$m.txt 2>&1
  grep -E "^=== |^(PASS|FAIL|SKIP) |passed|failed" $OUT/contract_$m.txt | cut -c1-240
done
