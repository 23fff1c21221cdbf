#!/usr/bin/env bash
# One device call: the nvidia_mega MoE kernel test, amd_mono's GPU tests, the contract suite on CUDA for both
# vendors (every architecture's tiny preset + llama-3.2-1b), then `lowlat bench` on llama-3.2-1b with the hf peer.
source "$(dirname "$0")/gpu_common.sh"
{
step "mega MoE kernel tests" 60 python3 -m pytest -q vendors/nvidia_mega/tests/test_kernels_moe.py -x 2>&1 | tail -40
step "amd_mono GPU tests" 150 python3 -m pytest -q vendors/amd_mono/tests/test_gpu.py 2>&1 | tail -30
for p in nvidia_mega amd_mono; do
  step "contract $p on cuda" 75 python3 -m pytest -q -p no:cacheprovider --pyargs lowlat_contract --lowlat-plugin $p \
    --lowlat-device cuda --lowlat-model llama-3.2-1b 2>&1 | tail -30
done
} > $OUT/tests.txt 2>&1
grep -E "^=== |passed|failed|FAIL" $OUT/tests.txt
timeout ${BENCH_S:-290} python3 -m lowlat.cli bench --model llama-3.2-1b --paths general,nvidia_mega,amd_mono,hf \
  --batch-sizes 1,2,4,8 --modes decode,verify --verify-tokens 6 --context 1024 --input-sets 2 --warmup 5 --iters 50 \
  --hf-budget-s 200 --out $OUT/bench 2>&1 | tee $OUT/bench_log.txt | tail -45
echo "=== bench rc=$?"
