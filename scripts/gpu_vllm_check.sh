#!/usr/bin/env bash
# The vLLM rollout path's GPU check, on a GPU machine without a package index, in as few runs as its
# 10-minute limit allows. vLLM 0.26.0 (the CUDA build that matches torch 2.11) must be installed in
# /tmp/vllm-site first: `../shared/gpu/prepare-vllm-cuda.sh` prepares it (three runs; see its header).
#   bash scripts/gpu_vllm_check.sh tests      # the vLLM and R3 test files, nothing skipped
#   bash scripts/gpu_vllm_check.sh pipeline   # the demo with vLLM rollouts: torch, megatron, colocate-free split
#   bash scripts/gpu_vllm_check.sh sizes      # GRPO steps at real Qwen3 sizes, async vs sync (VIME_GPU_SIZES)
#   bash scripts/gpu_vllm_check.sh bench      # vLLM alone vs vime's engine at real Qwen3 sizes
# Parts can be given together (`tests pipeline`); results go to $OUT (or /tmp/vime-gpu) as logs + JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="/tmp/vllm-site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out="${OUT:-/tmp/vime-gpu}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import sys, torch, transformers, vllm; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)' || exit 1
status=0
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
learned() {  # mean raw reward of the first and last 5 steps of a run's metrics.jsonl
  python3 - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
r = [row["rollout/raw_reward"] for row in rows if "rollout/raw_reward" in row]
print(json.dumps({"run": sys.argv[1], "steps": len(r), "first5": sum(r[:5]) / 5, "last5": sum(r[-5:]) / 5}))
PY
}
for part in "${@:-tests}"; do
  case "$part" in
  tests)
    timeout 540 python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" tests/test_vllm_versions.py \
      tests/test_rollout_vllm.py tests/test_e2e_r3.py "tests/test_e2e.py::test_async_pipeline_with_vllm_rollouts_and_two_trainer_ranks" \
      2>&1 | tee "$out/pytest_vllm.log" || status=1
    ;;
  pipeline)
    # The CPU demo's task with vLLM rollouts on the GPU: split layout (engine and trainer share the GPU's
    # memory), torch backend, then the Megatron backend on the same demo model.
    for backend in torch megatron; do
      run=/tmp/vime-gpu-vllm-$backend; rm -rf "$run"
      extra=(); [ "$backend" = megatron ] && extra=(--no-make-demo-model)
      timeout 280 python3 -m vime.cli run configs/demo.yaml --rollout-engine vllm --train-backend "$backend" \
        --num-rollout "${VIME_GPU_STEPS:-100}" --run-dir "$run" --hf-checkpoint /tmp/vime-gpu-demo-model \
        --vllm-gpu-memory-utilization 0.3 --no-progress --broker-address "tcp://127.0.0.1:$(free_port)" \
        --min-reward-gain 0.2 "${extra[@]}" 2>&1 | tail -n 25 | tee "$out/pipeline_$backend.log" || status=1
      learned "$run/metrics.jsonl" | tee -a "$out/pipeline.jsonl" || status=1
      cp "$run/metrics.jsonl" "$out/pipeline_${backend}_metrics.jsonl" 2>/dev/null || true
    done
    ;;
  sizes)
    # GRPO steps at real Qwen3 sizes (random init, the demo task and tokenizer padded to 151936), async
    # (--max-staleness 2) then sync (0): step-time breakdown, engine idle and trainer wait fractions.
    for size in ${VIME_GPU_SIZES:-0.6b}; do
      model=/tmp/vime-qwen3-$size
      python3 -m vime.demo.model_factory --kind qwen3 --size "$size" --out "$model" > /dev/null || { status=1; continue; }
      timeout 560 python3 bench/step_breakdown.py --num-rollout "${VIME_GPU_STEPS:-6}" --json --port "$(free_port)" \
        --out "/tmp/vime-gpu-size-$size" -- --hf-checkpoint "$model" --no-make-demo-model --rollout-engine vllm \
        --rollout-max-response-len 1024 --micro-batch-size 4 --vllm-max-model-len 1152 \
        --vllm-gpu-memory-utilization 0.35 --no-progress 2>&1 | tail -n 3 | tee -a "$out/sizes.jsonl" || status=1
    done
    ;;
  bench)
    timeout 560 python3 -m vime.bench.vllm_gpu --out "$out/vllm_gpu.jsonl" 2>&1 | tee "$out/bench.log" || status=1
    ;;
  *) echo "unknown part: $part (tests, pipeline, sizes, bench)"; status=2 ;;
  esac
done
exit "$status"
