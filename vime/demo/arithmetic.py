"""The CPU demo task: add two n-digit numbers whose sum has n digits.

Prompts look like `"123+456="` and the label is the decimal sum (`"579"`). The generator is a pure
function of `(n, seed, digits)` so the broker, the reward worker and tests all agree on the data
without shipping it around. Rows use slime's dataset shape: `{"prompt", "label", "metadata"}`.

The reward is exact match after trimming whitespace and a trailing EOS marker: the demo model writes
the digits and then stops, so anything else (extra digits, a missing carry) scores 0.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from vime.demo.tokenizer import EOS_TOKEN

TASK_NAME = "arithmetic_add"


def make_problem(rng: random.Random, digits: int = 3) -> tuple[int, int]:
    """Two operands with exactly `digits` digits each (no leading zeros) whose sum has `digits` digits
    too, drawn uniformly from all such pairs.

    A fixed answer length means every answer position is always the same decimal place. With sums of
    either length (a carry out of the top digit or not) a model must learn two alignments and pick one
    per problem; the demo's 0.8M-parameter model then learned slowly and, depending on the processor's
    floating-point order, sometimes stalled for thousands of steps.
    """
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    low = 10 ** (digits - 1) if digits > 1 else 0
    high = 10**digits - 1
    while True:  # rejection keeps the pairs uniform; about 40 % of draws are kept for 3 digits
        a, b = rng.randint(low, high), rng.randint(low, high)
        if a + b <= high:
            return a, b


def format_prompt(a: int, b: int) -> str:
    """The prompt text the model is conditioned on."""
    return f"{a}+{b}="


def make_prompts(n: int, seed: int = 0, digits: int = 3) -> list[dict[str, Any]]:
    """`n` deterministic rows `{"prompt": "a+b=", "label": "sum", "metadata": {...}}`.

    The same `(n, seed, digits)` always gives the same rows, and a longer list extends a shorter one
    with the same seed (row i depends only on seed and i's position in the stream).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    rows = []
    for index in range(n):
        a, b = make_problem(rng, digits)
        rows.append(
            {
                "prompt": format_prompt(a, b),
                "label": str(a + b),
                "metadata": {"task": TASK_NAME, "a": a, "b": b, "index": index, "seed": seed},
            }
        )
    return rows


def write_jsonl(path: str | Path, n: int, seed: int = 0, digits: int = 3) -> Path:
    """Write `make_prompts(n, seed, digits)` as JSON Lines to `path` (parents created); return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for row in make_prompts(n, seed, digits):
            f.write(json.dumps(row) + "\n")
    return out


def clean_response(response: str) -> str:
    """Strip whitespace and any trailing EOS markers (engines may or may not detokenize EOS)."""
    text = response.strip()
    while text.endswith(EOS_TOKEN):
        text = text[: -len(EOS_TOKEN)].rstrip()
    return text


def arithmetic_reward(response: str, label: str) -> float:
    """1.0 if the response is exactly the label (after `clean_response`), else 0.0.

    No partial credit and no numeric parsing: "0579" or "579 1" are wrong on purpose, so the
    model must learn to stop. A missing/empty label scores 0.0.
    """
    if not label:
        return 0.0
    return 1.0 if clean_response(response) == str(label).strip() else 0.0
