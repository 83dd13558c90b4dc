"""The demo datasets and the model recipe each needs; no heavy imports (the launcher and the SLURM
renderer read it)."""

from __future__ import annotations

from typing import Any

# Each demo task's model: the `DemoRecipe` fields that differ from its defaults.
DEMO_TASK_RECIPES: dict[str, dict[str, Any]] = {
    "arithmetic": {},
    "running_sum": {"task": "running_sum", "digits": 2},
}


def demo_task_of(prompt_data: str) -> str:
    """The demo task whose model a job on `prompt_data` needs (`demo:running_sum` -> running_sum; every
    other dataset gets the single-turn demo model)."""
    name = prompt_data.removeprefix("demo:")
    return name if prompt_data.startswith("demo:") and name in DEMO_TASK_RECIPES else "arithmetic"
