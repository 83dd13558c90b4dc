"""The Megatron backend's GPU verification, in one process on one GPU (`scripts/gpu_check.sh` runs it).

Checks, each reported as a JSON record with its numbers and tolerance:
1. `logits/<family>/<dtype>`: a random small Qwen3 dense / Qwen3-MoE / GLM-4.5-MoE checkpoint loaded into
   Megatron's GPTModel gives the transformers model's logits on the same input: relative error
   ||a - b|| / ||b|| within 1e-4 in float32 and 3e-2 in bfloat16; the model's weights are exactly those
   the HF mapping names.
2. `r3/metrics`: the R3 bench's setup (SFT-trained tiny Qwen3-MoE, bf16 "rollout" with recorded
   routes, top-2 routing) scored by `MegatronTrainer` in float32 with replay off and on, next to
   `TorchTrainer` on the same samples: the backends agree, replay gives routing agreement 1.0 and
   a lower abs diff.
3. `train/<mode>`: a few bf16 training steps (lr 1e-4) with and without R3 replay, the second with full
   activation recompute (REPLAY_BACKWARD path): finite losses and grad norms, weights moved.
4. `export`: after training, `save_hf_checkpoint` holds exactly the exported tensors (bit for bit), and
   transformers and a fresh Megatron model loading that file give the same logits (float32, 1e-4).
5. `resume/<optimizer>`: `--save-interval` / `--load` with and without the distributed optimizer: a
   trainer resumed from a checkpoint after step 2 ends step 3 with the uninterrupted trainer's weights
   (distance <= 1e-3 of a not-resumed control's), loss and learning rate.
6. `speed/<backend>`: one rollout step (forward + backward + optimizer) of a ~0.6B dense Qwen3 shape
   (28 layers, hidden 1024, 16 heads / 8 KV, ffn 3072, vocab 151936) on 8 x 2048 tokens, torch backend vs
   Megatron backend: tokens/s and MFU (model FLOPs 6 * matmul params * tokens + causal attention
   6 * layers * seq * q_dim per token, over the H200's 989 TFLOP/s dense bf16).

`--transformer-impl transformer_engine` builds every Megatron model with TransformerEngine's layers.
Exit status 0 only if every check passed. Output: one JSON line per check, then a summary line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from vime.bench.flops import H200_BF16_PEAK_FLOPS, training_flops_per_token


# Megatron-LM's --transformer-impl for every model this check builds (set by main's --transformer-impl)
_TRANSFORMER_IMPL = "local"


def _parallel(**kwargs: Any) -> Any:
    """A MegatronParallelConfig with this run's transformer_impl (and `kwargs`)."""
    from vime.trainer.megatron.parallel import MegatronParallelConfig

    return MegatronParallelConfig(transformer_impl=_TRANSFORMER_IMPL, **kwargs)


def _setup() -> None:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    from vime.trainer.megatron.parallel import MegatronParallelConfig, init_model_parallel

    init_model_parallel(MegatronParallelConfig(), seed=1234)


