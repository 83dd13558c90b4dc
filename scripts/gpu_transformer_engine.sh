#!/usr/bin/env bash
# TransformerEngine on the GPU machine: install the wheels `scripts/prepare-te-cuda.sh` made, check that TE
# loads and runs a layer, then `bench/megatron_te.py` (megatron-core's decoder with vime's local specs
# against megatron-core's TE specs). Results in $OUT (or /tmp/vime-gpu): te_install.log, te_smoke.log,
# megatron_te.jsonl and its log.
#
# Before this call (each its own call, back to back while the machine is warm):
#   carry .vllm-cuda/deps:  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vime-train-site .vllm-cuda/deps/*.whl
#   carry .te-cuda/p00:     mkdir -p /tmp/tw && cp .te-cuda/p00 /tmp/tw/      (and so on, all parts but the last)
# This call carries the last part and .te-cuda/install.sh:
#   VIME_TE_SIZES="1.7b 4b" bash scripts/gpu_transformer_engine.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/vime-gpu}"; mkdir -p "$out"
site=/tmp/vime-train-site
[ -d "$site/megatron" ] || { echo "megatron-core is not in $site: bring .vllm-cuda/deps first (see the header)" >&2; exit 2; }
bash .te-cuda/install.sh > "$out/te_install.log" 2>&1 || { tail -20 "$out/te_install.log"; exit 1; }
export PYTHONPATH="/tmp/te-site:$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 VIME_LOG_LEVEL=WARNING
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
status=0

echo "== smoke: import transformer_engine.pytorch, one TransformerLayer forward + backward"
timeout 120 python3 - > "$out/te_smoke.log" 2>&1 <<'EOF' || status=1
import torch
import transformer_engine
import transformer_engine.pytorch as te

print("transformer_engine", transformer_engine.__version__, "torch", torch.__version__)
layer = te.TransformerLayer(2048, 6144, 16, num_gqa_groups=8, normalization="RMSNorm", activation="swiglu",
                            self_attn_mask_type="causal", params_dtype=torch.bfloat16, hidden_dropout=0.0,
                            attention_dropout=0.0).cuda()
x = torch.randn(1024, 2, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y = layer(x)
y.float().square().mean().backward()
torch.cuda.synchronize()
print("ok", tuple(y.shape), float(x.grad.abs().mean()))
EOF
tail -3 "$out/te_smoke.log"

for size in ${VIME_TE_SIZES:-1.7b}; do
  echo "== megatron_te $size"
  timeout 240 python3 bench/megatron_te.py --size "$size" --json > "$out/megatron_te_$size.log" 2>&1 || status=1
  grep '^{' "$out/megatron_te_$size.log" | tee -a "$out/megatron_te.jsonl" | cut -c1-400
  grep -v '^{' "$out/megatron_te_$size.log" | grep -i -m3 "error\|traceback" || true
done
exit "$status"
