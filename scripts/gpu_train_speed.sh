#!/usr/bin/env bash
# Training throughput on the GPU machine (`vime.bench.train_speed`, and `vime.bench.megatron_check` for
# the Megatron backend's correctness checks), in parts; all of them take ~20 min, so a device call (at
# most 10 min) runs a few, named in VIME_GPU_SPEED_PARTS (default: all, in this order):
#   heads       the chunked LM head against full-vocabulary logits, 0.6B and 1.7B, eager
#   compile     --torch-compile, padded then packed (varlen attention), packed-vs-padded logprobs checked
#   optimizers  AdamW's kernels (fused, foreach) at 1.7B compiled: step time and peak memory
#   microbatch  micro-batch token budgets: 1.7B at 32k tokens, 4B without checkpointing at 8k
#   4b          4B with activation checkpointing, compiled, padded and packed
#   backends    the torch and Megatron backends side by side at 1.7B and 4B, eager and compiled
#   moe         a Qwen3-30B-A3B layer shape (4 layers, 128 experts, top-8), torch backend, eager and compiled
#   moe-megatron  the same shape on the Megatron backend (eager; experts as megatron-core's SequentialMLP)
#   megatron    megatron_check: logits vs transformers, training, R3, the chunked head, resume, the 0.6B speed check
#   profile     the top kernels of one compiled 1.7B step per backend
# Carry `.vllm-cuda/deps` (vime's pure dependencies and megatron-core for Python 3.12, made by
# `../shared/gpu/prepare-vllm-cuda.sh`). Results: $OUT (or /tmp/vime-gpu) as JSON lines and logs.
#   VIME_GPU_SPEED_PARTS="optimizers backends" bash scripts/gpu_train_speed.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/vime-gpu}"; mkdir -p "$out"
site=/tmp/vime-train-site
[ -d "$site/megatron" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .vllm-cuda/deps/*.whl
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 VIME_LOG_LEVEL=WARNING
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
parts="${VIME_GPU_SPEED_PARTS:-heads compile optimizers microbatch 4b backends moe moe-megatron megatron profile}"
status=0

speed() {  # speed NAME TIMEOUT ARGS...: one bench run, its log in $out/NAME.log, its rows printed
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  timeout "$limit" python3 -m vime.bench.train_speed "$@" --out "$out/train_speed.jsonl" > "$out/$name.log" 2>&1 || status=1
  grep '^{"size"' "$out/$name.log" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    keys = ("size", "layers", "backend", "head", "compiled", "packed", "optimizer", "max_tokens_per_micro_batch",
            "gradient_checkpointing", "step_s", "mfu", "peak_memory_gib", "first_step_s", "error", "check",
            "packed_vs_padded", "padded_vs_float32")
    print({k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in keys if k in r})'
}

for part in $parts; do
  case $part in
    heads) speed heads 240 --sizes 0.6b,1.7b --heads chunked,full ;;
    compile) speed compile 300 --sizes 0.6b,1.7b --heads chunked --compile on --pack off,on --check-pack ;;
    optimizers) speed optimizers 200 --sizes 1.7b --heads chunked --compile on --optimizer-implementation fused,foreach ;;
    microbatch)
      speed microbatch_1.7b 150 --sizes 1.7b --heads chunked --compile on --max-tokens-per-micro-batch 32768
      speed microbatch_4b 150 --sizes 4b --heads chunked --compile on --max-tokens-per-micro-batch 8192 ;;
    4b) speed 4b 200 --sizes 4b --heads chunked --compile on --pack off,on --gradient-checkpointing ;;
    backends)
      speed backends_1.7b 240 --sizes 1.7b --heads chunked --backends torch,megatron --compile off,on
      speed backends_4b 240 --sizes 4b --heads chunked --backends megatron --compile off,on --gradient-checkpointing ;;
    moe) speed moe 300 --sizes 30b-a3b --layers 4 --heads chunked --compile off,on --max-tokens-per-micro-batch 8192 ;;
    moe-megatron) speed moe_megatron 300 --sizes 30b-a3b --layers 4 --heads chunked --backends megatron --compile off \
      --max-tokens-per-micro-batch 8192 ;;
    megatron)
      echo "== megatron_check"
      timeout 360 python3 -m vime.bench.megatron_check --only logits train r3 head resume speed --out "$out/megatron_check.jsonl" \
        > "$out/megatron_check.log" 2>&1 || status=1
      grep -o '"check": "[^"]*"\|"passed": [a-z]*\|"mfu": [0-9.]*\|"tokens_per_s": [0-9.]*\|"error": "[^"]*"' \
        "$out/megatron_check.jsonl" | paste -sd' ' ;;
    profile) speed profile 240 --sizes 1.7b --heads chunked --backends torch,megatron --compile on --steps 2 \
      --profile-dir "$out/profiles" ;;
    *) echo "unknown part: $part" >&2; status=2 ;;
  esac
done
exit "$status"
