"""The weight update inside vLLM on one GPU, by transport, against the raw copy of the same bytes; and
the colocated hand-over (sleep, then wake on new weights).

For each Qwen3 size: a random-init model of that shape in bf16 on the GPU plays the trainer's export;
a `VllmRolloutEngine` (random weights, sleep mode) runs on the same GPU. Two publishers serve the same
versions: one chunked over ZeroMQ (the channel across hosts), one that also keeps a GPU copy the
engine maps over CUDA IPC. Updates alternate between them; each version gets fresh random weights and
the engine's logprobs of a fixed response are checked against the model's own (`score_abs_diff`:
proof that the bytes that arrived are the ones sent). Then the colocated hand-over: `sleep(level)`
and `wake_up` loading the next version over IPC, for levels 1 and 2. Raw copy bandwidth of the same
number of bytes (device to device, device to host) is the ceiling.

vLLM's own `ipc` weight-transfer engine is not measured: in vLLM 0.26 its module imports `ray` at
import time, and Ray is not part of vime's install (vime has no Ray). `nccl` needs two GPUs.

    python -m vime.bench.weight_transport --sizes 0.6b,1.7b,4b --out results.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from vime.bench.vllm_gpu import emit_row, qwen3_config_dir


def raw_copy_gbps(nbytes: int, device: torch.device) -> dict[str, float]:
    """Best of 3 copies of `nbytes`: GPU->GPU, GPU->host (pageable, as the publisher's snapshot)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out: dict[str, float] = {}
    for name, dst in (("d2d", torch.empty_like(src)), ("d2h", torch.empty(nbytes, dtype=torch.uint8))):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        out[f"raw_{name}_gbps"] = nbytes / best / 1e9
        del dst
    return out


def _randomize(model: Any, seed: int) -> list[tuple[str, torch.Tensor]]:
    """New random weights (small, so logits stay finite), as the trainer would export them."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norm weights
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def _model_logprobs(model: Any, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(-1, torch.tensor(response, device=logits.device)[:, None]).squeeze(-1).cpu()


async def measure(size: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from vime.rollout.vllm_engine import VllmRolloutEngine
    from vime.weights import WeightPublisher

    device = torch.device("cuda", 0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    model.eval()
    tensors = _randomize(model, 0)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    row: dict[str, Any] = {"bench": "weight_transport", "size": size, "nbytes": nbytes, **raw_copy_gbps(nbytes, device)}
    engine = VllmRolloutEngine(str(model_dir), sleep_mode=True, engine_args={
        "dtype": "bfloat16", "load_format": "dummy", "skip_tokenizer_init": True, "max_model_len": 1024,
        "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.enforce_eager,
    })  # fmt: skip
    prompt = list(range(1000, 1032))
    response = list(range(2000, 2032))
    runs: list[dict[str, Any]] = []
    with WeightPublisher(cuda_ipc=False) as chunks, WeightPublisher(cuda_ipc=True) as shared:
        t0 = time.perf_counter()
        await engine.start()
        row["engine_start_s"] = time.perf_counter() - t0
        try:
            version = 0
            for rep in range(args.repeats):
                for name, pub in (("chunks", chunks), ("cuda_ipc", shared)):
                    version += 1
                    weights = _randomize(model, version)
                    publish = pub.publish(version, weights)
                    result = await engine.update_weights(version, pub.endpoint)
                    diff = (torch.from_numpy(await engine.score(prompt, response)) - _model_logprobs(model, prompt, response))
                    runs.append({"path": name, "rep": rep, "transport": result.extra.get("transport"),
                                 "publish_s": publish.seconds, "fetch_s": result.fetch_s, "pause_s": result.pause_s,
                                 "load_s": result.load_s, "paused_s": result.paused_s, "total_s": result.total_s,
                                 "score_abs_diff": float(diff.abs().mean())})  # fmt: skip
            for level in (1, 2):
                version += 1
                shared.publish(version, _randomize(model, version))
                torch.cuda.synchronize()
                free_before = torch.cuda.mem_get_info(device)[0]
                t0 = time.perf_counter()
                await engine.sleep(level)
                sleep_s = time.perf_counter() - t0
                freed = torch.cuda.mem_get_info(device)[0] - free_before
                t0 = time.perf_counter()
                result = await engine.wake_up(version, shared.endpoint)
                wake_s = time.perf_counter() - t0
                diff = (torch.from_numpy(await engine.score(prompt, response)) - _model_logprobs(model, prompt, response))
                runs.append({"path": f"colocate_level{level}", "sleep_s": sleep_s, "freed_gib": freed / 2**30,
                             "wake_s": wake_s, "fetch_s": result.fetch_s if result else 0.0,
                             "load_s": result.load_s if result else 0.0,
                             "transport": result.extra.get("transport") if result else None,
                             "score_abs_diff": float(diff.abs().mean())})  # fmt: skip
        finally:
            await engine.shutdown()
    row["runs"] = runs
    for name in ("chunks", "cuda_ipc"):
        mine = [r for r in runs if r["path"] == name]
        best = min(r["fetch_s"] + r["load_s"] for r in mine)
        row[f"{name}_best_s"] = best
        row[f"{name}_gbps"] = nbytes / best / 1e9
        row[f"{name}_paused_s"] = min(r["paused_s"] for r in mine)
    del model
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.6b")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                        help="skip CUDA graphs (engine start in seconds instead of a minute; updates are unaffected)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            emit_row(asyncio.run(measure(size, qwen3_config_dir(size, Path(tmp), 1024), args)), args.out)


if __name__ == "__main__":
    main()