def _glm_checkpoint(path: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Glm4MoeConfig

    cfg = Glm4MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1, topk_group=1,
        norm_topk_prob=True, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False,
        max_position_embeddings=256, tie_word_embeddings=False, architectures=["Glm4MoeForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random expert-score bias so the sigmoid router's bias path matters
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


def _checkpoint(family: str, root: Path) -> str:
    from vime.demo.model_factory import make_tiny_qwen3, make_tiny_qwen3_moe

    if family == "qwen3":
        return str(make_tiny_qwen3(root / family, num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=2,
                                   head_dim=32, intermediate_size=256, dtype="float32"))  # fmt: skip
    if family == "qwen3_moe":
        return str(make_tiny_qwen3_moe(root / family, num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=2,
                                       head_dim=32, num_experts=16, num_experts_per_tok=4,
                                       moe_intermediate_size=64, dtype="float32"))  # fmt: skip
    return str(_glm_checkpoint(root / family))


def check_logits(family: str, root: Path) -> list[dict[str, Any]]:
    """Megatron GPTModel vs transformers logits, float32 and bfloat16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vime.trainer.megatron.hf_mapping import ModelLayout
    from vime.trainer.megatron.model import build_gpt_model, transformer_config
    from vime.trainer.megatron.weights import load_hf_weights

    path = _checkpoint(family, root)
    layout = ModelLayout.from_hf_config(AutoConfig.from_pretrained(path))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, layout.vocab_size, (4, 96), generator=gen).cuda()
    pos = torch.arange(96, device="cuda")[None].expand(4, 96)
    out = []
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 3e-2)):
        bf16 = dtype == "bfloat16"
        model = build_gpt_model(layout, transformer_config(layout, _parallel(), bf16=bf16),
                                pre_process=True, post_process=True).cuda()  # fmt: skip
        load_hf_weights(model, path, layout)
        # every weight of the model is one the mapping names for this transformer_impl, and the reverse
        built = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers() if n.endswith("expert_bias")}
        expected = set(layout.megatron_names(_TRANSFORMER_IMPL))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        hf = hf.cuda().eval()
        with torch.no_grad():
            a = model.eval()(ids, pos, attention_mask=None)[..., : layout.vocab_size].float()
            b = hf(input_ids=ids).logits.float()
        rel = float((a - b).norm() / b.norm())
        top1 = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        out.append(dict(check=f"logits/{family}/{dtype}", rel_error=rel, tolerance=tol, top1_agreement=top1,
                        max_abs=float((a - b).abs().max()), names_match=built == expected,
                        names_unmapped=sorted(built - expected)[:5], names_missing=sorted(expected - built)[:5],
                        passed=rel <= tol and built == expected))  # fmt: skip
        del model, hf
        torch.cuda.empty_cache()
    return out


def _r3_samples(root: Path) -> tuple[str, list[Any]]:
    """The R3 bench's trained tiny MoE (top-1) and its bf16 rollout samples with routing traces (CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vime.bench.r3 import R3BenchConfig, _rollout, _sft
    from vime.demo.model_factory import make_tiny_qwen3_moe

    cfg = R3BenchConfig(top_k=2, sft_steps=300)  # Megatron has no top-1 router with renormalised weight
    torch.manual_seed(cfg.seed)
    init = make_tiny_qwen3_moe(root / "r3init", seed=cfg.seed, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                               num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                               moe_intermediate_size=cfg.moe_intermediate_size, dtype="float32")  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(init), dtype=torch.float32)
    _sft(model, cfg)
    trained = root / "r3trained"
    model.save_pretrained(str(trained))
    return str(trained), _rollout(str(trained), cfg)


def check_r3(root: Path) -> list[dict[str, Any]]:
    """Megatron and torch backends score the same R3 samples (float32, lr 0), replay off and on."""
    from vime.trainer.batch import RolloutBatch
    from vime.trainer.megatron.backend import MegatronTrainer, MegatronTrainerConfig
    from vime.trainer.torch_backend import TorchTrainer, TorchTrainerConfig

    path, samples = _r3_samples(root)
    batch = RolloutBatch.from_samples(samples)
    res: dict[str, float] = {}
    for backend, make in (("torch", lambda c: TorchTrainer(TorchTrainerConfig(**c))),
                          ("megatron", lambda c: MegatronTrainer(MegatronTrainerConfig(**c, parallel=_parallel())))):  # fmt: skip
        for replay in (False, True):
            common = dict(hf_checkpoint=path, lr=0.0, weight_decay=0.0, dtype="float32", micro_batch_size=32,
                          use_rollout_routing_replay=replay)  # fmt: skip
            if backend == "torch":
                common["device"] = "cuda"
            m = make(common).train_step(batch)
            tag = f"{backend}_{'r3' if replay else 'no_r3'}"
            res[f"abs_diff_{tag}"] = m["train/train_rollout_logprob_abs_diff"]
            res[f"routing_agreement_{tag}"] = m["train/routing_agreement"]
    close = all(abs(res[f"abs_diff_megatron_{t}"] - res[f"abs_diff_torch_{t}"]) <= 0.1 * res[f"abs_diff_torch_{t}"] + 1e-4
                for t in ("r3", "no_r3"))  # fmt: skip
    passed = close and res["routing_agreement_megatron_r3"] == 1.0 and res["abs_diff_megatron_r3"] < res["abs_diff_megatron_no_r3"]
    return [dict(check="r3/metrics", samples=len(samples), passed=passed, backends_agree_within_10pct=close, **res)]


def check_training_and_export(root: Path) -> list[dict[str, Any]]:
    """bf16 training steps with and without replay (+ recompute), then export and reload."""
    import math

    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from vime.trainer.batch import RolloutBatch
    from vime.trainer.megatron.backend import MegatronTrainer, MegatronTrainerConfig
    from vime.trainer.megatron.model import build_gpt_model, transformer_config
    from vime.trainer.megatron.weights import load_hf_weights

    from vime.bench.r3 import R3BenchConfig, _rollout

    path = root / "r3trained"
    if not path.exists():  # made by check_r3 when it ran first
        _r3_samples(root)
    samples = _rollout(str(path), R3BenchConfig(top_k=2))
    batch = RolloutBatch.from_samples(samples)
    out = []
    trainer = None
    for mode, par in (("no_r3", _parallel()),
                      ("r3_recompute", _parallel(recompute_granularity="full", recompute_method="uniform"))):  # fmt: skip
        trainer = MegatronTrainer(MegatronTrainerConfig(
            hf_checkpoint=str(path), lr=1e-4, micro_batch_size=16, use_rollout_routing_replay=mode != "no_r3",
            parallel=par, use_tis=True,
        ))  # fmt: skip
        before = dict(trainer.export_weights(torch.float32))
        steps = [trainer.train_step(batch) for _ in range(3)]
        after = dict(trainer.export_weights(torch.float32))
        moved = sum(not torch.equal(before[k], after[k]) for k in before)
        # bf16 parameters: an update below a weight's bf16 spacing (norm weights near 1.0) or an expert no
        # token was routed to does not move; every attention projection must
        attention = [k for k in before if ".self_attn." in k and k.endswith("_proj.weight")]
        attention_moved = all(not torch.equal(before[k], after[k]) for k in attention)
        finite = all(math.isfinite(s["train/loss"]) and math.isfinite(s["train/grad_norm"]) for s in steps)
        rec = dict(check=f"train/{mode}", losses=[s["train/loss"] for s in steps],
                   grad_norms=[s["train/grad_norm"] for s in steps],
                   abs_diff=[s["train/train_rollout_logprob_abs_diff"] for s in steps],
                   routing_agreement=[s.get("train/routing_agreement") for s in steps],
                   tensors_moved=moved, tensors=len(before), attention_projections_moved=attention_moved,
                   passed=finite and attention_moved)  # fmt: skip
        if mode != "no_r3":
            rec["passed"] = rec["passed"] and all(a == 1.0 for a in rec["routing_agreement"])
        out.append(rec)
    assert trainer is not None
    exported = dict(trainer.export_weights(torch.bfloat16))
    save_dir = root / "exported"
    trainer.save_hf_checkpoint(save_dir, dtype=torch.bfloat16)
    with safe_open(str(save_dir / "model.safetensors"), framework="pt") as f:
        identical = all(torch.equal(f.get_tensor(k), exported[k]) for k in exported) and set(f.keys()) == set(exported)

    ids = torch.tensor(samples[0].prompt_tokens[None].astype("int64")).cuda()
    pos = torch.arange(ids.shape[1], device="cuda")[None]

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x - y).norm() / y.norm())

    logits = {}
    with torch.no_grad():
        logits["trainer_bf16"] = trainer.model.eval()(ids, pos, attention_mask=None).float()
        for dtype in ("float32", "bfloat16"):
            hf = AutoModelForCausalLM.from_pretrained(str(save_dir), dtype=getattr(torch, dtype)).cuda().eval()
            logits[f"hf_{dtype}"] = hf(input_ids=ids).logits.float()
            fresh = build_gpt_model(trainer.layout, transformer_config(trainer.layout, _parallel(),
                                                                       bf16=dtype == "bfloat16"),
                                    pre_process=True, post_process=True).cuda().eval()  # fmt: skip
            load_hf_weights(fresh, str(save_dir), trainer.layout)
            logits[f"megatron_{dtype}"] = fresh(ids, pos, attention_mask=None).float()
    # float32 compares the mapping without bf16 noise; in bf16 a route flip between transformers' bf16
    # router and Megatron's float32 router (moe_router_dtype) moves whole expert outputs in this tiny MoE
    fp32 = rel(logits["megatron_float32"], logits["hf_float32"])
    out.append(dict(check="export", tensors=len(exported), bit_identical_reload=identical,
                    logits_rel_error_float32_megatron_vs_hf=fp32, tolerance_float32=1e-4,
                    logits_rel_error_bf16_megatron_vs_hf=rel(logits["megatron_bfloat16"], logits["hf_bfloat16"]),
                    logits_rel_error_bf16_trainer_vs_reloaded_megatron=rel(logits["trainer_bf16"], logits["megatron_bfloat16"]),
                    passed=identical and fp32 <= 1e-4))  # fmt: skip
    return out


