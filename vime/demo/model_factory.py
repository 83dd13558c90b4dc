"""Local, offline makers of the small Qwen3-architecture models the demo and the tests run on.

Nothing here downloads anything: models are random-initialised from a seed and saved as ordinary
Hugging Face checkpoints (safetensors + config + generation_config + the demo character tokenizer), so
vLLM, transformers and the trainer load them like any other `--hf-checkpoint`.

- `make_demo_model`: the CPU demo's policy. Random init, then a short supervised warm start on the demo
  task (3-digit sums, `vime.demo.arithmetic`) that stops once *sampled* accuracy (temperature 1; mean
  of the last 3 checks) reaches a target, so RL starts at roughly 0.2 reward whatever the seed: the
  curve is steep and its take-off step differs by seed and by processor (floating-point order), so a
  fixed step count would land far from the target for some. A warm start that runs all its steps
  without reaching the target raises `DemoModelError` and saves nothing: RL from such a model does not
  learn. Per-seed results on several processors: `bench/warm_start.py`, docs/benchmarks.md.
- `make_tiny_qwen3` / `make_tiny_qwen3_moe`: random models built in about a second for tests.

Every maker writes `vime_demo_meta.json` last, containing its recipe. A directory whose meta has the
same recipe is reused as is (the cache), and a concurrent maker of the same directory waits on a file
lock instead of interleaving writes. A partially written directory has no matching meta, so it is
rebuilt.

Keep head_dim at 32 or more: vLLM's CPU attention rejects head_dim 16.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vime.demo import arithmetic, running_sum
from vime.demo.tasks import DEMO_TASK_RECIPES
from vime.demo.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    build_tokenizer_object,
    id_to_token,
    save_tokenizer,
    vocab,
    vocab_size,
)
from vime.logging import get_logger

log = get_logger(__name__)

META_FILE = "vime_demo_meta.json"
FAILED_FILE = "vime_demo_failed.json"  # the record of a warm start that missed its target
_VOCAB = vocab()
# Fingerprint of the whole tokenizer definition (vocabulary, pre-tokenizer, decoder): a model saved
# with another tokenizer is rebuilt rather than reused.
_TOKENIZER_SHA = hashlib.sha256(build_tokenizer_object().to_str().encode()).hexdigest()[:16]
META_FORMAT = 4  # bump when the meaning of a recipe changes, so old caches are rebuilt

# Embedding rows = tokenizer size, so every sampled id decodes (the tokenizer pads itself to 64).
DEFAULT_VOCAB_SIZE = vocab_size()


ATTEMPT_SEED_STRIDE = 100_003


class DemoModelError(RuntimeError):
    """The demo model's warm start ended without reaching its accuracy target: RL on it would not learn."""


@dataclasses.dataclass(frozen=True)
class DemoRecipe:
    """Everything that determines the warmed demo model; its dict is the cache key."""

    seed: int = 0
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    vocab_size: int = DEFAULT_VOCAB_SIZE
    max_position_embeddings: int = 256
    digits: int = 3
    # "arithmetic": one sum per prompt (the CPU demo); "running_sum": a sum, then a running total over
    # a second turn (the multi-turn demo, `vime.demo.running_sum`).
    task: str = "arithmetic"
    warmup_steps: int = 800  # steps per attempt; training usually stops far earlier, at target_accuracy
    # A fresh init (seed + ATTEMPT_SEED_STRIDE * attempt) when an attempt runs out of steps: a few runs
    # plateau for a long while (one answer digit near chance) before taking off, and how many depends
    # on the processor's floating-point order; a new start is faster than waiting.
    attempts: int = 3
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.0
    # RL starts near this reward; 0.2 leaves room for the demo to show a rise of >= 0.3 from any start.
    target_accuracy: float | None = 0.2  # None: always run all warmup_steps
    min_steps: int = 100  # no accuracy checks before this (accuracy is ~0 there anyway)
    eval_every: int = 25
    # Once accuracy passes half the target, check this often: near the target accuracy can rise ~0.1
    # per 25 steps, which would overshoot the band.
    fine_eval_every: int = 5
    stop_window: int = 3  # stop when the mean of this many consecutive checks reaches the target
    eval_samples: int = 256
    final_eval_samples: int = 1024
    temperature: float = 1.0
    save_dtype: str = "bfloat16"  # what vLLM runs; the reported accuracy is measured after this rounding
    lr_warmup_steps: int = 100  # linear warmup from 0, then constant: no large early steps off a random init
    grad_clip: float = 1.0  # max gradient norm (0: none)


