"""Megatron backend across GPUs: every parallel layout must give the single-layout numbers.

Run with one process per GPU (2 GPUs: `torchrun --nproc_per_node 2 -m vime.bench.megatron_parallel_check`;
`scripts/gpu_check.sh` does it when it sees 2+ GPUs). On the R3 bench's SFT-trained tiny Qwen3-MoE
(64 experts, top-2) and its bf16 rollout samples with routing traces, for each layout in turn
(plain data parallel first, as the reference):
- `export`: the exported HF tensors equal the checkpoint's (bf16 cast), bit for bit: TP shards, EP
  experts and pipeline stages are loaded and gathered back in the right places;
- `lr0`: one lr-0 step with replay off and on gives the reference's abs diff and routing agreement
  (within 1e-4 relative; float32) and agreement 1.0 with replay;
- `train`: three bf16 steps (lr 1e-4, replay on) give losses and grad norms close to the reference's
  (bf16 reductions run in another order, so within 5e-2 relative);
- `resume`: a checkpoint after step 2 (`save_checkpoint`: every rank its model and optimizer shards);
  a new trainer loading it ends step 3 with the uninterrupted trainer's weights (distance within 1e-3
  of step 3's update) and loss.

Layouts for 2 GPUs: DP 2 (reference), PP 2, EP 2 (with DP 2). (MoE with TP needs sequence parallelism,
which needs TransformerEngine's norms: `MegatronParallelConfig.validate` refuses it without them.)
Prints one JSON line per layout and check on rank 0 and exits non-zero if any failed.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _layouts(world: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {f"dp{world}": {}}
    # TP on this MoE needs sequence parallelism, which needs TransformerEngine: refused without it
    out[f"pp{world}"] = dict(pipeline_model_parallel_size=world)
    out[f"ep{world}"] = dict(expert_model_parallel_size=world)
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def main() -> int:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from vime.logging import configure_logging

    configure_logging(level="WARNING")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    # a layout that fails on one rank must not leave the other waiting for NCCL's default 10 minutes
    dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timedelta(seconds=45))
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(os.environ.get("VIME_CHECK_DIR", "/tmp/vime-megatron-parallel"))

    from safetensors import safe_open

    from vime.bench.megatron_check import _r3_samples
    from vime.bench.r3 import R3BenchConfig, _rollout
    from vime.trainer.batch import RolloutBatch, broadcast_batch
    from vime.trainer.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
    from vime.trainer.megatron.backend import MegatronTrainer, MegatronTrainerConfig
    from vime.trainer.megatron.parallel import MegatronParallelConfig, init_model_parallel

    if rank == 0:
        _r3_samples(root)  # SFT-trained checkpoint at root / "r3trained"
    dist.barrier()
    path = str(root / "r3trained")
    # rank 0 samples; the others get its batch (as trainer ranks do in a run)
    batch = RolloutBatch.from_samples(_rollout(path, R3BenchConfig(top_k=2))) if rank == 0 else None
    batch = broadcast_batch(batch, src=0)
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        reference_tensors = {k: f.get_tensor(k).to(torch.bfloat16) for k in f.keys()}

    records: list[dict[str, Any]] = []
    ref: dict[str, Any] = {}
    for name, kw in _layouts(world).items():
        start = time.perf_counter()
        try:
            ps.destroy_model_parallel()
            par = MegatronParallelConfig(**kw)
            init_model_parallel(par, seed=1234)
            res: dict[str, Any] = {}
            for replay in (False, True):
                t = MegatronTrainer(MegatronTrainerConfig(hf_checkpoint=path, lr=0.0, weight_decay=0.0, dtype="float32",
                                                          micro_batch_size=32, use_rollout_routing_replay=replay,
                                                          parallel=par))  # fmt: skip
                m = t.train_step(batch)
                tag = "r3" if replay else "no_r3"
                res[f"abs_diff_{tag}"] = m["train/train_rollout_logprob_abs_diff"]
                res[f"routing_agreement_{tag}"] = m["train/routing_agreement"]
                del t
            def make_trainer() -> MegatronTrainer:
                return MegatronTrainer(MegatronTrainerConfig(hf_checkpoint=path, lr=1e-4, micro_batch_size=16,
                                                             use_rollout_routing_replay=True, use_tis=True, parallel=par))  # fmt: skip

            t = make_trainer()
            exported = dict(t.export_weights(torch.bfloat16))
            steps = [t.train_step(batch) for _ in range(2)]
            # resume: a checkpoint after step 2 (every rank its shards), then step 3 straight and resumed
            ckpt_root = root / f"resume-{name}"
            save_checkpoint(t, ckpt_root, steps_done=2, weight_version=2)
            mid = dict(t.export_weights(torch.float32))
            steps.append(t.train_step(batch))
            want = dict(t.export_weights(torch.float32))
            res["losses"] = [s["train/loss"] for s in steps]
            res["grad_norms"] = [s["train/grad_norm"] for s in steps]
            del t
            torch.cuda.empty_cache()
            if rank == 0:
                same = set(exported) == set(reference_tensors) and all(
                    torch.equal(exported[k], reference_tensors[k]) for k in reference_tensors
                )
                records.append(dict(check=f"{name}/export", tensors=len(exported), bit_identical=same, passed=same))
            if not ref:
                ref = res
            lr0_ok = all(_rel(res[k], ref[k]) <= 1e-4 for k in ("abs_diff_no_r3", "abs_diff_r3", "routing_agreement_no_r3"))
            lr0_ok = lr0_ok and res["routing_agreement_r3"] == 1.0
            train_ok = all(math.isfinite(x) for x in res["losses"] + res["grad_norms"]) and all(
                _rel(a, b) <= 5e-2 for a, b in zip(res["grad_norms"], ref["grad_norms"])
            )
            records.append(dict(check=f"{name}/lr0", passed=lr0_ok, **{k: v for k, v in res.items() if "_r3" in k}))
            records.append(dict(check=f"{name}/train", passed=train_ok, losses=res["losses"], grad_norms=res["grad_norms"],
                                reference_grad_norms=ref["grad_norms"]))  # fmt: skip
            t = make_trainer()
            load_checkpoint(t, find_checkpoint("latest", ckpt_root))
            resumed_loss = t.train_step(batch)["train/loss"]
            have = dict(t.export_weights(torch.float32))
            del t
            torch.cuda.empty_cache()
            if rank == 0:
                gap = sum(float((want[k] - have[k]).norm()) ** 2 for k in want) ** 0.5
                step3 = sum(float((want[k] - mid[k]).norm()) ** 2 for k in want) ** 0.5
                records.append(dict(check=f"{name}/resume", weights_distance_resumed=gap, step3_update_norm=step3,
                                    loss_straight=res["losses"][-1], loss_resumed=resumed_loss,
                                    passed=gap <= 1e-3 * step3 and _rel(resumed_loss, res["losses"][-1]) <= 1e-4))  # fmt: skip
        except Exception as exc:  # report and go on to the next layout
            records.append(dict(check=name, passed=False, error=f"{type(exc).__name__}: {exc}",
                                traceback=traceback.format_exc()[-2500:]))  # fmt: skip
        for r in records:
            if "seconds" not in r:
                r["seconds"] = round(time.perf_counter() - start, 1)
                r["layout"] = kw
                if rank == 0:
                    print(json.dumps(r), flush=True)
    failed = [r["check"] for r in records if not r.get("passed")]
    flags = torch.tensor([len(failed)], device="cuda")
    dist.all_reduce(flags)
    if rank == 0:
        print(json.dumps({"summary": "passed" if int(flags.item()) == 0 else "FAILED", "failed": failed}), flush=True)
        out = os.environ.get("OUT")
        if out:
            Path(out, "megatron_parallel_check.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    dist.destroy_process_group()
    return 0 if int(flags.item()) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
