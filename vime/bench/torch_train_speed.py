"""Training throughput of the torch backend on real Qwen3 shapes: the chunked LM head against full
logits, with or without torch.compile of the decoder layers (`--compile off,on`), padded or packed
micro-batches (`--pack off,on`).

For each size, head, compile and packing setting, one `TorchTrainer.train_step` (forward + backward + AdamW) of
an RL-like batch of random tokens: `--samples` sequences of `--prompt` prompt tokens and response lengths spread evenly
between half of `--response` and all of it. Prints one JSON line per run: median step seconds,
tokens/s, model TFLOP/s and MFU (`vime.bench.flops`, against `--peak-tflops`), peak GPU memory and
peak memory per token. `--check-pack` also prints, per size, how far packed logprobs (flash varlen
attention) are from padded ones (SDPA) in the same bf16 model, beside how far bf16 is from float32.

    python -m vime.bench.torch_train_speed --sizes 0.6b,1.7b --heads chunked,full --out speed.jsonl
    python -m vime.bench.torch_train_speed --sizes 1.7b --heads chunked --compile off,on --pack off,on --check-pack
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

from vime.bench.flops import H200_BF16_PEAK_FLOPS, training_flops_per_token
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


def measure(
    model: Path, head: str, compiled: bool, packed: bool, batch: RolloutBatch, args: argparse.Namespace
) -> dict[str, Any]:
    cuda = args.device == "cuda"
    cfg = TorchTrainerConfig(hf_checkpoint=str(model), lr=1e-5, device=args.device, chunked_head=head == "chunked",
                             max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                             gradient_checkpointing=args.gradient_checkpointing, torch_compile=compiled,
                             pack_sequences="on" if packed else "off")  # fmt: skip
    trainer = TorchTrainer(cfg)
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
        config = trainer.hf_model.config
    finally:
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        del trainer
        if cuda:
            torch.cuda.empty_cache()
    tokens = int(batch.tokens.numel())
    seq = tokens / batch.num_samples
    step = float(np.median(times))
    flops = tokens * training_flops_per_token(config, seq)
    return {"head": head, "compiled": compiled, "packed": packed, "first_step_s": first_step, "step_s": step, "steps_s": times,
            "tokens": tokens, "tokens_per_s": tokens / step,
            "tflops": flops / step / 1e12, "mfu": flops / step / (args.peak_tflops * 1e12),
            "peak_memory_gib": peak / 2**30, "peak_memory_mib_per_token": peak / 2**20 / tokens}  # fmt: skip


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.6b,1.7b")
    parser.add_argument("--heads", default="chunked,full", help="chunked (the default head), full (full-vocabulary logits)")
    parser.add_argument("--compile", default="off", help="off, on or off,on: torch.compile the decoder layers")
    parser.add_argument("--pack", default="off", help="off, on or off,on: packed micro-batches, varlen attention")
    parser.add_argument("--check-pack", action="store_true", help="compare packed and padded logprobs per size first")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=2048)
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=16384)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run (no memory figures)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_FLOPS / 1e12)
    parser.add_argument("--out", default=None, help="append the JSON lines here too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            model = make_qwen3_shape(Path(tmp) / size, size)
            batch = rl_batch(151936, args.samples, args.prompt, args.response)
            rows: list[Any] = [("check",)] if args.check_pack else []
            rows += [(h, c == "on", p == "on") for h in args.heads.split(",") for c in args.compile.split(",")
                     for p in args.pack.split(",")]  # fmt: skip
            for head, *options in rows:
                try:
                    result = pack_check(model, batch, args) if head == "check" else measure(model, head, *options, batch, args)
                    row = {"size": size, **result}
                except torch.OutOfMemoryError as exc:
                    row = {"size": size, "head": head, "error": f"out of memory: {str(exc)[:200]}"}
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                line = json.dumps(row)
                print(line, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