@dataclasses.dataclass(frozen=True)
class TinyRecipe:
    """Shape of a random (not trained) test model; its dict is the cache key."""

    kind: str  # "qwen3" or "qwen3_moe"
    seed: int = 0
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    intermediate_size: int = 128
    vocab_size: int = DEFAULT_VOCAB_SIZE
    max_position_embeddings: int = 256
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    save_dtype: str = "bfloat16"
    tie_embeddings: bool = True


# Qwen3 dense shapes by size: (hidden, layers, heads, kv heads, intermediate, tied embeddings); all use
# head_dim 128 and the 151936-entry vocabulary.
QWEN3_SHAPES: dict[str, tuple[int, int, int, int, int, bool]] = {
    "0.6b": (1024, 28, 16, 8, 3072, True),
    "1.7b": (2048, 28, 16, 8, 6144, True),
    "4b": (2560, 36, 32, 8, 9728, True),
    "8b": (4096, 36, 32, 8, 12288, False),
}
# Qwen3-MoE shapes: (hidden, layers, heads, kv heads, experts, experts per token, expert intermediate,
# tied embeddings); head_dim 128, the same vocabulary. Throughput benches run them with fewer layers.
QWEN3_MOE_SHAPES: dict[str, tuple[int, int, int, int, int, int, int, bool]] = {
    "30b-a3b": (2048, 48, 32, 4, 128, 8, 768, False),
}
QWEN3_VOCAB_SIZE = 151936


# ----------------------------------------------------------------------------------------------------
# cache and saving


def _meta_matches(out: Path, recipe: dict[str, Any]) -> dict[str, Any] | None:
    """The stored meta if `out` holds a complete model made from `recipe`, else None."""
    meta_path = out / META_FILE
    if not meta_path.is_file() or not (out / "model.safetensors").is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format") != META_FORMAT or meta.get("recipe") != recipe:
        return None
    if meta.get("tokenizer_sha") != _TOKENIZER_SHA:
        return None  # the vocabulary changed since this model was made
    return meta


