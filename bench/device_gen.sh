#!/usr/bin/env bash
# Device hook "gen" (bench/device.sh hooks): the fast rollout path and the liger-kernel question of issue 12.
#   1. bench/generation.py --shape gpu: transformers' generate vs rlhfkit's decode loop vs the loop with a static cache
#      and CUDA graphs (generation.compile), 64 rows x 128 new tokens, SmolLM2-135M's shape in bf16, same tokens;
#   2. the CUDA-graph decode test of tests/unit/test_generation.py (skipped on CPU), on the GPU;
#   3. bench/liger_ce.py: plain vs fused linear cross-entropy memory and time (liger-kernel's wheel in .device/whl-gen).
# Writes each output to $HOOK_OUT as it goes; DEVICE_DRY_RUN=1 (on CPU) runs the CPU shape of 1 and 3's CPU message.
set -uo pipefail
out=${HOOK_OUT:-/tmp/hook-gen}; mkdir -p "$out"
budget=${HOOK_BUDGET_S:-90}
shape=gpu; [[ ${DEVICE_DRY_RUN:-0} == 1 ]] && shape=cpu
timeout $((budget * 6 / 10)) python3 bench/generation.py --shape $shape 2>&1 | tee "$out/generation.txt"
timeout $((budget * 2 / 10)) python3 -m pytest -q -rs -p no:cacheprovider -p no:warnings tests/unit/test_generation.py -k cuda_graph 2>&1 |
  tail -5 | tee "$out/cuda_graph_test.txt"
timeout $((budget * 2 / 10)) python3 bench/liger_ce.py 2>&1 | tee "$out/liger_ce.txt"
exit 0
