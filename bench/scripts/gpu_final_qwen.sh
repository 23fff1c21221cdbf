#!/usr/bin/env bash
# One device call: nvidia_mega's MoE kernel tests and the alternating-paths contract on tiny-qwen3-moe, amd_mono's
# per-layer overlap ablation (PDL off, L2 prefetch off, stage-per-launch), then `lowlat bench` on qwen3-30b-a3b:
# general and nvidia_mega at batch 1-8 + VERIFY, and the hf peer at the shapes earlier runs had no time for
# (DECODE 2, 4, 8 and VERIFY; its batch-1 row is in bench/results/2026-11-30-h200-qwen3-30b-a3b).
source "$(dirname "$0")/gpu_common.sh"
{
step "mega MoE kernel tests" 40 python3 -m pytest -q vendors/nvidia_mega/tests/test_kernels_moe.py
step "contract nvidia_mega alternating, tiny-qwen3-moe" 40 python3 -m pytest -q -p no:cacheprovider --pyargs lowlat_contract \
  --lowlat-plugin nvidia_mega --lowlat-device cuda --lowlat-arch Qwen3MoeForCausalLM -k "alternating or greedy" -vv
} > $OUT/tests.txt 2>&1
grep -E "^=== |passed|failed|no near-tie" $OUT/tests.txt | cut -c1-400
step "amd overlaps" ${AMD_S:-75} python3 vendors/amd_mono/bench_layers.py --models llama-3.2-1b --rows 1,8 --overlaps \
  --staged --no-skips 2>&1 | tee $OUT/amd_bench_layers_overlaps.txt | tail -16
timeout ${BENCH_S:-450} python3 -m lowlat.cli bench --model qwen3-30b-a3b --paths general,nvidia_mega,hf \
  --batch-sizes 1,2,4,8 --modes decode,verify --verify-tokens 6 --context 1024 --input-sets 2 --warmup 5 --iters 50 \
  --hf-batch-sizes 2,4,8 --hf-layer-batch-sizes 1 --hf-budget-s ${HF_BUDGET:-230} --out $OUT/bench 2>&1 \
  | tee $OUT/bench_log.txt | tail -42
echo "=== bench rc=$?"