@contextmanager
def _dir_lock(out: Path) -> Iterator[None]:
    """Exclusive lock on `out` so two processes never write the same model directory at once."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".vime_model.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _write_meta(out: Path, meta: dict[str, Any]) -> None:
    # Written last and atomically: its presence means the directory is complete.
    tmp = out / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / META_FILE)


_SAVE_DTYPES = ("bfloat16", "float16", "float32")


def _cached_build(
    out_dir: str | Path, recipe: dict[str, Any], build: Callable[[Path], dict[str, Any]], force: bool
) -> Path:
    """Run `build(out)` unless `out` already holds a model of `recipe`; `build` returns extra meta."""
    if recipe["save_dtype"] not in _SAVE_DTYPES:
        raise ValueError(f"save dtype must be one of {_SAVE_DTYPES}, got {recipe['save_dtype']!r}")
    out = Path(out_dir).resolve()
    with _dir_lock(out):
        if not force:
            meta = _meta_matches(out, recipe)
            if meta is not None:
                log.info("demo_model_cached", out_dir=str(out), kind=recipe.get("kind", "demo"))
                return out
        (out / META_FILE).unlink(missing_ok=True)
        extra = build(out)
        _write_meta(out, {"format": META_FORMAT, "recipe": recipe, "tokenizer_sha": _TOKENIZER_SHA, **extra})
    return out


def _save(model: Any, out: Path, max_len: int, dtype: str, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
    """Save model (safetensors, in `dtype`), generation config (eos/pad) and the demo tokenizer.

    bfloat16 by default, like published checkpoints: vLLM then runs exactly the saved weights, and
    loading float32 weights into a bfloat16 vLLM logs one warning per tensor.
    """
    import torch
    from transformers import GenerationConfig

    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(str(out))
    save_tokenizer(out, model_max_length=max_len, vocab_size=vocab_size)


def _param_count(model: Any) -> int:
    # Tied embeddings are one tensor; count unique storage once.
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


@contextmanager
def _torch_threads(num_threads: int | None) -> Iterator[None]:
    import torch

    previous = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _common_config_fields(r: DemoRecipe | TinyRecipe) -> dict[str, Any]:
    """The fields a dense and a mixture-of-experts Qwen3 config share."""
    return dict(
        vocab_size=r.vocab_size, hidden_size=r.hidden_size, intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_layers, num_attention_heads=r.num_heads, num_key_value_heads=r.num_kv_heads,
        head_dim=r.head_dim, max_position_embeddings=r.max_position_embeddings,
        tie_word_embeddings=getattr(r, "tie_embeddings", True), bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, dtype="float32",
    )  # fmt: skip


def _qwen3_config(r: DemoRecipe | TinyRecipe) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**_common_config_fields(r))


def _qwen3_moe_config(r: TinyRecipe) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_common_config_fields(r), num_experts=r.num_experts, num_experts_per_tok=r.num_experts_per_tok,
        moe_intermediate_size=r.moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# warm start


def _encode(text: str) -> list[int]:
    """Token ids of `text` with the demo vocabulary (one per character), without loading transformers."""
    table = _VOCAB
    return [table[c] for c in text]


def _segments(rng: random.Random, digits: int, task: str) -> list[tuple[list[int], int]]:
    """One training transcript as (tokens, trained) segments: prompts and environment text are not
    trained (their digits are random, so predicting them is noise), answers and EOS are."""
    if task == "running_sum":
        a, b, c = running_sum.make_problem(rng, digits)
        return [
            (_encode(arithmetic.format_prompt(a, b)), 0), (_encode(str(a + b)) + [EOS_ID], 1),
            (_encode(running_sum.observation(c)), 0), (_encode(str(a + b + c)) + [EOS_ID], 1),
        ]  # fmt: skip
    if task != "arithmetic":
        raise ValueError(f"unknown demo task {task!r}; known: arithmetic, running_sum")
    a, b = arithmetic.make_problem(rng, digits)
    return [(_encode(arithmetic.format_prompt(a, b)), 0), (_encode(str(a + b)) + [EOS_ID], 1)]


def _training_batch(rng: random.Random, batch_size: int, digits: int, task: str = "arithmetic") -> tuple[Any, Any]:
    """(input_ids, loss_mask) of `batch_size` transcripts of `task`, right-padded; the loss covers the
    answers and their EOS only."""
    import torch

    seqs, masks = [], []
    for _ in range(batch_size):
        segments = _segments(rng, digits, task)
        seqs.append([t for tokens, _ in segments for t in tokens])
        masks.append([trained for tokens, trained in segments for _ in tokens])
    width = max(len(s) for s in seqs)
    ids = torch.full((batch_size, width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((batch_size, width), dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def sampled_accuracy(
    model: Any, n: int, seed: int, digits: int = 3, temperature: float = 1.0, batch_size: int = 256,
    task: str = "arithmetic",
) -> float:
    """Fraction of `n` fresh problems answered exactly when sampling at `temperature` (0 = greedy).

    Uses a full forward per generated token (no KV cache): sequences are ~13 tokens, so it is cheap and
    exercises nothing but the model. Deterministic for a given seed.
    """
    import torch

    if task == "running_sum":
        return _running_sum_accuracy(model, n, seed, digits, temperature, batch_size)
    rows = arithmetic.make_prompts(n, seed=seed, digits=digits)
    gen = torch.Generator().manual_seed(seed)
    max_new = digits + 2  # the longest sum has digits+1 digits, then EOS
    correct = 0
    with _evaluating(model):
        for start in range(0, n, batch_size):
            chunk = rows[start : start + batch_size]
            # All prompts have the same length (fixed digit count), so no padding is needed.
            ids = torch.tensor([_encode(r["prompt"]) for r in chunk], dtype=torch.long)
            prompt_len = ids.shape[1]
            ids = _sample_tokens(model, ids, max_new, temperature, gen)
            for row, out in zip(chunk, ids[:, prompt_len:].tolist()):
                if EOS_ID not in out:
                    continue  # never stopped: wrong, whatever the digits
                correct += _is_right(out[: out.index(EOS_ID)], row["label"])
    return correct / max(n, 1)


@contextmanager
def _evaluating(model: Any) -> Iterator[None]:
    """Eval mode and no autograd for a measurement; the model's mode is restored after it."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _is_right(answer: list[int], label: str) -> int:
    """1 if the answer's tokens (without EOS) spell the label, else 0."""
    symbols = id_to_token()
    text = "".join(symbols[t] if t < len(symbols) else "\ufffd" for t in answer)
    return int(arithmetic.arithmetic_reward(text, label) == 1.0)


