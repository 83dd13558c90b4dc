"""vLLM alone against vime's vLLM rollout engine, at real Qwen3 shapes, on one GPU.

For each size: the same batch (prompts x samples, prompt and response lengths, `ignore_eos`, sampled
logprobs) through a bare `AsyncLLM` and through `VllmRolloutEngine.generate` (one request per prompt
with `n` samples, as the rollout worker sends them), random weights (`load_format="dummy"`, no tokenizer).
Prints one JSON line per size: generated tokens/s of each, their ratio, engine start seconds.

    python -m vime.bench.vllm_gpu --sizes 0.6b,1.7b,4b --out results.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from vime.demo.model_factory import _qwen3_config, qwen3_shape_recipe


def qwen3_config_dir(size: str, root: Path, max_len: int) -> Path:
    """A directory holding only the config.json of the Qwen3 of that size that `make_qwen3_shape`
    builds (weights come from vLLM's dummy loader). Raises KeyError naming the known sizes."""
    recipe = qwen3_shape_recipe(size, max_position_embeddings=max_len)
    config = _qwen3_config(recipe)
    config.dtype = recipe.save_dtype  # the dtype make_qwen3_shape's saved config names, not the build's float32
    config.architectures = ["Qwen3ForCausalLM"]  # vLLM picks its model class by this; a model's save fills it in
    out = root / f"qwen3-{size}"
    config.save_pretrained(out)
    return out


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": "bfloat16", "load_format": "dummy", "skip_tokenizer_init": True,
        "max_model_len": args.prompt_len + args.response_len + 8, "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.prompts * args.n, "enable_prefix_caching": True,
    }


def prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1000, 100000, size=args.prompt_len).tolist() for _ in range(args.prompts)]


async def bare_vllm(model: Path, args: argparse.Namespace) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    t0 = time.perf_counter()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model), logprobs_mode="processed_logprobs", **engine_args(args)))
    start_s = time.perf_counter() - t0
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.response_len, ignore_eos=True, logprobs=0,
                            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip

    async def one(i: int, tokens: list[int], tag: str) -> int:
        final = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=tokens), params, request_id=f"{tag}-{i}"):
            final = out
        return sum(len(c.token_ids) for c in final.outputs)

    try:
        batch = prompts(args)
        await asyncio.gather(*(one(i, p[:16], "warm") for i, p in enumerate(batch[:4])))
        t1 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i, p, "run") for i, p in enumerate(batch))))
        gen_s = time.perf_counter() - t1
    finally:
        llm.shutdown()
    return {"start_s": start_s, "tokens": tokens, "gen_s": gen_s, "tokens_per_s": tokens / gen_s}


async def vime_engine(model: Path, args: argparse.Namespace) -> dict[str, float]:
    from vime.rollout import SamplingConfig
    from vime.rollout.vllm_engine import VllmRolloutEngine

    engine = VllmRolloutEngine(str(model), engine_args=engine_args(args))
    t0 = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - t0
    cfg = SamplingConfig(max_tokens=args.response_len, temperature=1.0, ignore_eos=True)
    try:
        batch = prompts(args)
        t1 = time.perf_counter()
        groups = await asyncio.gather(*(engine.generate(p, n=args.n, sampling=cfg) for p in batch))
        gen_s = time.perf_counter() - t1
        tokens = sum(s.response_length for g in groups for s in g)
    finally:
        await engine.shutdown()
    return {"start_s": start_s, "tokens": tokens, "gen_s": gen_s, "tokens_per_s": tokens / gen_s,
            "version_source": engine.version_source}  # fmt: skip


def emit_row(row: dict[str, Any], out: Path | None) -> None:
    """One JSON line on stdout and, with `out`, appended to that file."""
    print(json.dumps(row), flush=True)
    if out:
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.6b")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from vime.rollout.vllm_environment import apply_vllm_environment

    apply_vllm_environment(on_cuda=True, capture_routing=False)  # the bare engine needs the same settings
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            model = qwen3_config_dir(size, Path(tmp), args.prompt_len + args.response_len + 8)
            bare = asyncio.run(bare_vllm(model, args))
            ours = asyncio.run(vime_engine(model, args))
            row = {"bench": "vllm_gpu", "size": size, "prompts": args.prompts, "n": args.n,
                   "prompt_len": args.prompt_len, "response_len": args.response_len,
                   "vllm": bare, "vime_engine": ours, "ratio": ours["tokens_per_s"] / bare["tokens_per_s"]}  # fmt: skip
            emit_row(row, args.out)


if __name__ == "__main__":
    main()
