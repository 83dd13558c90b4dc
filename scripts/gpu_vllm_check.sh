#!/usr/bin/env bash
# The vLLM rollout path's GPU check, on a GPU machine without a package index, in as few runs as its
# 10-minute limit allows. vLLM 0.26.0 (the CUDA build that matches torch 2.11) must be installed in
# /tmp/vllm-site first: `../shared/gpu/prepare-vllm-cuda.sh` prepares it (three runs; see its header).
#   bash scripts/gpu_vllm_check.sh tests      # the vLLM and R3 test files, nothing skipped (VIME_GPU_TEST_IDS: some)
#   bash scripts/gpu_vllm_check.sh pipeline   # the demo with vLLM rollouts (VIME_GPU_LAYOUTS: torch megatron colocate megatron-colocate)
#   bash scripts/gpu_vllm_check.sh sizes      # GRPO steps at real Qwen3 sizes (VIME_GPU_SIZES; VIME_GPU_SIZE_MODES: async,sync,colocate)
#   bash scripts/gpu_vllm_check.sh bench      # vLLM alone vs vime's engine at real Qwen3 sizes
#   bash scripts/gpu_vllm_check.sh transport  # weight update by transport (chunks, CUDA IPC) and sleep/wake
#   bash scripts/gpu_vllm_check.sh r3         # vime bench r3 through vLLM's routed experts, deeper MoE
#   bash scripts/gpu_vllm_check.sh multiturn  # the agent tests (multi-turn R3 through vLLM) and the multi-turn demo
#   bash scripts/gpu_vllm_check.sh lora-train # the trainer with and without a LoRA adapter at 1.7B and 4B (VIME_GPU_LORA_SIZES)
# VIME_GPU_RUN_ARGS adds flags to every `vime run` of pipeline and sizes (e.g. "--lora-rank 16 --lr 2e-3");
# the pipeline's `lora` layout is the torch layout with the CPU demo's LoRA recipe: --lora-rank 16, --lr 2e-3
# (VIME_GPU_LORA_LR), --rollout-temperature 0.7 (VIME_GPU_LORA_TEMPERATURE; docs/lora.md says why).
# LoRA needs peft and accelerate: wheels in .vllm-cuda/lora (carry it) are installed into /tmp/vllm-site;
# fetch them beside the prepared vLLM with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform any \
#     -d .vllm-cuda/lora peft==0.21.2 accelerate==1.16.0
# Parts can be given together (`tests pipeline`); results go to $OUT (or /tmp/vime-gpu) as logs + JSON.
# To clear the GPU between calls, kill its compute processes by pid (nvidia-smi --query-compute-apps=pid):
# `pkill -f vime` would also match the calling shell, whose command line names this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="/tmp/vllm-site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out="${OUT:-/tmp/vime-gpu}"; mkdir -p "$out"
# vime runs from the checkout here, not installed: give importlib.metadata its entry points, so that
# vLLM's spawned engine processes load vime's owner watch (they must die with their rollout worker).
meta=/tmp/vllm-site/vime-0.0.0.dist-info; mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vime\nVersion: 0.0.0\n' > "$meta/METADATA"
sed -n '/^\[project.entry-points."vllm.general_plugins"\]/,/^$/p' pyproject.toml | sed 's/^\[project.entry-points."\(.*\)"\]/[\1]/' | tr -d '"' > "$meta/entry_points.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import sys, torch, transformers, vllm; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)' || exit 1
status=0
# The image's own peft may predate its transformers: the pinned one goes first on the path.
if [ -d .vllm-cuda/lora ] && ! python3 -c 'import peft, sys; sys.exit(peft.__version__ != "0.21.2")' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vllm-site .vllm-cuda/lora/*.whl || status=1
fi
run_args=(${VIME_GPU_RUN_ARGS:-})
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
    # VIME_GPU_TEST_IDS picks some of them (pytest node ids, space-separated) for a call with less time.
    # -s: a test cut off by the call's limit still leaves its progress in the log.
    ids=(${VIME_GPU_TEST_IDS:-tests/test_vllm_versions.py tests/test_rollout_vllm.py tests/test_e2e_r3.py tests/test_weight_ipc.py
      tests/test_colocate.py tests/test_vllm_owner_watch.py tests/test_rollout_stall.py tests/test_rollout_hf.py::test_the_engine_runs_on_the_device_it_is_given
      tests/test_e2e.py::test_async_pipeline_with_vllm_rollouts_and_two_trainer_ranks
      tests/test_e2e.py::test_colocated_vllm_engine_sleeps_and_takes_its_weights_over_cuda_ipc})
    timeout "${VIME_GPU_TESTS_S:-540}" python3 -m pytest -q -s -rs -p no:cacheprovider -o addopts="" "${ids[@]}" \
      2>&1 | tee "$out/pytest_vllm.log" || status=1
    ;;
  pipeline)
    # The CPU demo's task with vLLM rollouts on the GPU, `make demo`'s 300 steps and bar: split layout
    # (engine and trainer share the GPU's memory) with the torch and the Megatron backend, then
    # colocated (the engine sleeps at level 2 while the trainer steps; weights over CUDA IPC), with each backend.
    for layout in ${VIME_GPU_LAYOUTS:-torch megatron colocate megatron-colocate}; do
      run=/tmp/vime-gpu-vllm-$layout; rm -rf "$run"
      case "$layout" in
        torch) extra=(--train-backend torch --make-demo-model) ;;
        megatron) extra=(--train-backend megatron --make-demo-model) ;;
        colocate) extra=(--train-backend torch --make-demo-model --colocate) ;;
        megatron-colocate) extra=(--train-backend megatron --make-demo-model --colocate) ;;
        lora) extra=(--train-backend torch --make-demo-model --lora-rank 16 --lr "${VIME_GPU_LORA_LR:-2e-3}"
                     --rollout-temperature "${VIME_GPU_LORA_TEMPERATURE:-0.7}") ;;
        *) echo "unknown layout $layout"; status=2; continue ;;
      esac
      timeout "${VIME_GPU_RUN_S:-400}" python3 -m vime.cli run configs/demo.yaml --rollout-engine vllm \
        --num-rollout "${VIME_GPU_STEPS:-300}" --run-dir "$run" --hf-checkpoint /tmp/vime-gpu-demo-model \
        --vllm-gpu-memory-utilization 0.3 --no-progress --broker-address "tcp://127.0.0.1:$(free_port)" \
        --min-reward-gain "${VIME_GPU_MIN_GAIN:-0.3}" "${extra[@]}" "${run_args[@]}" 2>&1 | tail -n 25 | tee "$out/pipeline_$layout.log" || status=1
      learned "$run/metrics.jsonl" | tee -a "$out/pipeline.jsonl" || status=1
      cp "$run/metrics.jsonl" "$out/pipeline_${layout}_metrics.jsonl" 2>/dev/null || true
      cp "$run/logs/rollout-0.log" "$out/pipeline_${layout}_rollout.log" 2>/dev/null || true
    done
    ;;
  sizes)
    # GRPO steps at real Qwen3 sizes (random init, the demo task and tokenizer padded to 151936), async
    # (--max-staleness 2) then sync (0), or colocated (sync, the engine asleep while the trainer steps):
    # step-time breakdown, engine idle and trainer wait fractions.
    for size in ${VIME_GPU_SIZES:-0.6b}; do
      model=/tmp/vime-qwen3-$size
      python3 -m vime.demo.model_factory --kind qwen3 --size "$size" --out "$model" > /dev/null || { status=1; continue; }
      # 4B's fp32 master weights and AdamW state (64 GB) beside the engine leave no room for a whole
      # micro-batch's activations: recompute them in the backward.
      memory=(); [ "$size" = 4b ] && memory=(--gradient-checkpointing)
      # The JSON report goes to its own file (stdout); the runs' logs to another.
      timeout 560 python3 bench/step_breakdown.py --num-rollout "${VIME_GPU_SIZE_STEPS:-6}" --json --port "$(free_port)" \
        --modes "${VIME_GPU_SIZE_MODES:-async,sync}" --out "/tmp/vime-gpu-size-$size" -- --hf-checkpoint "$model" --no-make-demo-model --rollout-engine vllm \
        --rollout-max-response-len 1024 --micro-batch-size 4 --vllm-max-model-len 1152 \
        --vllm-gpu-memory-utilization 0.35 --no-progress "${memory[@]}" "${run_args[@]}" > "$out/sizes_$size.json" 2> "$out/sizes_$size.log" || status=1
      cat "$out/sizes_$size.json"
    done
    ;;
  bench)
    timeout 560 python3 -m vime.bench.vllm_gpu --out "$out/vllm_gpu.jsonl" 2>&1 | tee "$out/bench.log" || status=1
    ;;
  r3)
    # R3 through vLLM's routed experts on a deeper MoE (the Qwen3-30B-A3B layer shape, 4 layers), the
    # trainer on the GPU; then vime's transformers engine and the bench's own bf16 loop on the same model,
    # for the abs-diff cut (VIME_GPU_R3_ENGINES: some of them).
    for engine in ${VIME_GPU_R3_ENGINES:-vllm hf builtin}; do
      timeout 280 python3 -m vime.cli bench r3 --json --rollout-engine "$engine" --device cuda --num-layers 4 \
        --hidden-size 2048 --num-heads 32 --num-kv-heads 4 --head-dim 128 --num-experts 128 --top-k 8 \
        --moe-intermediate-size 768 --sft-steps "${VIME_GPU_R3_SFT:-100}" --threads 8 > "$out/r3_$engine.json" \
        2> "$out/r3_$engine.log" || status=1
      cat "$out/r3_$engine.json"
    done
    ;;
  transport)
    timeout 560 python3 -m vime.bench.weight_transport --sizes "${VIME_GPU_TRANSPORT_SIZES:-0.6b,1.7b,4b}" \
      --out "$out/weight_transport.jsonl" 2>&1 | tee "$out/transport.log" | grep '^{"bench"' || status=1
    ;;
  multiturn)
    # Multi-turn rollouts on the GPU: the R3 trace of a multi-turn trajectory through vLLM's prefix cache
    # (VIME_GPU_TEST_IDS: more, e.g. tests/test_e2e_multiturn.py), then the multi-turn demo with vLLM
    # rollouts and its learning bar.
    ids=(${VIME_GPU_TEST_IDS:-tests/test_e2e_r3.py::test_vllm_cuda_returns_routing_traces})
    timeout "${VIME_GPU_TESTS_S:-200}" python3 -m pytest -q -s -rs -p no:cacheprovider -o addopts="" "${ids[@]}" \
      2>&1 | tee "$out/pytest_multiturn.log" || status=1
    run=/tmp/vime-gpu-vllm-multiturn; rm -rf "$run"
    timeout "${VIME_GPU_RUN_S:-400}" python3 -m vime.cli run configs/demo-multiturn.yaml --rollout-engine vllm \
      --run-dir "$run" --hf-checkpoint /tmp/vime-gpu-multiturn-model --vllm-gpu-memory-utilization 0.3 --no-progress \
      --broker-address "tcp://127.0.0.1:$(free_port)" --min-reward-gain "${VIME_GPU_MIN_GAIN:-0.3}" \
      2>&1 | tail -n 25 | tee "$out/multiturn.log" || status=1
    learned "$run/metrics.jsonl" | tee -a "$out/multiturn.jsonl" || status=1
    cp "$run/metrics.jsonl" "$out/multiturn_metrics.jsonl" 2>/dev/null || true
    ;;
  lora-train)
    # One trainer step at real Qwen3 shapes, every weight trained against a rank-16 adapter (eager, the
    # chunked head, 16 x (512 + up to 2048) tokens): step time, tokens/s, peak memory, and what one weight
    # update exports (the adapter alone under LoRA).
    timeout "${VIME_GPU_RUN_S:-400}" python3 -m vime.bench.train_speed --sizes "${VIME_GPU_LORA_SIZES:-1.7b,4b}" --heads chunked \
      --max-tokens-per-micro-batch 8192 --lora-ranks 0,16 --out "$out/lora_train.jsonl" > "$out/lora_train.log" 2>&1 || status=1
    grep '^{"size"' "$out/lora_train.log" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    keys = ("size", "lora_rank", "step_s", "tokens_per_s", "mfu", "peak_memory_gib", "update_export_s", "update_bytes", "error")
    print({k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in keys if k in r})'
    ;;
  *) echo "unknown part: $part (tests, pipeline, sizes, bench, transport, r3, multiturn, lora-train)"; status=2 ;;
  esac
done
exit "$status"