def _sample_tokens(model: Any, ids: Any, steps: int, temperature: float, gen: Any) -> Any:
    """`ids` with `steps` sampled tokens appended (full forwards, no KV cache: sequences are short)."""
    import torch

    for _ in range(steps):
        logits = model(input_ids=ids).logits[:, -1, :].float()
        if temperature <= 0:
            nxt = logits.argmax(dim=-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen).squeeze(-1)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    return ids


def _running_sum_accuracy(model: Any, n: int, seed: int, digits: int, temperature: float, batch_size: int) -> float:
    """Fraction of `n` running-sum problems whose final total is right, sampling both turns.

    Rows stay rectangular: each turn samples `digits` + 1 tokens, and a first turn that is not `digits`
    digits then EOS counts as wrong (the rollout would have ended it elsewhere), so this slightly
    underestimates what the rollout sees.
    """
    import torch

    rows = running_sum.make_prompts(n, seed=seed, digits=digits)
    gen = torch.Generator().manual_seed(seed)
    correct = 0
    with _evaluating(model):
        for start in range(0, n, batch_size):
            chunk = rows[start : start + batch_size]
            ids = torch.tensor([_encode(r["prompt"]) for r in chunk], dtype=torch.long)
            ids = _sample_tokens(model, ids, digits + 1, temperature, gen)
            first_ok = ids[:, -1].eq(EOS_ID) & ~ids[:, -(digits + 1) : -1].eq(EOS_ID).any(dim=1)
            env = torch.tensor([_encode(running_sum.observation(r["metadata"]["operands"][0])) for r in chunk])
            ids = _sample_tokens(model, torch.cat([ids, env], dim=1), digits + 1, temperature, gen)
            for row, ok, out in zip(chunk, first_ok.tolist(), ids[:, -(digits + 1) :].tolist()):
                if ok and out[-1] == EOS_ID:
                    correct += _is_right(out[:-1], row["label"])
    return correct / max(n, 1)


def warm_start(model: Any, recipe: DemoRecipe, seed: int | None = None) -> dict[str, Any]:
    """Supervised training on the addition task until sampled accuracy reaches the target, for at most
    `recipe.warmup_steps` steps; training problems come from `seed` (default `recipe.seed`).

    Returns the training record (whether the target was reached, steps run, losses, the accuracy
    checks). Evaluation prompts come from a seed stream disjoint from the training stream.
    """
    import torch

    rng = random.Random((recipe.seed if seed is None else seed) * 1_000_003 + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    warmup = max(recipe.lr_warmup_steps, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda done: min(1.0, (done + 1) / warmup))
    model.train()
    checks: list[tuple[int, float]] = []
    reached: bool | None = None if recipe.target_accuracy is None else False
    loss_value = float("nan")
    step = 0
    started = time.perf_counter()
    for step in range(1, recipe.warmup_steps + 1):
        ids, mask = _training_batch(rng, recipe.batch_size, recipe.digits, recipe.task)
        logits = model(input_ids=ids).logits[:, :-1, :]
        targets = ids[:, 1:]
        token_loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
        ).view_as(targets)
        target_mask = mask[:, 1:]
        loss = (token_loss * target_mask).sum() / target_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if recipe.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        schedule.step()
        loss_value = float(loss.detach())
        if step % 100 == 0:
            log.info("warm_start_progress", step=step, loss=round(loss_value, 4))
        every = recipe.fine_eval_every if checks and checks[-1][1] >= recipe.target_accuracy / 2 else recipe.eval_every
        if recipe.target_accuracy is not None and step >= recipe.min_steps and step % every == 0:
            acc = sampled_accuracy(
                model, recipe.eval_samples, seed=10_000 + step, digits=recipe.digits,
                temperature=recipe.temperature, task=recipe.task,
            )
            checks.append((step, acc))
            log.info("warm_start_check", step=step, loss=round(loss_value, 4), sampled_accuracy=acc)
            # Stop on the mean of the last few checks: a single 256-sample check is noisy (+-0.03), and
            # stopping on the first lucky one lands well below the target.
            recent = [a for _, a in checks[-recipe.stop_window :]]
            if len(recent) == recipe.stop_window and sum(recent) / len(recent) >= recipe.target_accuracy:
                reached = True
                break
    return {
        "reached_target": reached,
        "steps_run": step,
        "final_loss": loss_value,
        "accuracy_checks": checks,
        "train_seconds": round(time.perf_counter() - started, 2),
    }


