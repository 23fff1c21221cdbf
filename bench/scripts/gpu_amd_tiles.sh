#!/usr/bin/env bash
# One device call: amd_mono with larger weight chunks per pipelined load (gemv_bk_max, gemv_tile_elems) per decoder
# layer on llama-3.2-1b, qwen3-8b and qwen3-30b-a3b, and the logits/K/V contracts with the largest chunks.
source "$(dirname "$0")/gpu_common.sh"
V="gemv_bk_max=1024;gemv_bk_max=1024,gemv_tile_elems=32768"
step "amd tiles llama" 75 python3 vendors/amd_mono/bench_layers.py --models llama-3.2-1b --rows 1,8 --no-skips \
  --variants "$V" 2>&1 | tee $OUT/amd_tiles_llama.txt | grep -v "^#"
for m in qwen3-8b qwen3-30b-a3b; do
  step "amd tiles $m" 65 python3 vendors/amd_mono/bench_layers.py --models $m --rows 1 --no-skips \
    --variants "$V" 2>&1 | tee $OUT/amd_tiles_$m.txt | grep -v "^#"
done
step "contract amd_mono logits/kv, large chunks" 55 \
  env LOWLAT_MONO_GEMV_BK_MAX=1024 LOWLAT_MONO_GEMV_TILE_ELEMS=32768 python3 -m pytest -q -p no:cacheprovider --pyargs lowlat_contract --lowlat-plugin amd_mono --lowlat-device cuda \
  --lowlat-model llama-3.2-1b -k "logits_match or kv_writes or greedy" > $OUT/contract_amd_tiles.txt 2>&1
grep -E "passed|failed" $OUT/contract_amd_tiles.txt | cut -c1-250
