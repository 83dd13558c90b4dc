#!/usr/bin/env bash
# The Megatron backend's whole GPU check, in one call on a GPU machine without a package index.
# From the repo root, with the wheels in .whl/ (megatron-core 0.19.2 for Python 3.12, structlog):
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
python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" tests/test_megatron_mapping.py tests/test_megatron_backend.py 2>&1 | tee "$out/pytest.log" || status=1
python3 -m vime.bench.megatron_check --out "$out/megatron_check.jsonl" --profile-dir "$out" "$@" || status=1
exit "$status"
