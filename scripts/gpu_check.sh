#!/usr/bin/env bash
# The Megatron backend's whole GPU check, in one call on a GPU machine without a package index.
# From the repo root, with the wheels in .whl/ (megatron-core 0.19.2 for Python 3.12, and vime's pure
# dependencies the GPU image lacks: docs/megatron.md lists them). VIME_GPU_CHECKS=0 / VIME_GPU_E2E=0 /
# VIME_GPU_PARALLEL=0 skip parts; the parallel-layout check needs 2+ GPUs.
#   bash scripts/gpu_check.sh            # writes $OUT/megatron_check.jsonl when OUT is set
# Fetch the wheels on a machine with pip: see docs/megatron.md ("GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/vime-site .whl/*.whl
export PYTHONPATH="/tmp/vime-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off on shared hosts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import sys, torch, transformers, megatron.core as m; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "megatron-core", m.__version__)'
status=0
if [ "${VIME_GPU_CHECKS:-1}" = 1 ]; then
python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" tests/test_megatron_mapping.py tests/test_megatron_backend.py 2>&1 | tee "$out/pytest.log" || status=1
python3 -m vime.bench.megatron_check --out "$out/megatron_check.jsonl" --profile-dir "$out" "$@" || status=1
fi
# Parallel layouts (TP, TP+SP, PP, EP) against plain data parallel, one process per GPU.
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "${VIME_GPU_PARALLEL:-1}" = 1 ] && [ "$gpus" -ge 2 ]; then
  OUT="$out" torchrun --standalone --nproc_per_node 2 -m vime.bench.megatron_parallel_check || status=1
fi
# The whole pipeline (broker, transformers rollout worker, reward worker) with the Megatron trainer: the CPU
# demo's GRPO task, 60 steps (needs pyzmq, msgspec, pydantic wheels too; skipped with VIME_GPU_E2E=0).
# It stops after 40 steps (checkpoints every 20), then `--load latest` resumes it to 60: the broker
# continues from its journal, the trainer from its step-40 checkpoint.
if [ "${VIME_GPU_E2E:-1}" = 1 ]; then
  rm -rf /tmp/vime-gpu-e2e
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  e2e=(configs/demo.yaml --train-backend megatron --rollout-engine hf --save-interval 20
       --run-dir /tmp/vime-gpu-e2e --hf-checkpoint /tmp/vime-gpu-e2e-model --no-progress
       --broker-address "tcp://127.0.0.1:$port")
  python3 -m vime.cli run "${e2e[@]}" --num-rollout 40 || status=1
  python3 -m vime.cli run "${e2e[@]}" --num-rollout 60 --no-make-demo-model --load latest || status=1
  cp /tmp/vime-gpu-e2e/metrics.jsonl "$out/e2e_metrics.jsonl" 2>/dev/null || true
  cp /tmp/vime-gpu-e2e/status.json "$out/e2e_status.json" 2>/dev/null || true
  python3 -m vime.cli report /tmp/vime-gpu-e2e 2>&1 | tail -15 || status=1
fi
exit "$status"
