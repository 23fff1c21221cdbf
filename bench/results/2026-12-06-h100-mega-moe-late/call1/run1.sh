#!/bin/bash
# session 16 scratch (untracked): read bandwidth probe, MoE row1_down sweep, qwen3-8b late q/k A/B
O=$OUT/r; mkdir -p $O
python3 -m pip install -q --no-deps --no-build-isolation -e core -e vendors/nvidia_mega -e vendors/amd_mono -e contract_tests >/dev/null 2>&1
(nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)"; git log -1 --format=%H; date -u) > $O/env.txt 2>&1; cat $O/env.txt
timeout 60 python3 probe_bw.py > $O/probe.txt 2>&1; cat $O/probe.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider vendors/nvidia_mega/tests/test_kernels_qk_late.py vendors/nvidia_mega/tests/test_kernels_moe.py vendors/nvidia_mega/tests/test_kernels_moe_edges.py > $O/tests.txt 2>&1; tail -3 $O/tests.txt
timeout 200 python3 vendors/nvidia_mega/bench_moe_head.py --sweep moe_down1 --stages > $O/moe.txt 2>&1; grep -E "check|moe|lm_head|copy" $O/moe.txt | grep -v " off " | tail -45
B="python3 bench/scripts/plan_ab.py --table TUNED_ROW1 --key qkv_late,6144,4096,bfloat16 --value 8,1024,4,3 --"
ARGS="--model qwen3-8b --paths general,nvidia_mega --batch-sizes 1 --modes decode --context 1024 --input-sets 2 --warmup 5 --iters 50 --no-plot"
for i in 1 2; do
 timeout 100 python3 -m lowlat.cli bench $ARGS --out $O/A$i > $O/A$i.txt 2>&1; echo A$i; grep -E "DECODE" $O/A$i.txt | tail -3
 timeout 100 $B bench $ARGS --out $O/B$i > $O/B$i.txt 2>&1; echo B$i; grep -E "plan_ab|DECODE" $O/B$i.txt | tail -4
done
timeout 100 $B run --compare --plugin nvidia_mega --model qwen3-8b --device cuda --dtype bfloat16 --max-new-tokens 256 --max-context-len 1024 --prompt "The capital of France" > $O/compare.txt 2>&1; tail -6 $O/compare.txt
tar czf $OUT/r.tgz -C $OUT r
