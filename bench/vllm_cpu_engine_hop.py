"""What the process hop between vLLM's front end and its engine core costs on the CPU demo's batches.

Generates the CPU demo's batch (32 arithmetic prompts x 8 samples, at most 6 tokens, sampled logprobs)
`--batches` times in each of two ways, each in a fresh subprocess, and reports the median wall time
and the median CPU seconds per batch of that subprocess and its children:
- `vime`: the rollout worker's engine (`VllmRolloutEngine`: vLLM's AsyncLLM front end in this process,
  its engine core in another, the model worker inside the engine core), one `generate` per prompt;
- `inproc`: vLLM's synchronous `LLM` with the engine core in the same process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the same in-core worker), one `generate` for the batch.
The difference is what a rollout worker driving an in-process engine core could save per step.

    python bench/vllm_cpu_engine_hop.py --json     # needs the demo model: make demo (or vime make-demo-model)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROMPTS, SAMPLES, MAX_TOKENS = 32, 8, 6
ENGINE_ARGS = {"dtype": "bfloat16", "max_model_len": 64, "kv_cache_memory_bytes": 64 * 2**20, "disable_log_stats": True}


def tree_cpu_s() -> float:
    import psutil

    me = psutil.Process()
    return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])


def prompt_batches(n: int) -> list[list[list[int]]]:
    from vime.demo.arithmetic import make_prompts
    from vime.demo.tokenizer import vocab

    table = vocab()
    return [[[table[c] for c in row["prompt"]] for row in make_prompts(PROMPTS, seed=i)] for i in range(n)]


def measure(run_batch: Any, batches: list[list[list[int]]]) -> dict[str, float]:
    walls, cpus = [], []
    for prompts in batches:
        cpu, wall = tree_cpu_s(), time.perf_counter()
        run_batch(prompts)
        walls.append(time.perf_counter() - wall)
        cpus.append(tree_cpu_s() - cpu)
    warm = slice(2, None)  # the first batches still warm caches up
    return {"wall_s": statistics.median(walls[warm]), "cpu_s": statistics.median(cpus[warm])}


def run_vime(model: str, batches: list[list[list[int]]]) -> dict[str, float]:
    from vime.rollout import SamplingConfig
    from vime.rollout.vllm_engine import VllmRolloutEngine

    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS)
    loop = asyncio.new_event_loop()
    engine = VllmRolloutEngine(model, engine_args=dict(ENGINE_ARGS))
    loop.run_until_complete(engine.start())

    async def batch(prompts: list[list[int]]) -> None:
        await asyncio.gather(*(engine.generate(p, SAMPLES, sampling) for p in prompts))

    try:
        return measure(lambda prompts: loop.run_until_complete(batch(prompts)), batches)
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()


def run_inproc(model: str, batches: list[list[list[int]]]) -> dict[str, float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vime.rollout.vllm_cpu_executor import CpuInCoreExecutor

    llm = LLM(model, distributed_executor_backend=CpuInCoreExecutor, skip_tokenizer_init=True, **ENGINE_ARGS)
    params = SamplingParams(n=SAMPLES, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, logprobs=0, detokenize=False)
    return measure(lambda prompts: llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False), batches)


def child(mode: str, model: str, n: int) -> None:
    result = (run_vime if mode == "vime" else run_inproc)(model, prompt_batches(n))
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "runs" / "demo-model"))
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", choices=["vime", "inproc"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, args.batches)
        return
    if not (Path(args.model) / "config.json").exists():
        raise SystemExit(f"no model at {args.model}: run `make demo` or `vime make-demo-model --out {args.model}` first")
    results: dict[str, Any] = {}
    for mode in ("vime", "inproc"):
        # One thread per engine, as `vime run` gives a CPU rollout worker; the in-process engine needs
        # vLLM's multiprocessing off before vLLM is imported.
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0" if mode == "inproc" else "1")
        argv = [sys.executable, __file__, "--child", mode, "--model", args.model, "--batches", str(args.batches)]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{mode}: exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        results[mode] = json.loads(lines[-1].removeprefix("RESULT "))
    results["cpu_saved_per_batch_s"] = results["vime"]["cpu_s"] - results["inproc"]["cpu_s"]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for mode in ("vime", "inproc"):
        print(f"{mode:7s} wall {results[mode]['wall_s']:.3f} s  cpu {results[mode]['cpu_s']:.3f} core-s per batch")
    print(f"in-process engine core saves {results['cpu_saved_per_batch_s']:.3f} core-s per batch")


if __name__ == "__main__":
    main()