# ----------------------------------------------------------------------------------------------------
# public makers


def make_demo_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    warmup_steps: int = DemoRecipe.warmup_steps,
    target_accuracy: float | None = DemoRecipe.target_accuracy,
    num_threads: int | None = 1,
    force: bool = False,
    **recipe_overrides: Any,
) -> Path:
    """Build (or reuse) the warmed demo model in `out_dir`; returns the directory.

    `recipe_overrides` are other `DemoRecipe` fields (sizes, lr, batch_size, ...); an unknown name
    raises TypeError. The meta file records the recipe, the parameter count, the training record and
    the final sampled accuracy (temperature 1, `final_eval_samples` prompts). `num_threads` caps torch
    threads during the build (the demo machine has two cores shared with other processes) and is
    restored afterwards. `force` rebuilds even when the cache matches.
    """
    recipe = DemoRecipe(seed=seed, warmup_steps=warmup_steps, target_accuracy=target_accuracy, **recipe_overrides)

    def build(out: Path) -> dict[str, Any]:
        import torch
        from transformers import Qwen3ForCausalLM

        with _torch_threads(num_threads):
            earlier: list[dict[str, Any]] = []
            attempts = max(recipe.attempts, 1)
            for attempt in range(attempts):
                attempt_seed = recipe.seed + ATTEMPT_SEED_STRIDE * attempt
                torch.manual_seed(attempt_seed)
                model = Qwen3ForCausalLM(_qwen3_config(recipe))
                params = _param_count(model)
                log.info("warm_start_begin", out_dir=str(out), params=params, attempt=attempt, seed=attempt_seed,
                         recipe=dataclasses.asdict(recipe))
                record = warm_start(model, recipe, attempt_seed)
                if record["reached_target"] is not False or attempt == attempts - 1:
                    break
                best = max((a for _, a in record["accuracy_checks"]), default=0.0)
                earlier.append({"seed": attempt_seed, "steps_run": record["steps_run"], "best_check": best,
                                "final_loss": record["final_loss"]})
                log.warning("warm_start_restart", attempt=attempt, seed=attempt_seed, best_check=best,
                            hint="the run plateaued; starting again from a fresh init")
            record = {**record, "attempt": attempt, "seed": attempt_seed, "earlier_attempts": earlier,
                      "total_steps": record["steps_run"] + sum(e["steps_run"] for e in earlier)}
            # Measure the weights that will be saved: round to the save dtype, evaluate in float32.
            model.to(getattr(torch, recipe.save_dtype)).to(torch.float32)
            accuracy = sampled_accuracy(
                model, recipe.final_eval_samples, seed=999_983 + recipe.seed, digits=recipe.digits,
                temperature=recipe.temperature, task=recipe.task,
            )
            greedy = sampled_accuracy(
                model, recipe.final_eval_samples, seed=999_983 + recipe.seed, digits=recipe.digits, temperature=0.0,
                task=recipe.task,
            )
            model.eval()
            result = {"recipe": dataclasses.asdict(recipe), "training": record, "sampled_accuracy": accuracy,
                      "greedy_accuracy": greedy}
            if record["reached_target"] is False:
                (out / FAILED_FILE).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
                raise DemoModelError(_missed_target_message(out, recipe, record, accuracy))
            (out / FAILED_FILE).unlink(missing_ok=True)
            _save(model, out, recipe.max_position_embeddings, recipe.save_dtype)
        log.info("warm_start_done", out_dir=str(out), steps=record["steps_run"], sampled_accuracy=accuracy,
                 greedy_accuracy=greedy, seconds=record["train_seconds"])
        return {
            "kind": "demo_qwen3",
            "params": params,
            "training": record,
            "sampled_accuracy": accuracy,
            "greedy_accuracy": greedy,
            "accuracy_temperature": recipe.temperature,
            "accuracy_samples": recipe.final_eval_samples,
            "torch_version": torch.__version__,
        }

    return _cached_build(out_dir, dataclasses.asdict(recipe), build, force)