def check_chunked_head(root: Path) -> list[dict[str, Any]]:
    """The chunked LM head against full-vocabulary logits on the Megatron backend, float32: the same
    old logprobs, the same metrics over two optimizer steps (PPO clip, TIS, an entropy bonus) and the
    same weights after them, on a dense and a MoE checkpoint."""
    import numpy as np
    import torch

    from vime.bench.r3 import R3BenchConfig, _rollout
    from vime.trainer.batch import RolloutBatch
    from vime.trainer.megatron.backend import MegatronTrainer, MegatronTrainerConfig

    path = root / "r3trained"
    if not path.exists():  # made by check_r3 when it ran first
        _r3_samples(root)
    batch = RolloutBatch.from_samples(_rollout(str(path), R3BenchConfig(top_k=2))[:64])
    out = []
    dense = dataclasses.replace(batch, routed_experts=None)  # the dense model has no routers to replay
    for family, ckpt, data in (("qwen3", _checkpoint("qwen3", root), dense), ("qwen3_moe", str(path), batch)):
        runs = {}
        for chunked in (False, True):
            trainer = MegatronTrainer(MegatronTrainerConfig(
                hf_checkpoint=ckpt, lr=1e-5, dtype="float32", micro_batch_size=16, use_tis=True,
                entropy_coef=0.01, global_batch_size=32, chunked_head=chunked, parallel=_parallel(),
            ))  # fmt: skip
            before = np.concatenate(trainer.compute_logprobs(data))
            metrics = trainer.train_step(data)
            after = np.concatenate(trainer.compute_logprobs(data))
            runs[chunked] = (before, after, metrics, dict(trainer.export_weights(torch.float32)))
            del trainer
            torch.cuda.empty_cache()
        (b0, a0, m0, w0), (b1, a1, m1, w1) = runs[False], runs[True]
        lp_gap = float(max(np.abs(b0 - b1).max(), np.abs(a0 - a1).max()))
        keys = [k for k in m0 if isinstance(m0[k], float)]
        metric_gap = max(abs(m0[k] - m1[k]) / max(1.0, abs(m0[k])) for k in keys)
        weights_close = all(torch.allclose(w1[k], w0[k], rtol=1e-4, atol=1e-6) for k in w0)
        out.append(dict(check=f"head/{family}", logprob_max_diff=lp_gap, metric_max_rel_diff=metric_gap,
                        weights_close=weights_close, metrics=len(keys), entropy_loss=m1.get("train/entropy_loss"),
                        passed=lp_gap <= 1e-5 and metric_gap <= 1e-4 and weights_close))  # fmt: skip
    return out


