"""The multi-turn CPU demo task: a sum, then a running total.

The prompt asks for a sum (`"23+45="`); after the model answers, the environment appends a second
operand (`"+21="`) and the model must give the new total (`89`). Only a correct final total is
rewarded (1.0, else 0.0), so the first answer is trained only through the trajectory's advantage.
All numbers have `digits` digits, sums included, so every answer has one length. A trajectory in
tokens (the demo tokenizer has one token per character):

    2 3 + 4 5 = | 6 8 <eos> | + 2 1 = | 8 9 <eos>
    prompt        model       environment  model
"""

from __future__ import annotations

import random
from typing import Any

from vime.agent.environment import EnvContext, EnvStep
from vime.agent.trajectory import ModelTurn, Trajectory
from vime.demo.arithmetic import arithmetic_reward, format_prompt

TASK_NAME = "running_sum"


def make_problem(rng: random.Random, digits: int = 2) -> tuple[int, int, int]:
    """Operands a and b with `digits` digits each (no leading zeros) and a one-digit c (1-9) such that
    a + b and a + b + c have `digits` digits too, uniformly over all such triples."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    low = 10 ** (digits - 1) if digits > 1 else 0
    high = 10**digits - 1
    while True:
        a, b, c = rng.randint(low, high), rng.randint(low, high), rng.randint(1, 9)
        if a + b + c <= high:
            return a, b, c


def make_prompts(n: int, seed: int = 0, digits: int = 2) -> list[dict[str, Any]]:
    """`n` deterministic rows `{"prompt": "a+b=", "label": "a+b+c", "metadata": {..., "operands": [c]}}`."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    rows = []
    for index in range(n):
        a, b, c = make_problem(rng, digits)
        rows.append({
            "prompt": format_prompt(a, b),
            "label": str(a + b + c),
            "metadata": {"task": TASK_NAME, "a": a, "b": b, "operands": [c], "index": index, "seed": seed},
        })  # fmt: skip
    return rows


def observation(operand: int) -> str:
    """What the environment appends after a model turn: the next operand and '='."""
    return f"+{operand}="


class RunningSumEnvironment:
    """Appends each of the row's `operands` after a model turn; after the last one, the model's answer is
    the final total and the trajectory is done, rewarded 1.0 when it equals the label."""

    def __init__(self, operands: list[int], label: str | None) -> None:
        self.operands = list(operands)
        self.label = label or ""
        self.turns = 0

    async def reset(self, sample: Trajectory) -> str | None:
        return None

    async def step(self, sample: Trajectory, turn: ModelTurn) -> EnvStep:
        self.turns += 1
        if self.turns > len(self.operands):
            return EnvStep(done=True, reward=arithmetic_reward(turn.text, self.label))
        return EnvStep(observation=observation(self.operands[self.turns - 1]))


def make_environment(sample: Trajectory, context: EnvContext) -> RunningSumEnvironment:
    """`--environment-path vime.demo.running_sum:make_environment`."""
    operands = sample.metadata.get("operands")
    if not isinstance(operands, list) or not all(isinstance(x, int) for x in operands):
        raise ValueError(f"a running-sum prompt needs metadata.operands (a list of ints), got {operands!r}")
    return RunningSumEnvironment(operands, sample.label)