def _missed_target_message(out: Path, recipe: DemoRecipe, record: dict[str, Any], accuracy: float) -> str:
    recent = [round(a, 3) for _, a in record["accuracy_checks"][-recipe.stop_window :]]
    return (
        f"the demo model's warm start missed its target: after {record['attempt'] + 1} attempt(s) of "
        f"{record['steps_run']} supervised steps its sampled accuracy is {accuracy:.3f} (last checks {recent}, "
        f"target {recipe.target_accuracy}; loss {record['final_loss']:.3f}), and RL from it would not learn. Nothing was saved in {out}; the record is "
        f"in {out / FAILED_FILE}. Try more steps (`vime make-demo-model --out {out} --warmup-steps "
        f"{2 * recipe.warmup_steps}`) or another seed (`--seed {recipe.seed + 1}`), then run the demo again; "
        f"please report it with your processor's model (`lscpu`), since the recipe should reach its target on any."
    )


def _make_tiny(out_dir: str | Path, recipe: TinyRecipe, force: bool) -> Path:
    def build(out: Path) -> dict[str, Any]:
        import torch

        torch.manual_seed(recipe.seed)
        # Real sizes initialise in seconds on a GPU rather than minutes on CPU cores.
        device = "cuda" if recipe.vocab_size > DEFAULT_VOCAB_SIZE and torch.cuda.is_available() else "cpu"
        if recipe.kind == "qwen3":
            from transformers import Qwen3ForCausalLM

            with torch.device(device):
                model = Qwen3ForCausalLM(_qwen3_config(recipe))
        else:
            from transformers import Qwen3MoeForCausalLM

            with torch.device(device):
                model = Qwen3MoeForCausalLM(_qwen3_moe_config(recipe))
        model.eval()
        _save(model, out, recipe.max_position_embeddings, recipe.save_dtype, recipe.vocab_size)
        return {"kind": f"tiny_{recipe.kind}", "params": _param_count(model)}

    return _cached_build(out_dir, dataclasses.asdict(recipe), build, force)


def make_tiny_qwen3(
    out_dir: str | Path,
    seed: int = 0,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    dtype: str = "bfloat16",
    force: bool = False,
) -> Path:
    """A random-init dense Qwen3 (about 0.1M parameters by default) with the demo tokenizer; seconds."""
    recipe = TinyRecipe(
        kind="qwen3", seed=seed, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, save_dtype=dtype,
    )
    return _make_tiny(out_dir, recipe, force)


def make_qwen3_shape(
    out_dir: str | Path,
    size: str,
    seed: int = 0,
    *,
    num_layers: int | None = None,
    max_position_embeddings: int = 4096,
    dtype: str = "bfloat16",
    force: bool = False,
) -> Path:
    """A random-init Qwen3 of a real size (`QWEN3_SHAPES`, or the mixture-of-experts `QWEN3_MOE_SHAPES`:
    hidden sizes, layers, heads, experts and the 151936 vocabulary of the published models) with the
    demo tokenizer padded to that vocabulary: the demo task runs on it unchanged, at the cost of a real
    model. For throughput and memory measurements (it is untrained: its rewards stay near zero).
    `num_layers` replaces the size's layer count (a layer shape with fewer layers). Raises KeyError
    naming the known sizes."""
    recipe = qwen3_shape_recipe(size, seed, num_layers=num_layers, max_position_embeddings=max_position_embeddings,
                                dtype=dtype)  # fmt: skip
    return _make_tiny(out_dir, recipe, force)


