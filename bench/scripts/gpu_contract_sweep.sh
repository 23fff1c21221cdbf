#!/usr/bin/env bash
# One device call: nvidia_mega's contract suite on CUDA with the router near-tie rule (every architecture's tiny
# preset + llama-3.2-1b), then a sweep of amd_mono launch options per decoder layer (bench_layers.py --variants).
source "$(dirname "$0")/gpu_common.sh"
step "contract nvidia_mega on cuda" 120 python3 -m pytest -q -p no:cacheprovider --pyargs lowlat_contract \
  --lowlat-plugin nvidia_mega --lowlat-device cuda --lowlat-model llama-3.2-1b > $OUT/contract_mega.txt 2>&1
grep -E "^=== |passed|failed" $OUT/contract_mega.txt | cut -c1-300
V="pdl=0;pdl=0,programs_per_sm=2;pdl=0,num_warps=8;pdl=0,num_stages=4;pdl=0,l2_prefetch_bytes=0;pdl_early=0"
V="$V;pdl_early=0,programs_per_sm=2;pdl_early=0,l2_prefetch_bytes=0;pdl=0,programs_per_sm=2,num_warps=8"
for m in llama-3.2-1b qwen3-30b-a3b; do
  step "amd sweep $m" ${SWEEP_S:-200} python3 vendors/amd_mono/bench_layers.py --models $m --rows 1,8 --no-skips \
    --staged --variants "$V" 2>&1 | tee $OUT/amd_sweep_$m.txt
done
