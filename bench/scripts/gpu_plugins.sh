#!/usr/bin/env bash
# One device call: amd_mono on the H200 (GPU tests, layer bench) and the contract suite on CUDA for both vendors.
source "$(dirname "$0")/gpu_common.sh"
step "amd_mono GPU tests" 200 python3 -m pytest -q -x vendors/amd_mono/tests/test_gpu.py 2>&1 | tee $OUT/amd_gpu_tests.txt | tail -25
step "amd_mono layer bench" 120 python3 vendors/amd_mono/bench_layers.py 2>&1 | tee $OUT/amd_bench_layers.txt | tail -30
for p in nvidia_mega amd_mono; do
  step "contract $p on cuda" 110 python3 -m pytest -q -p no:cacheprovider --pyargs lowlat_contract --lowlat-plugin $p \
    --lowlat-device cuda --lowlat-model llama-3.2-1b --lowlat-arch LlamaForCausalLM 2>&1 | tee $OUT/contract_$p.txt | tail -28
done