def qwen3_shape_recipe(
    size: str, seed: int = 0, *, num_layers: int | None = None, max_position_embeddings: int = 4096,
    dtype: str = "bfloat16",
) -> TinyRecipe:  # fmt: skip
    """The recipe `make_qwen3_shape` builds. Raises KeyError naming the known sizes."""
    common = dict(seed=seed, head_dim=128, vocab_size=QWEN3_VOCAB_SIZE, max_position_embeddings=max_position_embeddings,
                  save_dtype=dtype)  # fmt: skip
    if size in QWEN3_MOE_SHAPES:
        hidden, layers, heads, kv_heads, experts, top_k, moe_inter, tied = QWEN3_MOE_SHAPES[size]
        return TinyRecipe(
            kind="qwen3_moe", num_layers=num_layers or layers, hidden_size=hidden, num_heads=heads,
            num_kv_heads=kv_heads, intermediate_size=3 * hidden, num_experts=experts, num_experts_per_tok=top_k,
            moe_intermediate_size=moe_inter, tie_embeddings=tied, **common,
        )  # fmt: skip
    if size not in QWEN3_SHAPES:
        raise KeyError(f"unknown Qwen3 size {size!r}; known: {', '.join([*QWEN3_SHAPES, *QWEN3_MOE_SHAPES])}")
    hidden, layers, heads, kv_heads, inter, tied = QWEN3_SHAPES[size]
    return TinyRecipe(
        kind="qwen3", num_layers=num_layers or layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
        intermediate_size=inter, tie_embeddings=tied, **common,
    )  # fmt: skip


def make_tiny_qwen3_moe(
    out_dir: str | Path,
    seed: int = 0,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    max_position_embeddings: int = 256,
    dtype: str = "bfloat16",
    force: bool = False,
) -> Path:
    """A random-init Qwen3-MoE (every layer sparse, `num_experts` experts, top-k routing) for tests of
    the trainer and of routing replay; uses the demo tokenizer."""
    if not 0 < num_experts_per_tok <= num_experts:
        raise ValueError(f"need 0 < num_experts_per_tok <= num_experts, got {num_experts_per_tok}, {num_experts}")
    recipe = TinyRecipe(
        kind="qwen3_moe", seed=seed, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=4 * hidden_size,
        max_position_embeddings=max_position_embeddings, num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size, save_dtype=dtype,
    )
    return _make_tiny(out_dir, recipe, force)


def read_meta(model_dir: str | Path) -> dict[str, Any]:
    """The `vime_demo_meta.json` of a model directory made here; FileNotFoundError if absent."""
    return json.loads((Path(model_dir) / META_FILE).read_text())


def main(argv: list[str] | None = None) -> int:
    """CLI: build the demo model (or a tiny random one) and print its meta as JSON."""
    parser = argparse.ArgumentParser(prog="python -m vime.demo.model_factory", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory (reused if it holds the same recipe)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=DemoRecipe.warmup_steps,
                        help="maximum supervised steps per attempt")
    parser.add_argument("--attempts", type=int, default=DemoRecipe.attempts,
                        help="fresh starts allowed when an attempt runs out of steps")
    parser.add_argument("--target-accuracy", type=float, default=DemoRecipe.target_accuracy,
                        help="stop the warm start once sampled accuracy reaches this; <0 disables")
    parser.add_argument("--kind", choices=["demo", "tiny", "tiny-moe", "qwen3"], default="demo",
                        help="qwen3: a random-init Qwen3 of --size with the demo tokenizer")
    parser.add_argument("--size", choices=list(QWEN3_SHAPES), default="0.6b", help="with --kind qwen3")
    parser.add_argument("--dtype", choices=list(_SAVE_DTYPES), default="bfloat16", help="dtype of the saved weights")
    parser.add_argument("--threads", type=int, default=1, help="torch threads during the build")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--task", choices=list(DEMO_TASK_RECIPES), default="arithmetic",
                        help="the demo task the model is warmed on (running_sum: the multi-turn demo)")
    args = parser.parse_args(argv)
    if args.kind == "demo":
        target = None if args.target_accuracy is not None and args.target_accuracy < 0 else args.target_accuracy
        try:
            out = make_demo_model(args.out, seed=args.seed, warmup_steps=args.warmup_steps, target_accuracy=target,
                                  num_threads=args.threads, force=args.force, save_dtype=args.dtype,
                                  attempts=args.attempts, **DEMO_TASK_RECIPES[args.task])
        except DemoModelError as exc:
            print(f"vime make-demo-model: {exc}", file=sys.stderr)
            return 1
    elif args.kind == "tiny":
        out = make_tiny_qwen3(args.out, seed=args.seed, dtype=args.dtype, force=args.force)
    elif args.kind == "qwen3":
        out = make_qwen3_shape(args.out, args.size, seed=args.seed, dtype=args.dtype, force=args.force)
    else:
        out = make_tiny_qwen3_moe(args.out, seed=args.seed, dtype=args.dtype, force=args.force)
    json.dump(read_meta(out), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
