"""Training throughput of both trainer backends on real Qwen3 shapes, in one run: tokens/s, MFU and peak
GPU memory per size, backend and setting.

For each size (`--sizes`: the dense 0.6b/1.7b/4b/8b, or the mixture-of-experts 30b-a3b, whose layer
count `--layers` can cut), backend (`--backends torch,megatron`), head (`--heads`: the chunked LM head
or full-vocabulary logits), compile, packing and optimizer setting (and, on the Megatron backend,
`--transformer-impl`: its local layers or TransformerEngine's), one `train_step` (forward +
backward + AdamW) of an RL-like batch of random tokens: `--samples` sequences of `--prompt` prompt
tokens and response lengths spread evenly between half of `--response` and all of it. Prints one JSON
line per run: median step seconds, tokens/s, model TFLOP/s and MFU (`vime.bench.flops`, against
`--peak-tflops`; recompute not counted), peak GPU memory and peak memory per token, and what one weight
update exports (seconds, bytes: the adapter alone with `--lora-ranks`). `--check-pack` also
prints, per size, how far packed logprobs (flash varlen attention) are from padded ones (SDPA) in the
same bf16 model, beside how far bf16 is from float32; `--profile-dir` writes the top kernels of one
more step of each run.

    python -m vime.bench.train_speed --sizes 0.6b,1.7b --heads chunked,full --out speed.jsonl
    python -m vime.bench.train_speed --sizes 1.7b --heads chunked --compile off,on --pack off,on --check-pack
    python -m vime.bench.train_speed --sizes 1.7b --backends torch,megatron --compile on
    python -m vime.bench.train_speed --sizes 1.7b --backends megatron --transformer-impl local,transformer_engine
    python -m vime.bench.train_speed --sizes 30b-a3b --layers 4 --compile on
    python -m vime.bench.train_speed --sizes 1.7b,4b --heads chunked --compile on --lora-ranks 0,16

A run that runs out of memory prints its error line and the rest go on. Megatron runs of one process
share its GPU with the trainers before them (a deleted Megatron trainer does not hand all its memory back:
at 1.7B on an 80 GB card, TE after local ran out), so large sizes compare best one setting a process, as
`scripts/gpu_transformer_engine.sh` does. Megatron runs need the megatron-core package and one CUDA GPU
(a one-rank NCCL group is set up here).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vime.bench.flops import H200_BF16_PEAK_FLOPS, attention_seq_len, training_flops_per_token
from vime.demo.model_factory import make_qwen3_shape
from vime.trainer.batch import RolloutBatch, SampleRecord
from vime.trainer.torch_backend import TorchTrainer, TorchTrainerConfig


def rl_batch(vocab: int, samples: int, prompt: int, response: int, seed: int = 0) -> RolloutBatch:
    """Random tokens shaped like a rollout batch: groups of 8 sharing a prompt, varied response lengths."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(response // 2, response, samples).astype(int)
    prompts = [rng.integers(0, vocab, prompt) for _ in range(max(1, samples // 8))]
    recs = [
        SampleRecord(group_index=i // 8, prompt_tokens=prompts[min(i // 8, len(prompts) - 1)],
                     response_tokens=rng.integers(0, vocab, n), rollout_logprobs=np.full(n, -11.0, np.float32),
                     loss_mask=np.ones(n, np.uint8), reward=float(i % 2))  # fmt: skip
        for i, n in enumerate(lengths)
    ]
    return RolloutBatch.from_samples(recs)


def _trainer(backend: str, model: Path, setting: dict[str, Any], args: argparse.Namespace, **extra: Any) -> Any:
    common = dict(hf_checkpoint=str(model), lr=1e-5, max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                  chunked_head=setting["head"] == "chunked", torch_compile=setting["compiled"], **extra)  # fmt: skip
    if backend == "megatron":
        from vime.bench.megatron_check import _setup
        from vime.trainer.megatron.backend import MegatronTrainer, MegatronTrainerConfig
        from vime.trainer.megatron.parallel import MegatronParallelConfig

        _setup()
        recompute = dict(recompute_granularity="full", recompute_method="uniform") if args.gradient_checkpointing else {}
        parallel = MegatronParallelConfig(transformer_impl=setting["transformer_impl"], **recompute)
        return MegatronTrainer(MegatronTrainerConfig(**common, parallel=parallel))
    return TorchTrainer(TorchTrainerConfig(
        **common, device=args.device, gradient_checkpointing=args.gradient_checkpointing,
        pack_sequences="on" if setting["packed"] else "off", share_prompts=setting["shared_prompts"],
        optimizer_implementation=setting["optimizer"], lora_rank=setting["lora_rank"] or None,
    ))  # fmt: skip


def _profile(trainer: Any, batch: RolloutBatch, path: Path) -> list[dict[str, Any]]:
    """One more step under torch.profiler: its table by GPU time to `path`, and the top 10 kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.train_step(batch)
        torch.cuda.synchronize()
    events = prof.key_averages()
    path.write_text(events.table(sort_by="self_cuda_time_total", row_limit=40))
    total = sum(e.self_device_time_total for e in events) or 1.0
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:10]
    return [{"name": e.key[:80], "share": e.self_device_time_total / total} for e in top]


def measure(backend: str, model: Path, setting: dict[str, Any], batch: RolloutBatch, args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device == "cuda"
    trainer = _trainer(backend, model, setting, args)
    top_kernels = None
    try:
        t0 = time.perf_counter()
        trainer.train_step(batch)  # warm-up: allocator, kernels, compilation
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        first_step = time.perf_counter() - t0
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            trainer.train_step(batch)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        update = _update_cost(trainer, cuda)
        if args.profile_dir and cuda:
            name = "_".join(f"{k}-{v}" for k, v in setting.items())
            top_kernels = _profile(trainer, batch, Path(args.profile_dir) / f"profile_{model.name}_{backend}_{name}.txt")
    finally:
        del trainer
        if cuda:
            torch.cuda.empty_cache()
    config = json.loads((model / "config.json").read_text())
    tokens = int(batch.tokens.numel())
    seq = attention_seq_len(batch.seq_offsets.diff().tolist())
    step = float(np.median(times))
    flops = tokens * training_flops_per_token(config, seq)
    row = {"backend": backend, **setting, "first_step_s": first_step, "step_s": step, "steps_s": times,
           "tokens": tokens, "tokens_per_s": tokens / step, "tflops": flops / step / 1e12,
           "mfu": flops / step / (args.peak_tflops * 1e12), "peak_memory_gib": peak / 2**30,
           "peak_memory_mib_per_token": peak / 2**20 / tokens, **update}  # fmt: skip
    if top_kernels is not None:
        row["top_kernels"] = top_kernels
    return row


def _update_cost(trainer: Any, cuda: bool) -> dict[str, Any]:
    """What one weight update exports on the trainer (bf16, to host memory, as `publish_weights` does
    before it copies into the channel): the adapter alone under LoRA, every weight otherwise."""
    if not isinstance(trainer, TorchTrainer):
        return {}
    t0 = time.perf_counter()
    if trainer.lora is not None:
        adapter = trainer.export_adapter(dtype=torch.bfloat16)
        tensors = [] if adapter is None else list(adapter.tensors.values())
    else:
        tensors = [tensor for _, tensor in trainer.export_weights(dtype=torch.bfloat16)]
    if cuda:
        torch.cuda.synchronize()
    return {"update_export_s": time.perf_counter() - t0, "update_bytes": sum(t.numel() * t.element_size() for t in tensors)}


def pack_check(model: Path, batch: RolloutBatch, args: argparse.Namespace) -> dict[str, Any]:
    """Logprob differences: packed vs padded (both in the compute dtype), and the compute dtype vs float32."""
    logprobs = {}
    for name, pack, dtype in (("packed", "on", "auto"), ("padded", "off", "auto"), ("float32", "off", "float32")):
        cfg = TorchTrainerConfig(hf_checkpoint=str(model), device=args.device, pack_sequences=pack, dtype=dtype,
                                 max_tokens_per_micro_batch=args.max_tokens_per_micro_batch)  # fmt: skip
        trainer = TorchTrainer(cfg)
        logprobs[name] = np.concatenate(trainer.compute_logprobs(batch))
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def diff(a: str, b: str) -> dict[str, float]:
        d = np.abs(logprobs[a] - logprobs[b])
        return {"mean": float(d.mean()), "max": float(d.max())}

    return {"check": "pack", "packed_vs_padded": diff("packed", "padded"), "padded_vs_float32": diff("padded", "float32"),
            "packed_vs_float32": diff("packed", "float32"), "tokens": int(logprobs["packed"].size)}  # fmt: skip


def settings(args: argparse.Namespace, backend: str) -> list[dict[str, Any]]:
    """Every combination of the flags' settings that applies to `backend` (the micro-batch layouts and
    the optimizer implementation are the torch backend's; packed and shared-prompt rows exclude each other)."""
    packs = args.pack.split(",") if backend == "torch" else ["off"]
    shares = args.share_prompts.split(",") if backend == "torch" else ["off"]
    optimizers = args.optimizer_implementation.split(",") if backend == "torch" else ["megatron"]
    ranks = [int(r) for r in args.lora_ranks.split(",")] if backend == "torch" else [0]
    impls = args.transformer_impl.split(",") if backend == "megatron" else [None]
    return [
        {"head": h, "compiled": c == "on", "packed": p == "on", "shared_prompts": sp == "on", "optimizer": o, "lora_rank": r,
         **({"transformer_impl": t} if t else {})}
        for h in args.heads.split(",") for c in args.compile.split(",") for p in packs for sp in shares
        for o in optimizers for r in ranks for t in impls if not (p == "on" and sp == "on")
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.6b,1.7b", help="Qwen3 shapes: 0.6b, 1.7b, 4b, 8b, 30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="replace each size's layer count (MoE layer shapes)")
    parser.add_argument("--backends", default="torch", help="torch, megatron or torch,megatron")
    parser.add_argument("--heads", default="chunked,full", help="chunked (the default head), full (full-vocabulary logits)")
    parser.add_argument("--compile", default="off", help="off, on or off,on: torch.compile the decoder layers")
    parser.add_argument("--pack", default="off", help="off, on or off,on: packed micro-batches, varlen attention (torch)")
    parser.add_argument("--share-prompts", default="off", help="off, on or off,on: a group's samples share one "
                        "prompt copy per row (torch)")
    parser.add_argument("--optimizer-implementation", default="auto",
                        help="AdamW kernels of the torch backend: auto, fused, foreach, for-loop, or a list")
    parser.add_argument("--lora-ranks", default="0", help="0 (every weight trains), a LoRA rank, or a list such as "
                        "0,16 (torch; peft's default target modules, alpha 32)")
    parser.add_argument("--transformer-impl", default="local",
                        help="Megatron backend: local, transformer_engine or local,transformer_engine")
    parser.add_argument("--check-pack", action="store_true", help="compare packed and padded logprobs per size first")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=2048)
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=16384)
    parser.add_argument("--gradient-checkpointing", action="store_true", help="torch: per layer; Megatron: full recompute")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run (no memory figures)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_FLOPS / 1e12)
    parser.add_argument("--profile-dir", default=None, help="profile one more step of each run; tables go here")
    parser.add_argument("--out", default=None, help="append the JSON lines here too")
    args = parser.parse_args(argv)
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)

    def emit(row: dict[str, Any]) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            model = make_qwen3_shape(Path(tmp) / size, size, num_layers=args.layers)
            batch = rl_batch(151936, args.samples, args.prompt, args.response)
            label = {"size": size, "layers": json.loads((model / "config.json").read_text())["num_hidden_layers"],
                     "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch,
                     "gradient_checkpointing": args.gradient_checkpointing}  # fmt: skip
            if args.check_pack:
                emit({**label, **pack_check(model, batch, args)})
            for backend in args.backends.split(","):
                for setting in settings(args, backend):
                    try:
                        emit({**label, **measure(backend, model, setting, batch, args)})
                    except torch.OutOfMemoryError as exc:
                        emit({**label, "backend": backend, **setting, "error": f"out of memory: {str(exc)[:200]}"})
                        if torch.cuda.is_available():
                            torch.cuda.empty_cache()
                    except Exception as exc:  # report and go on: one device call should measure everything it can
                        emit({**label, "backend": backend, **setting, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
                        if torch.cuda.is_available():
                            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
