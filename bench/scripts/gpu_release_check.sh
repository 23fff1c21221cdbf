#!/usr/bin/env bash
# One device call before the 0.1.0 releases: nvidia_mega's contract suite on CUDA with the 4-ulp router near-tie
# rule; amd_mono's 256-token greedy compare on llama-3.2-1b and qwen3-30b-a3b shapes (new defaults); `lowlat bench`
# of amd_mono against the general path on both models.
source "$(dirname "$0")/gpu_common.sh"
step "contract nvidia_mega on cuda" 100 python3 -m pytest -q -p no:cacheprovider --pyargs lowlat_contract \
  --lowlat-plugin nvidia_mega --lowlat-device cuda --lowlat-model llama-3.2-1b > $OUT/contract_mega.txt 2>&1
grep -E "^=== |passed|failed" $OUT/contract_mega.txt | cut -c1-300
for m in llama-3.2-1b qwen3-30b-a3b; do
  step "compare amd_mono $m" 150 python3 -m lowlat.cli run --compare --plugin amd_mono --model $m --device cuda \
    --dtype bfloat16 --max-new-tokens 256 --max-context-len 1024 --prompt "The capital of France" > $OUT/compare_amd_$m.txt 2>&1
  tail -8 $OUT/compare_amd_$m.txt
done
step "bench amd_mono llama" 100 python3 -m lowlat.cli bench --model llama-3.2-1b --paths general,amd_mono \
  --batch-sizes 1,8 --modes decode,verify --verify-tokens 6 --context 1024 --input-sets 2 --warmup 5 --iters 50 \
  --out $OUT/bench_llama > $OUT/bench_llama_log.txt 2>&1
tail -14 $OUT/bench_llama_log.txt
step "bench amd_mono qwen" 120 python3 -m lowlat.cli bench --model qwen3-30b-a3b --paths general,amd_mono \
  --batch-sizes 1,8 --modes decode --context 1024 --input-sets 2 --warmup 5 --iters 30 \
  --out $OUT/bench_qwen > $OUT/bench_qwen_log.txt 2>&1
tail -10 $OUT/bench_qwen_log.txt
