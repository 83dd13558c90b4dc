"""The generate function used with `--environment-path`: model and environment take turns.

    reset -> [model turn -> env.step -> environment turn]* -> done -> close (if the environment has one)

Budgets: at most `--max-turns` model turns, each at most `--rollout-max-response-len` tokens, and
the whole trajectory (prompt included) at most `--rollout-max-context-len` tokens. A trajectory that
runs out of turns or tokens is TRUNCATED (trained like a truncated single-turn sample); the
environment's `done` makes it COMPLETED. Observations are tokenized once, without special tokens, and
appended after the model's own tokens, which are never decoded and re-encoded.
"""

from __future__ import annotations

import time
from typing import Any

from vime.agent.environment import EnvStep
from vime.agent.trajectory import Status, Trajectory


def encode_observation(tokenizer: Any, text: str) -> list[int]:
    """Token ids of an observation as the model will see it (no BOS/EOS added)."""
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


async def generate(args: Any, sample: Trajectory, sampling_params: dict[str, Any]) -> Trajectory:
    """slime's contract (`vime.agent.custom_generate`), driving `args.make_environment(sample)`."""
    if args.make_environment is None:
        raise RuntimeError("vime.agent.multiturn.generate needs --environment-path")
    env = await args.make_environment(sample)
    try:
        return await _take_turns(args, env, sample, sampling_params)
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            await close()


async def _take_turns(args: Any, env: Any, sample: Trajectory, sampling_params: dict[str, Any]) -> Trajectory:
    started = time.perf_counter()
    first = await env.reset(sample)
    sample.count("env_s", time.perf_counter() - started)
    if first:
        _append_observation(args, sample, EnvStep(observation=first))
    for _ in range(args.max_turns):
        turn = await args.engine.generate(sample.tokens, sampling_params)
        sample.add_model_turn(turn)
        if turn.finish_reason == "abort":
            sample.status = Status.ABORTED
            return sample
        started = time.perf_counter()
        step = await env.step(sample, turn)
        sample.count("env_s", time.perf_counter() - started)
        if step.reward is not None:
            sample.reward = float(step.reward)
        if step.done:
            sample.status = Status.COMPLETED  # the environment judged the trajectory finished
            return sample
        if not _append_observation(args, sample, step):  # it appends only what leaves room for a turn
            sample.status = Status.TRUNCATED
            return sample
    sample.status = Status.TRUNCATED  # out of turns before the environment said done
    sample.count("turn_limit_hits")
    return sample


def _append_observation(args: Any, sample: Trajectory, step: EnvStep) -> bool:
    """Append the observation; False when it does not fit the context budget (nothing appended)."""
    tokens = step.observation_tokens if step.observation_tokens is not None else encode_observation(args.tokenizer, step.observation)
    limit = args.rollout_max_context_len
    if limit is not None and sample.context_length + len(tokens) >= limit:
        return False
    sample.add_env_turn(tokens, step.observation)
    return True