def check_resume(root: Path) -> list[dict[str, Any]]:
    """`--save-interval` / `--load` on the Megatron backend: two bf16 steps, a checkpoint, a third step;
    a new trainer that loads the checkpoint and takes the same third step must end with the same
    weights. A fresh trainer taking only that step is the control (how far apart "not resumed" is)."""
    import torch

    from vime.bench.r3 import R3BenchConfig, _rollout
    from vime.trainer.batch import RolloutBatch
    from vime.trainer.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
    from vime.trainer.megatron.backend import MegatronTrainer, MegatronTrainerConfig

    path = root / "r3trained"
    if not path.exists():
        _r3_samples(root)
    samples = _rollout(str(path), R3BenchConfig(top_k=2))
    batches = [RolloutBatch.from_samples([x for x in samples if x.group_index % 3 == i]) for i in range(3)]
    out = []
    for distributed in (True, False):
        def make() -> MegatronTrainer:
            return MegatronTrainer(MegatronTrainerConfig(
                hf_checkpoint=str(path), lr=1e-3, micro_batch_size=8, use_tis=True, lr_warmup_steps=4,
                use_rollout_routing_replay=True, parallel=_parallel(use_distributed_optimizer=distributed),
            ))  # fmt: skip

        ckpt_root = root / f"resume-{distributed}"
        straight = make()
        for batch in batches[:2]:
            straight.train_step(batch)
        save_checkpoint(straight, ckpt_root, steps_done=2, weight_version=2)
        expected = straight.train_step(batches[2])
        want = dict(straight.export_weights(torch.float32))
        del straight
        resumed = make()
        point = load_checkpoint(resumed, find_checkpoint("latest", ckpt_root))
        got = resumed.train_step(batches[2])
        have = dict(resumed.export_weights(torch.float32))
        del resumed
        fresh = make()
        fresh.train_step(batches[2])
        control = dict(fresh.export_weights(torch.float32))
        del fresh

        def dist_to(other: dict[str, torch.Tensor]) -> float:
            return float(sum((want[k] - other[k]).float().norm() ** 2 for k in want) ** 0.5)

        resumed_gap, control_gap = dist_to(have), dist_to(control)
        loss_gap = abs(got["train/loss"] - expected["train/loss"])
        out.append(dict(
            check=f"resume/{'distributed_optimizer' if distributed else 'optimizer'}", steps_done=point.steps_done,
            weights_distance_resumed=resumed_gap, weights_distance_not_resumed=control_gap,
            loss_third_step=expected["train/loss"], loss_gap=loss_gap, lr=(expected["train/lr"], got["train/lr"]),
            passed=resumed_gap <= 1e-3 * control_gap and loss_gap <= 1e-4 * max(1.0, abs(expected["train/loss"]))
            and expected["train/lr"] == got["train/lr"],
        ))  # fmt: skip
    return out


