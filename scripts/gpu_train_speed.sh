#!/usr/bin/env bash
# Training throughput on the GPU machine in one call (~8 min): the torch backend at real Qwen3 sizes with
# the chunked LM head and with full-vocabulary logits, then with --torch-compile, padded and packed
# (varlen attention) micro-batches with packed-vs-padded logprobs checked first
# (`vime.bench.torch_train_speed`), then the Megatron backend's training, R3 and speed checks against
# the torch backend (`vime.bench.megatron_check`), then the 4B shape with activation checkpointing.
# Carry `.vllm-cuda/deps` (vime's pure dependencies and megatron-core for Python 3.12, made by
# `../shared/gpu/prepare-vllm-cuda.sh`). Results: $OUT (or /tmp/vime-gpu) as JSON lines and logs.
#   bash scripts/gpu_train_speed.sh     # VIME_GPU_SPEED_SIZES (0.6b,1.7b); VIME_GPU_SPEED_HEADS=0,
#                                       # VIME_GPU_MEGATRON=0, VIME_GPU_SPEED_4B=0 skip parts
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/vime-gpu}"; mkdir -p "$out"
site=/tmp/vime-train-site
[ -d "$site/megatron" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .vllm-cuda/deps/*.whl
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 VIME_LOG_LEVEL=WARNING
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
status=0
sizes="${VIME_GPU_SPEED_SIZES:-0.6b,1.7b}"
if [ "${VIME_GPU_SPEED_HEADS:-1}" = 1 ]; then
  timeout 240 python3 -m vime.bench.torch_train_speed --sizes "$sizes" --heads chunked,full \
    --out "$out/torch_train_speed.jsonl" > "$out/torch_train_speed.log" 2>&1 || status=1
  grep '^{"size"' "$out/torch_train_speed.log"
fi
# --torch-compile on the chunked head (the first step compiles), padded then packed
timeout 300 python3 -m vime.bench.torch_train_speed --sizes "$sizes" --heads chunked --compile on --pack off,on --check-pack \
  --out "$out/torch_train_speed.jsonl" > "$out/torch_train_speed_compile.log" 2>&1 || status=1
grep '^{"size"' "$out/torch_train_speed_compile.log"
if [ "${VIME_GPU_MEGATRON:-1}" = 1 ]; then
  timeout 200 python3 -m vime.bench.megatron_check --only train r3 speed --out "$out/megatron_check.jsonl" \
    > "$out/megatron_check.log" 2>&1 || status=1
  grep -o '"check": "[^"]*"\|"passed": [a-z]*\|"mfu": [0-9.]*\|"tokens_per_s": [0-9.]*' "$out/megatron_check.jsonl" | paste -sd' '
fi
if [ "${VIME_GPU_SPEED_4B:-1}" = 1 ]; then
  timeout 200 python3 -m vime.bench.torch_train_speed --sizes 4b --heads chunked --compile on --pack off,on --gradient-checkpointing \
    --out "$out/torch_train_speed.jsonl" > "$out/torch_train_speed_4b.log" 2>&1 || status=1
  grep '^{"size"' "$out/torch_train_speed_4b.log"
fi
exit "$status"
