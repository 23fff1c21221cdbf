#!/usr/bin/env bash
# One device call: the alternating-paths diagnosis for nvidia_mega on tiny-qwen3-moe (router gaps per step), then
# amd_mono with its new sm90 defaults (PDL off, L2 prefetch off, 2 programs per SM for MoE models): GPU tests,
# the contract suite on CUDA (every architecture's tiny preset + llama-3.2-1b), and per-layer times.
source "$(dirname "$0")/gpu_common.sh"
step "diag alternating nvidia_mega" 120 python3 bench/scripts/diag_alternating.py --plugin nvidia_mega --device cuda \
  --seeds 8 > $OUT/diag_alternating_mega.txt 2>&1
grep -E "^===|divergence [0-9]" $OUT/diag_alternating_mega.txt
step "amd_mono GPU tests" 150 python3 -m pytest -q vendors/amd_mono/tests/test_gpu.py > $OUT/amd_tests.txt 2>&1
tail -3 $OUT/amd_tests.txt
step "contract amd_mono on cuda" 90 python3 -m pytest -q -p no:cacheprovider --pyargs lowlat_contract \
  --lowlat-plugin amd_mono --lowlat-device cuda --lowlat-model llama-3.2-1b > $OUT/contract_amd.txt 2>&1
grep -E "^=== |passed|failed|^performance" $OUT/contract_amd.txt | cut -c1-300
step "amd layers llama" 100 python3 vendors/amd_mono/bench_layers.py --models llama-3.2-1b --rows 1,8 --no-skips \
  --variants "programs_per_sm=2;pdl=1;pdl=1,pdl_early=0" 2>&1 | tee $OUT/amd_layers_llama.txt | grep -v "^#"
step "amd layers qwen" 120 python3 vendors/amd_mono/bench_layers.py --models qwen3-30b-a3b --rows 1,8 --no-skips \
  --variants "programs_per_sm=1;programs_per_sm=3" 2>&1 | tee $OUT/amd_layers_qwen.txt | grep -v "^#"