def _dense_checkpoint(path: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    return path


def check_speed(
    root: Path, steps: int = 8, samples: int = 8, seq: int = 2048, micro_batch: int = 8, profile_dir: str | None = None
) -> list[dict[str, Any]]:
    """One rollout step's throughput on the ~0.6B dense shape, torch backend vs Megatron backend."""
    import numpy as np
    import torch
    from transformers import AutoConfig

    from vime.trainer.batch import RolloutBatch, SampleRecord
    from vime.trainer.megatron.backend import MegatronTrainer, MegatronTrainerConfig
    from vime.trainer.torch_backend import TorchTrainer, TorchTrainerConfig

    path = _dense_checkpoint(root / "dense06b")
    c = AutoConfig.from_pretrained(path)
    rng = np.random.default_rng(0)
    prompt = 32
    recs = [SampleRecord(group_index=i // 4, prompt_tokens=rng.integers(0, c.vocab_size, prompt),
                         response_tokens=rng.integers(0, c.vocab_size, seq - prompt),
                         rollout_logprobs=np.full(seq - prompt, -11.0, np.float32),
                         loss_mask=np.ones(seq - prompt, np.uint8), reward=float(i % 2))
            for i in range(samples)]  # fmt: skip
    batch = RolloutBatch.from_samples(recs)
    tokens = samples * seq
    flops = tokens * training_flops_per_token(c, seq)
    out = []
    common = dict(hf_checkpoint=str(path), lr=1e-5, micro_batch_size=micro_batch)
    for backend in ("torch", "megatron"):
        if backend == "torch":
            trainer: Any = TorchTrainer(TorchTrainerConfig(**common, device="cuda"))
        else:
            trainer = MegatronTrainer(MegatronTrainerConfig(**common, parallel=_parallel()))
        for _ in range(2):
            trainer.train_step(batch)
        torch.cuda.synchronize()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train_step(batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        step = float(np.median(times))
        if profile_dir:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                trainer.train_step(batch)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
            Path(profile_dir, f"profile_{backend}.txt").write_text(table)
        out.append(dict(check=f"speed/{backend}", step_seconds=step, step_seconds_all=times, tokens=tokens,
                        tokens_per_s=tokens / step, tflops=flops / step / 1e12,
                        mfu=flops / step / H200_BF16_PEAK_FLOPS, peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30,
                        passed=True))  # fmt: skip
        del trainer
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    out.append(dict(check="speed/megatron_vs_torch", ratio=out[1]["tokens_per_s"] / out[0]["tokens_per_s"],
                    passed=out[1]["tokens_per_s"] >= out[0]["tokens_per_s"]))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vime.bench.megatron_check", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="subset: logits r3 train resume head speed")
    parser.add_argument("--out", default=None, help="also write the records to this JSONL file")
    parser.add_argument("--profile-dir", default=None, help="write a torch.profiler table per backend's step here")
    parser.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                        help="the Megatron layers every check builds (transformer_engine needs TransformerEngine)")
    args = parser.parse_args(argv)
    global _TRANSFORMER_IMPL
    _TRANSFORMER_IMPL = args.transformer_impl
    from vime.logging import configure_logging

    configure_logging(level="WARNING")
    _setup()
    root = Path(tempfile.mkdtemp(prefix="vime-megatron-check-"))
    steps: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = [
        *[("logits", lambda f=f: check_logits(f, root)) for f in ("qwen3", "qwen3_moe", "glm4_moe")],
        ("r3", lambda: check_r3(root)),
        ("train", lambda: check_training_and_export(root)),
        ("resume", lambda: check_resume(root)),
        ("head", lambda: check_chunked_head(root)),
        ("speed", lambda: check_speed(root, profile_dir=args.profile_dir)),
    ]
    records: list[dict[str, Any]] = []
    for name, fn in steps:
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        try:
            recs = fn()
        except Exception as exc:  # report and go on: one call should tell us everything
            recs = [dict(check=name, passed=False, error=f"{type(exc).__name__}: {exc}",
                         traceback=traceback.format_exc()[-3000:])]  # fmt: skip
        for r in recs:
            r["seconds"] = round(time.perf_counter() - start, 1)
            r["transformer_impl"] = args.transformer_impl
            print(json.dumps(r), flush=True)
        records += recs
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    failed = [r["check"] for r in records if not r.get("passed")]
    print(json.dumps({"summary": "passed" if not failed else "FAILED", "failed": failed, "checks": len(records)}))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
