"""The multi-turn demo task: its prompts, its environment and the warm start's transcripts."""

from __future__ import annotations

import asyncio
import random

from vime.agent.trajectory import ModelTurn, Trajectory
from vime.demo import running_sum
from vime.demo.tasks import DEMO_TASK_RECIPES, demo_task_of


def test_prompts_are_deterministic_and_every_total_keeps_its_digits() -> None:
    rows = running_sum.make_prompts(500, seed=3)
    assert rows == running_sum.make_prompts(500, seed=3) and rows != running_sum.make_prompts(500, seed=4)
    for row in rows:
        a, b, [c] = row["metadata"]["a"], row["metadata"]["b"], row["metadata"]["operands"]
        assert row["prompt"] == f"{a}+{b}=" and row["label"] == str(a + b + c)
        assert 10 <= a <= 99 and 10 <= b <= 99 and 1 <= c <= 9 and a + b + c <= 99


def test_the_environment_asks_for_the_running_total_and_rewards_only_the_final_answer() -> None:
    sample = Trajectory(index=0, prompt="23+45=", tokens=[1], label="75", metadata={"operands": [7]})
    env = running_sum.make_environment(sample, context=None)  # type: ignore[arg-type]

    def turn(text: str) -> ModelTurn:
        return ModelTurn(tokens=[], logprobs=[], versions=[], finish_reason="stop", text=text)

    async def play(first: str, second: str) -> tuple[str, bool, float | None]:
        env.turns = 0
        step = await env.step(sample, turn(first))
        assert not step.done and step.reward is None
        final = await env.step(sample, turn(second))
        return step.observation, final.done, final.reward

    assert asyncio.run(play("68", "75")) == ("+7=", True, 1.0)
    assert asyncio.run(play("67", "74")) == ("+7=", True, 0.0)  # a wrong first answer carried on: wrong
    assert asyncio.run(play("99", "75")) == ("+7=", True, 1.0)  # only the final total is rewarded


def test_the_warm_start_trains_the_answers_and_not_the_environments_text() -> None:
    from vime.demo.model_factory import _segments, _training_batch
    from vime.demo.tokenizer import EOS_ID, id_to_token

    symbols = id_to_token()
    segments = _segments(random.Random(0), 2, "running_sum")
    text = ["".join(symbols[t] for t in tokens) for tokens, _ in segments]
    a, b = (int(x) for x in text[0].rstrip("=").split("+"))
    c = int(text[2].strip("+="))
    assert text == [f"{a}+{b}=", f"{a + b}<eos>", f"+{c}=", f"{a + b + c}<eos>"]
    assert [trained for _, trained in segments] == [0, 1, 0, 1]
    ids, mask = _training_batch(random.Random(0), 4, 2, "running_sum")
    assert ids.shape[0] == 4 and int(mask.sum()) == 4 * 6  # two answers of 2 digits + EOS each
    assert ids[mask.bool()].tolist().count(EOS_ID) == 8


def test_a_job_on_the_running_sum_data_gets_the_multi_turn_demo_model() -> None:
    assert demo_task_of("demo:running_sum") == "running_sum" and demo_task_of("demo:arithmetic") == "arithmetic"
    assert demo_task_of("/data/x.jsonl") == "arithmetic"
    assert DEMO_TASK_RECIPES["running_sum"]["task"] == "running_sum"
