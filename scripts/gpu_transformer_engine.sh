#!/usr/bin/env bash
# TransformerEngine on the GPU machine: install the wheels `scripts/prepare-te-cuda.sh` made, check that TE
# loads and runs a layer, then the parts named in VIME_TE_PARTS (default: all, in this order):
#   bench   bench/megatron_te.py: megatron-core's decoder alone, local specs against TE's, per VIME_TE_SIZES
#   check   vime.bench.megatron_check --transformer-impl transformer_engine: logits against transformers
#           (and the weight names the HF mapping expects), training, R3, export, resume, the chunked head
#   check-local  megatron_check's resume check with the local layers
#   check-no-tf32  TE's float32 logits and chunked-head checks with NVIDIA_TF32_OVERRIDE=0
#   speed   vime.bench.train_speed, the Megatron backend's whole training step at 1.7B, local and TE, with
#           the top kernels of one more step (profiles/)
#   4b      the same (no profile) at 4B with full recompute (VIME_TE_4B_LAYERS cuts its 36 layers where
#           80 GB cannot hold the whole model's weights, gradients and optimizer state)
#   moe     the same at the Qwen3-30B-A3B layer shape (4 layers)
# Results in $OUT (or /tmp/vime-gpu) as one archive, te_results.tgz (the device hands back at most 8 files):
# te_install.log, te_smoke.log, megatron_te.jsonl, megatron_check_*.jsonl, train_speed.jsonl, a log per
# part and profiles/.
#
# Before the first call (each its own call, back to back while the machine is warm):
#   carry .vllm-cuda/deps:  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vime-train-site .vllm-cuda/deps/*.whl
#   carry .te-cuda/p00:     mkdir -p /tmp/tw && cp .te-cuda/p00 /tmp/tw/      (and so on, all parts but the last)
# The first call carries the last part and .te-cuda/install.sh (later calls on the warm machine need neither):
#   VIME_TE_PARTS="check speed" bash scripts/gpu_transformer_engine.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/vime-gpu}"; mkdir -p "$out"
site=/tmp/vime-train-site
[ -d "$site/megatron" ] || { echo "megatron-core is not in $site: bring .vllm-cuda/deps first (see the header)" >&2; exit 2; }
if [ ! -d /tmp/te-site/transformer_engine ]; then
  bash .te-cuda/install.sh > "$out/te_install.log" 2>&1 || { tail -20 "$out/te_install.log"; exit 1; }
fi
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
tail -2 "$out/te_smoke.log"

speed() {  # speed NAME TIMEOUT ARGS...: train_speed of the Megatron backend, local then TE layers, each in
  # its own process (a Megatron trainer does not hand all its GPU memory back when deleted)
  local name=$1 limit=$2 impl; shift 2
  echo "== $name: $*"
  for impl in local transformer_engine; do
    timeout "$limit" python3 -m vime.bench.train_speed --backends megatron --heads chunked --transformer-impl "$impl" \
      "$@" --out "$out/train_speed.jsonl" >> "$out/$name.log" 2>&1 || status=1
  done
  grep '^{"size"' "$out/$name.log" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    keys = ("size", "layers", "transformer_impl", "step_s", "tokens_per_s", "mfu", "peak_memory_gib", "first_step_s", "error")
    print({k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in keys if k in r})
    for kernel in r.get("top_kernels", [])[:6]:
        print("   ", round(kernel["share"], 3), kernel["name"])'
}

for part in ${VIME_TE_PARTS:-bench check check-local check-no-tf32 speed 4b moe}; do
  case $part in
    bench)
      for size in ${VIME_TE_SIZES:-1.7b 4b}; do
        echo "== megatron_te $size"
        timeout 240 python3 bench/megatron_te.py --size "$size" --json > "$out/megatron_te_$size.log" 2>&1 || status=1
        grep '^{' "$out/megatron_te_$size.log" | tee -a "$out/megatron_te.jsonl" | cut -c1-400
        grep -v '^{' "$out/megatron_te_$size.log" | grep -i -m3 "error\|traceback" || true
      done ;;
    check|check-local|check-no-tf32)
      impl=transformer_engine; checks="logits train r3 head resume"; tag=$impl; tf32=
      [ "$part" = check-local ] && { impl=local; checks="resume"; tag=local; }
      # the float32 checks again with TF32 off in every CUDA library (is TE's float32 gap TF32's?)
      [ "$part" = check-no-tf32 ] && { checks="logits head"; tag=te_no_tf32; tf32=0; }
      echo "== megatron_check --transformer-impl $impl --only $checks ${tf32:+(NVIDIA_TF32_OVERRIDE=0)}"
      env ${tf32:+NVIDIA_TF32_OVERRIDE=0} timeout 360 python3 -m vime.bench.megatron_check --transformer-impl "$impl" \
        --only $checks --out "$out/megatron_check_$tag.jsonl" > "$out/megatron_check_$tag.log" 2>&1 || status=1
      grep -o '"check": "[^"]*"\|"passed": [a-z]*\|"rel_error": [0-9.e-]*\|"logprob_max_diff": [0-9.e-]*\|"error": "[^"]*"' \
        "$out/megatron_check_$tag.log" | paste -sd' ' ;;
    speed) speed speed_1.7b 150 --sizes 1.7b --profile-dir "$out/profiles" ;;
    4b) speed speed_4b 300 --sizes 4b --gradient-checkpointing ${VIME_TE_4B_LAYERS:+--layers $VIME_TE_4B_LAYERS} ;;
    moe) speed speed_moe 300 --sizes 30b-a3b --layers 4 --max-tokens-per-micro-batch 8192 ;;
    *) echo "unknown part: $part" >&2; status=2 ;;
  esac
done
# The device hands back at most 8 files: everything above goes back as one archive.
tar -C "$out" -czf /tmp/te_results.tgz . && find "$out" -mindepth 1 -delete && mv /tmp/te_results.tgz "$out/"
exit "$status"
