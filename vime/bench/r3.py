"""`vime bench r3`: how much R3 (rollout routing replay) cuts the trainer/rollout logprob mismatch.

Setup, all on CPU:
1. a tiny Qwen3-MoE (64 experts, top-4 by default: with few experts bf16 and fp32 almost never route
   apart) is SFT-trained briefly on the demo arithmetic task (with the usual load-balancing loss), so
   its routers are peaked like a trained model's rather than uniform;
2. the "rollout engine" is a bf16 copy of those weights (what a trainer exports to vLLM/SGLang). It
   samples GRPO-style groups with a KV cache at temperature 1, recording each token's experts with
   `RoutingRecorder` and its logprobs (fp32 log-softmax of the bf16 logits, as engines do);
3. the "trainer" is `TorchTrainer` in float32 on the same checkpoint, run once with
   `use_rollout_routing_replay` off and once on, over the very same samples. One `train_step` with
   lr 0 (weights do not move) yields exactly the metrics a run logs every step:
   `train/train_rollout_logprob_abs_diff` and `train/routing_agreement` (routes the trainer used).

Printed (with --json as one JSON object): abs_diff_no_r3, abs_diff_r3, their relative reduction,
routing_agreement_no_r3, routing_agreement_r3 (measured inside the replayed forward) and
routing_agreement_unreplayed (the trainer's own routes, from the replay-on run; equals no_r3).

`--rollout-engine hf|vllm` samples step 2 with one of vime's rollout engines instead (its own routing
capture: the transformers engine's hooks, or vLLM's routed experts on CUDA), one request per prompt with
`samples_per_prompt` samples, as a rollout worker sends them. `--device cuda` runs the SFT and the
trainer on the GPU, for shapes too big for the CPU, e.g. the Qwen3-30B-A3B layer shape with 4 layers:
`--num-layers 4 --hidden-size 2048 --num-heads 32 --num-kv-heads 4 --head-dim 128 --num-experts 128
--top-k 8 --moe-intermediate-size 768`.

What R3 cannot remove: the dense part of the mismatch. With identical experts, bf16 vs fp32 still
differ in attention, norms, the expert and LM-head matmuls; R3 only removes the extra error of tokens
whose expert set flipped (and everything downstream of the flip).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class R3BenchConfig:
    seed: int = 0
    num_layers: int = 2
    hidden_size: int = 64
    num_experts: int = 64
    top_k: int = 4
    moe_intermediate_size: int = 16
    sft_steps: int = 300
    sft_batch_size: int = 32
    sft_lr: float = 3e-3
    router_aux_loss_coef: float = 0.01
    prompts: int = 64
    samples_per_prompt: int = 4
    max_new_tokens: int = 12
    threads: int = 1  # 1: bit-reproducible (multi-threaded CPU kernels reorder float sums)
    trainer_dtype: str = "float32"  # or "bfloat16": bf16 autocast over fp32 weights vs the engine's pure bf16
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    rollout_engine: str = "builtin"  # builtin (the KV-cache loop below) | hf | vllm (vime's engines)
    device: str = "cpu"  # where the SFT and the trainer run


def _sft(model: Any, cfg: R3BenchConfig) -> float:
    """Brief SFT on demo arithmetic (answer tokens only, plus the router load-balancing loss)."""
    import torch

    from vime.demo.model_factory import _training_batch

    rng = random.Random(cfg.seed)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = cfg.router_aux_loss_coef
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    loss = torch.zeros(())
    for _ in range(cfg.sft_steps):
        ids, mask = (t.to(cfg.device) for t in _training_batch(rng, cfg.sft_batch_size, digits=3))
        labels = ids.masked_fill(mask == 0, -100)
        out = model(input_ids=ids, labels=labels, use_cache=False)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.config.output_router_logits = False
    model.eval()
    return float(loss.detach())


def _rollout(engine_dir: str, cfg: R3BenchConfig) -> list[Any]:
    """GRPO-style groups sampled by the bf16 engine, with its logprobs and routing traces."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from vime.demo.model_factory import EOS_ID
    from vime.r3.hf_router import RoutingRecorder
    from vime.trainer.batch import SampleRecord

    engine = AutoModelForCausalLM.from_pretrained(engine_dir, dtype=torch.bfloat16).to(cfg.device).eval()
    prompts = _problems(cfg)
    n = cfg.samples_per_prompt
    ids = torch.tensor([p for p in prompts for _ in range(n)], dtype=torch.long, device=cfg.device)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 2)
    tokens, logps = [], []
    with torch.no_grad(), RoutingRecorder(engine) as rec:
        out = engine(input_ids=ids, use_cache=True)
        for t in range(cfg.max_new_tokens):
            logprobs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            tok = torch.multinomial(logprobs.exp(), 1, generator=gen)
            tokens.append(tok[:, 0])
            logps.append(logprobs.gather(-1, tok)[:, 0])
            if t + 1 < cfg.max_new_tokens:
                out = engine(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
        resp, lps = torch.stack(tokens, 1).cpu().numpy(), torch.stack(logps, 1).cpu().numpy()
        lengths = []
        for row in resp:
            eos = np.flatnonzero(row == EOS_ID)
            lengths.append(int(eos[0]) + 1 if eos.size else row.size)
        prompt_len = ids.shape[1]
        traces = rec.traces([prompt_len + r for r in lengths])
    samples = []
    for b, r in enumerate(lengths):
        # rewards only feed GRPO advantages, which an lr-0 step does not use: any values will do
        samples.append(SampleRecord(
            group_index=b // n, prompt_tokens=ids[b].cpu().numpy(), response_tokens=resp[b, :r],
            rollout_logprobs=lps[b, :r], loss_mask=np.ones(r, np.uint8), reward=float(b % 2),
            routed_experts=traces[b],
        ))  # fmt: skip
    return samples


def _problems(cfg: R3BenchConfig) -> list[list[int]]:
    from vime.demo import arithmetic
    from vime.demo.model_factory import _encode

    rng = random.Random(cfg.seed + 1)
    problems = [arithmetic.make_problem(rng, 3) for _ in range(cfg.prompts)]
    return [_encode(arithmetic.format_prompt(a, b)) for a, b in problems]  # 3-digit: all one length


def _rollout_with_engine(engine_dir: str, cfg: R3BenchConfig) -> list[Any]:
    """The same groups sampled by one of vime's rollout engines, with its own routing capture."""
    import asyncio

    import numpy as np

    from vime.rollout import SamplingConfig, build_engine
    from vime.trainer.batch import SampleRecord

    args: dict[str, Any] = {"dtype": "bfloat16"}
    if cfg.rollout_engine == "hf":
        args["device"] = cfg.device
    if cfg.rollout_engine == "vllm":
        args.update(max_model_len=64, gpu_memory_utilization=0.3, enforce_eager=True)
    engine = build_engine(cfg.rollout_engine, engine_dir, engine_args=args, capture_routing=True)  # type: ignore[arg-type]
    sampling = SamplingConfig(temperature=1.0, max_tokens=cfg.max_new_tokens, seed=cfg.seed + 2)
    prompts = _problems(cfg)

    async def sample() -> list[Any]:
        await engine.start()
        try:
            return await asyncio.gather(*(engine.generate(p, n=cfg.samples_per_prompt, sampling=sampling)
                                          for p in prompts))  # fmt: skip
        finally:
            await engine.shutdown()

    samples = []
    for g, (prompt, group) in enumerate(zip(prompts, asyncio.run(sample()))):
        for i, s in enumerate(group):
            samples.append(SampleRecord(
                group_index=g, prompt_tokens=np.asarray(prompt, np.int32), response_tokens=s.response_tokens,
                rollout_logprobs=s.rollout_logprobs, loss_mask=s.loss_mask, reward=float(i % 2),
                routed_experts=s.routed_experts,
            ))  # fmt: skip
    return samples


def _score(model_dir: str, samples: list[Any], replay: bool, seed: int, dtype: str, device: str = "cpu") -> tuple[dict[str, float], Any]:
    """The trainer's step metrics (lr 0) and its per-token |logprob - rollout logprob| (flat)."""
    import numpy as np

    from vime.trainer.batch import RolloutBatch
    from vime.trainer.torch_backend import TorchTrainer, TorchTrainerConfig

    cfg = TorchTrainerConfig(
        hf_checkpoint=model_dir, lr=0.0, weight_decay=0.0, dtype=dtype, device=device, seed=seed,
        micro_batch_size=32, use_rollout_routing_replay=replay,
    )  # fmt: skip
    trainer, batch = TorchTrainer(cfg), RolloutBatch.from_samples(samples)
    metrics = trainer.train_step(batch)
    lps = trainer.compute_logprobs(batch)
    return metrics, np.concatenate([np.abs(lp - s.rollout_logprobs) for lp, s in zip(lps, samples)])


def _flipped_tokens(model_dir: str, samples: list[Any], dtype: str, device: str = "cpu") -> Any:
    """Per response token (flat): does the trainer's own route differ from the rollout's in any MoE
    layer at the row predicting it or any earlier row (causal attention carries a flip forward)? The
    routes are the trainer's unreplayed ones; right padding does not change them (causal)."""
    import contextlib

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from vime.r3.hf_router import RoutingRecorder

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    seqs = [np.r_[s.prompt_tokens, s.response_tokens] for s in samples]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for b, q in enumerate(seqs):
        ids[b, : len(q)] = torch.from_numpy(q.astype(np.int64))
    cast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()
    with torch.no_grad(), cast, RoutingRecorder(model) as rec:
        model(input_ids=ids.to(device), use_cache=False)
    own = rec.expert_ids().cpu().numpy()
    out = []
    for b, s in enumerate(samples):
        p, r = s.prompt_tokens.size, s.response_tokens.size
        mine = np.sort(own[b, : p + r - 1], axis=-1)
        theirs = np.sort(s.routed_experts.astype(np.int64), axis=-1)
        flip_upto = np.logical_or.accumulate((mine != theirs).any(axis=(-1, -2)))  # [P + R - 1]
        out.append(flip_upto[p - 1 :])
    return np.concatenate(out)


def run_r3_bench(cfg: R3BenchConfig, work_dir: str | Path | None = None) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns the result dict."""
    import torch
    from transformers import AutoModelForCausalLM

    from vime.demo.model_factory import make_tiny_qwen3_moe

    if cfg.rollout_engine not in ("builtin", "hf", "vllm"):
        raise ValueError(f"rollout_engine must be builtin, hf or vllm, got {cfg.rollout_engine!r}")
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    try:
        with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
            init = make_tiny_qwen3_moe(
                Path(tmp) / "init", seed=cfg.seed, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                moe_intermediate_size=cfg.moe_intermediate_size, dtype="float32",
            )  # fmt: skip
            model = AutoModelForCausalLM.from_pretrained(str(init), dtype=torch.float32).to(cfg.device)
            sft_loss = _sft(model, cfg)
            trained = Path(tmp) / "trained"
            model.save_pretrained(str(trained))  # float32 master weights; the engine loads a bf16 copy
            for tokenizer_file in init.glob("*token*"):  # the engines load the demo tokenizer from here
                shutil.copy(tokenizer_file, trained / tokenizer_file.name)
            del model
            sft_s = time.perf_counter() - start
            rollout = _rollout if cfg.rollout_engine == "builtin" else _rollout_with_engine
            samples = rollout(str(trained), cfg)
            off, tok_off = _score(str(trained), samples, False, cfg.seed, cfg.trainer_dtype, cfg.device)
            on, tok_on = _score(str(trained), samples, True, cfg.seed, cfg.trainer_dtype, cfg.device)
            flipped = _flipped_tokens(str(trained), samples, cfg.trainer_dtype, cfg.device)
    finally:
        torch.set_num_threads(threads)
    a_off, a_on = off["train/train_rollout_logprob_abs_diff"], on["train/train_rollout_logprob_abs_diff"]
    return {
        "abs_diff_no_r3": a_off,
        "abs_diff_r3": a_on,
        "abs_diff_reduction": (a_off - a_on) / a_off if a_off > 0 else 0.0,
        "routing_agreement_no_r3": off["train/routing_agreement"],
        "routing_agreement_r3": on["train/routing_agreement"],
        "routing_agreement_unreplayed": on["train/routing_agreement_unreplayed"],
        # tokens with a route flip at or before the row that predicts them vs the rest (per-token
        # means): R3 can only help the former; the latter is the dense precision error R3 leaves
        "flipped_token_fraction": float(flipped.mean()),
        "abs_diff_flipped_tokens_no_r3": float(tok_off[flipped].mean()) if flipped.any() else None,
        "abs_diff_flipped_tokens_r3": float(tok_on[flipped].mean()) if flipped.any() else None,
        "abs_diff_other_tokens_no_r3": float(tok_off[~flipped].mean()) if (~flipped).any() else None,
        "abs_diff_other_tokens_r3": float(tok_on[~flipped].mean()) if (~flipped).any() else None,
        "target_met": bool(a_on <= 0.7 * a_off and on["train/routing_agreement"] == 1.0),
        "samples": len(samples),
        "response_tokens": int(sum(s.response_tokens.size for s in samples)),
        "sft_final_loss": sft_loss,
        "rollout_dtype": "bfloat16",
        "rollout_engine": cfg.rollout_engine,
        "trainer_dtype": cfg.trainer_dtype,
        "sft_seconds": round(sft_s, 2),
        "seconds": round(time.perf_counter() - start, 2),
        "config": asdict(cfg),
    }


def main(argv: list[str] | None = None) -> int:
    defaults = R3BenchConfig()
    parser = argparse.ArgumentParser(prog="vime bench r3", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    cfg = R3BenchConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    from vime.logging import configure_logging

    configure_logging(level="WARNING")
    result = run_r3_bench(cfg)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"R3 bench: {result['samples']} samples, {result['response_tokens']} response tokens, "
          f"bf16 rollout vs fp32 trainer, SFT loss {result['sft_final_loss']:.3f}")
    print(f"  logprob abs diff   no R3 {result['abs_diff_no_r3']:.5f}   R3 {result['abs_diff_r3']:.5f}   "
          f"({-100 * result['abs_diff_reduction']:+.1f}%)")
    print(f"  routing agreement  no R3 {result['routing_agreement_no_r3']:.4f}   R3 "
          f"{result['routing_agreement_r3']:.4f}")
    print(f"  target (>= 30% cut, agreement 1.0) {'met' if result['target_met'] else 'MISSED'}; "
          f"{result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
