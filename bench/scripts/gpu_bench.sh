#!/usr/bin/env bash
# One device call: `lowlat bench` for one model (arg 1) over general, both plugins and the hf peer; arg 2 = extra step.
source "$(dirname "$0")/gpu_common.sh"
timeout ${BENCH_TIMEOUT:-420} python3 -m lowlat.cli bench --model "$1" --paths ${PATHS:-general,nvidia_mega,amd_mono,hf} \
  --batch-sizes 1,2,4,8 --modes decode,verify --verify-tokens 6 --context 1024 --input-sets 2 --warmup 5 --iters 50 \
  --hf-budget-s ${HF_BUDGET:-80} --out $OUT/bench 2>&1 | tee $OUT/bench_log.txt | tail -60
echo "=== bench rc=$?"
if [ "${2:-}" = amd ]; then
  timeout 150 python3 -m pytest -q vendors/amd_mono/tests/test_gpu.py 2>&1 | tee $OUT/amd_gpu_tests.txt | tail -15
fi
