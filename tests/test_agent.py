"""Custom generate functions (slime's contract), multi-turn trajectories, environments and tools,
against a scripted engine: what the rollout worker sends for a group, without a model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import REPO, start_tool_server
from vime.agent import EnvStep, ModelTurn, Status, ToolCallError, Tools, ToolUnavailable, Trajectory
from vime.agent.calculator import calculator
from vime.agent.custom_generate import CustomGenerateError, generate_group, load_generate_function
from vime.agent.engine_handle import EngineHandle, sampling_from
from vime.agent.environment import EnvContext, make_environment
from vime.agent.tools import RemoteTools
from vime.agent.trajectory import TrajectoryError
from helpers_engines import StubEngine
from vime.rollout.base import GeneratedSample, RolloutEngine, SamplingConfig


class ScriptedEngine(StubEngine):
    """Answers each prompt with `reply(prompt)` tokens; logprob -0.5 - 0.01 * i per token; the weight
    version is whatever the test sets. Records every call."""

    def __init__(self, reply: Callable[[list[int]], list[int]], text: Callable[[list[int]], str] = lambda t: "") -> None:
        self.reply = reply
        self.text = text
        self.version = 3
        self.calls: list[tuple[list[int], SamplingConfig]] = []

    async def generate(self, prompt_tokens: list[int], n: int, sampling: SamplingConfig) -> list[GeneratedSample]:
        self.calls.append((list(prompt_tokens), sampling))
        out = self.reply(prompt_tokens)[: sampling.max_tokens]
        await asyncio.sleep(0)
        return [
            GeneratedSample(
                response_tokens=np.array(out, dtype=np.int32),
                rollout_logprobs=np.array([-0.5 - 0.01 * i for i in range(len(out))], dtype=np.float32),
                loss_mask=np.ones(len(out), dtype=np.uint8),
                token_versions=np.full(len(out), self.version, dtype=np.int32),
                finish_reason="stop" if len(out) < sampling.max_tokens else "length",
                response_text=self.text(out),
            )
            for _ in range(n)
        ]


class Cfg:
    """The config fields generate functions read."""

    max_turns = 4
    rollout_max_context_len: int | None = None
    rollout_max_response_len = 8
    n_samples_per_prompt = 2


def run_group(fn: Any, engine: RolloutEngine, *, prompt: list[int], n: int = 2, tokenizer: Any = None,
              env_factory: Any = None, tools: Tools | None = None, cfg: Any = None, max_context_len: int | None = None):  # type: ignore[no-untyped-def]
    cfg = cfg or Cfg()
    context = EnvContext(cfg=cfg, tokenizer=tokenizer, tools=tools or Tools())

    async def environment(sample: Trajectory) -> Any:
        return await make_environment(env_factory, sample, context)

    return asyncio.run(generate_group(
        fn, cfg=cfg, engine=engine, tokenizer=tokenizer, make_environment=environment if env_factory else None,
        prompt_text="p", prompt_tokens=prompt, label="7", metadata={"k": 1}, n_samples=n,
        sampling=SamplingConfig(max_tokens=8), max_context_len=max_context_len,
    ))  # fmt: skip


# --- slime's contract --------------------------------------------------------------------------------


SLIME_STYLE = '''
async def generate(args, sample, sampling_params):
    """Written as slime's examples are: the function keeps sample.tokens and the masks itself."""
    assert sample.status == sample.Status.PENDING
    prompt_tokens = list(sample.tokens)
    response_tokens, loss_mask, logprobs = [], [], []
    for turn in range(2):
        out = await args.engine.generate(prompt_tokens + response_tokens, sampling_params)
        response_tokens += out.tokens
        loss_mask += [1] * len(out.tokens)
        logprobs += out.logprobs
        tool_output = [40 + turn, 41 + turn]  # a tool's answer, not trained
        response_tokens += tool_output
        loss_mask += [0] * len(tool_output)
        logprobs += [0.0] * len(tool_output)
    sample.tokens = prompt_tokens + response_tokens
    sample.response_length = len(response_tokens)
    sample.loss_mask = loss_mask
    sample.rollout_log_probs = logprobs
    sample.response = "done"
    sample.status = sample.Status.COMPLETED
    return sample
'''


def test_a_slime_style_function_trains_model_tokens_only_with_versions_from_the_engine(tmp_path: Path) -> None:
    path = tmp_path / "slime_generate.py"
    path.write_text(SLIME_STYLE)
    fn = load_generate_function(f"{path}:generate")
    engine = ScriptedEngine(lambda prompt: [10 + len(prompt) % 5, 11])
    outcome = run_group(fn, engine, prompt=[1, 2, 3])
    assert outcome.failure is None, outcome.failure
    assert len(outcome.samples) == 2
    sample = outcome.samples[0]
    expected_tokens = [13, 11, 40, 41, 12, 11, 41, 42]  # model, tool, model, tool
    assert sample.response_tokens.tolist() == expected_tokens
    assert sample.loss_mask.tolist() == [1, 1, 0, 0, 1, 1, 0, 0]
    assert sample.rollout_logprobs.tolist() == pytest.approx([-0.5, -0.51, 0, 0, -0.5, -0.51, 0, 0])
    # The function never set weight_versions: the handle's record of its calls supplies them.
    assert sample.token_versions.tolist() == [3] * 8
    assert sample.finish_reason == "stop" and sample.response_text == "done"
    # The second call was conditioned on exactly the tokens of the first turn and the tool's answer.
    assert sorted(call[0] for call in engine.calls) == [[1, 2, 3]] * 2 + [[1, 2, 3, 13, 11, 40, 41]] * 2
    assert engine.calls[0][1].max_tokens == 8  # slime's max_new_tokens became the engine's max_tokens


def test_a_bad_spec_fails_at_load_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(CustomGenerateError, match="--custom-generate-function-path"):
        load_generate_function(f"{tmp_path / 'missing.py'}:generate")
    path = tmp_path / "too_many.py"
    path.write_text("def generate(args, sample, sampling_params, extra):\n    return sample\n")
    with pytest.raises(CustomGenerateError, match="generate\\(args, sample, sampling_params\\)"):
        load_generate_function(f"{path}:generate")


def test_an_exception_in_user_code_fails_the_group_with_its_traceback() -> None:
    async def generate(args, sample, sampling_params):  # type: ignore[no-untyped-def]
        out = await args.engine.generate(sample.tokens, sampling_params)
        sample.add_model_turn(out)
        if sample.index == 1:
            raise KeyError("tool 'search' is not configured")
        return sample

    outcome = run_group(generate, ScriptedEngine(lambda p: [5, 6]), prompt=[1], n=3)
    assert outcome.samples == [] and outcome.failure is not None
    assert "KeyError" in outcome.failure and "tool 'search' is not configured" in outcome.failure
    assert "in generate" in outcome.failure  # the traceback names the user's frame


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda s: setattr(s, "response_length", s.response_length + 1), "response_length"),
        (lambda s: setattr(s, "loss_mask", [1]), "loss_mask has 1 entries"),
        (lambda s: s.tokens.append(9) or setattr(s, "response_length", s.response_length + 1), "trained token"),
        (lambda s: None if s.fail("the sandbox crashed") else None, "the sandbox crashed"),
    ],
)
def test_a_sample_that_breaks_the_contract_fails_its_group_with_the_reason(breakage: Any, message: str) -> None:
    async def generate(args, sample, sampling_params):  # type: ignore[no-untyped-def]
        sample.add_model_turn(await args.engine.generate(sample.tokens, sampling_params))
        sample.rollout_log_probs = None if message == "trained token" else sample.rollout_log_probs
        sample.loss_mask = None if message == "trained token" else sample.loss_mask
        breakage(sample)
        return sample

    outcome = run_group(generate, ScriptedEngine(lambda p: [5, 6]), prompt=[1])
    assert outcome.failure is not None and message in outcome.failure, outcome.failure


def test_a_function_that_returns_something_else_fails_the_group() -> None:
    outcome = run_group(lambda args, sample, params: {"tokens": []}, ScriptedEngine(lambda p: [5]), prompt=[1])
    assert outcome.failure is not None and "returned dict, not the sample" in outcome.failure


# --- multi-turn trajectories -------------------------------------------------------------------------


class LossyTokenizer:
    """Characters 'a'..'z' are ids 1..26, and the pair "ab" has its own id 99, which `encode` prefers:
    the model sampling 'a' then 'b' (ids 1, 2) decodes to "ab", which encodes back to [99]."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                ids.append(99)
                i += 2
            else:
                ids.append(ord(text[i]) - 96)
                i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join("ab" if t == 99 else chr(t + 96) for t in ids)


class EchoEnvironment:
    """Answers every model turn with "c" + its turn number in letters; done after `turns` turns, with
    reward 1 if the model's last turn decoded to "ab"."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.seen = 0

    async def reset(self, sample: Trajectory) -> str | None:
        return None

    async def step(self, sample: Trajectory, turn: ModelTurn) -> EnvStep:
        self.seen += 1
        if self.seen >= self.turns:
            return EnvStep(done=True, reward=float(turn.text == "ab"))
        return EnvStep(observation="c" * self.seen)


def test_multi_turn_keeps_the_models_own_tokens_where_a_text_round_trip_would_change_them() -> None:
    from vime.agent.multiturn import generate

    tokenizer = LossyTokenizer()
    assert tokenizer.encode(tokenizer.decode([1, 2])) == [99]  # the round trip is lossy
    engine = ScriptedEngine(lambda prompt: [1, 2], text=tokenizer.decode)
    outcome = run_group(generate, engine, prompt=[20, 21], n=1, tokenizer=tokenizer, env_factory=lambda s, c: EchoEnvironment(3))
    assert outcome.failure is None, outcome.failure
    [sample] = outcome.samples
    # model [1, 2], env "c", model [1, 2], env "cc", model [1, 2]: never the re-encoded [99]
    assert sample.response_tokens.tolist() == [1, 2, 3, 1, 2, 3, 3, 1, 2]
    assert sample.loss_mask.tolist() == [1, 1, 0, 1, 1, 0, 0, 1, 1]
    assert [call[0] for call in engine.calls] == [[20, 21], [20, 21, 1, 2, 3], [20, 21, 1, 2, 3, 1, 2, 3, 3]]
    assert 99 not in sample.response_tokens.tolist()
    assert outcome.rewards == [1.0]
    assert outcome.stats[0]["turns"] == 3 and outcome.stats[0]["masked_tokens"] == 3
    assert sample.finish_reason == "stop"


def test_env_tokens_carry_the_version_of_the_model_turn_before_them_across_a_weight_update() -> None:
    from vime.agent.multiturn import generate

    engine = ScriptedEngine(lambda prompt: [1, 2])

    class UpdatingEnvironment(EchoEnvironment):
        async def step(self, sample: Trajectory, turn: ModelTurn) -> EnvStep:
            engine.version += 1  # a weight update lands between two turns (a partial rollout)
            return await super().step(sample, turn)

    outcome = run_group(generate, engine, prompt=[20], n=1, tokenizer=LossyTokenizer(),
                        env_factory=lambda s, c: UpdatingEnvironment(3))  # fmt: skip
    [sample] = outcome.samples
    assert sample.token_versions.tolist() == [3, 3, 3, 4, 4, 4, 4, 5, 5]
    assert sample.min_version == 3


def test_a_first_observation_takes_the_version_of_the_model_token_after_it() -> None:
    """An environment that speaks first (reset returns text): its tokens come before any model token.
    They were stamped version 0, so at weight version 5 the staleness gate saw a sample 5 versions old
    and dropped it; they now carry the first model token's version."""
    from vime.agent.multiturn import generate

    class Greeter(EchoEnvironment):
        async def reset(self, sample: Trajectory) -> str | None:
            return "ab"

    engine = ScriptedEngine(lambda prompt: [1, 2])
    engine.version = 5
    outcome = run_group(generate, engine, prompt=[20], n=1, tokenizer=LossyTokenizer(), env_factory=lambda s, c: Greeter(2))
    [sample] = outcome.samples
    assert sample.loss_mask.tolist() == [0, 1, 1, 0, 1, 1]  # "ab" encodes to one token
    assert sample.token_versions.tolist() == [5] * 6 and sample.min_version == 5


def test_turn_and_token_budgets_truncate_the_trajectory() -> None:
    from vime.agent.multiturn import generate

    cfg = Cfg()
    cfg.max_turns = 2
    outcome = run_group(generate, ScriptedEngine(lambda p: [1, 2]), prompt=[20], n=1, tokenizer=LossyTokenizer(),
                        env_factory=lambda s, c: EchoEnvironment(10), cfg=cfg)  # fmt: skip
    [sample] = outcome.samples
    assert sample.finish_reason == "length" and outcome.stats[0]["turns"] == 2 and outcome.stats[0]["turn_limit_hits"] == 1

    cfg = Cfg()
    cfg.rollout_max_context_len = 6
    engine = ScriptedEngine(lambda p: [1, 2, 3, 4])
    outcome = run_group(generate, engine, prompt=[20], n=1, tokenizer=LossyTokenizer(),
                        env_factory=lambda s, c: EchoEnvironment(10), cfg=cfg, max_context_len=6)  # fmt: skip
    [sample] = outcome.samples
    assert 1 + len(sample.response_tokens) <= 6
    assert sample.finish_reason == "length"
    assert all(len(prompt) + s.max_tokens <= 6 for prompt, s in engine.calls)


def test_an_environment_that_raises_fails_the_group() -> None:
    from vime.agent.multiturn import generate

    class Broken(EchoEnvironment):
        async def step(self, sample: Trajectory, turn: ModelTurn) -> EnvStep:
            raise RuntimeError("sandbox lost")

    outcome = run_group(generate, ScriptedEngine(lambda p: [1]), prompt=[20], tokenizer=LossyTokenizer(),
                        env_factory=lambda s, c: Broken(3))  # fmt: skip
    assert outcome.failure is not None and "sandbox lost" in outcome.failure


def test_sampling_dicts_in_slime_and_vllm_names() -> None:
    default = SamplingConfig(temperature=1.0, max_tokens=16)
    assert sampling_from({"max_new_tokens": 4, "top_k": -1, "temperature": 0.7}, default) == SamplingConfig(
        temperature=0.7, max_tokens=4, top_k=0
    )
    assert sampling_from({"max_tokens": 5, "stop": ["</tool_call>"], "skip_special_tokens": False}, default).max_tokens == 5
    handle = EngineHandle(ScriptedEngine(lambda p: [1] * 10), default, max_context_len=4)
    turn = asyncio.run(handle.generate([7, 7, 7, 7]))
    assert turn.tokens == [] and turn.finish_reason == "length" and handle.calls == 0


# --- tools -------------------------------------------------------------------------------------------


def test_local_tools_count_calls_and_errors_on_the_trajectory() -> None:
    async def lookup(key: str) -> str:
        return {"x": "42"}[key]

    tools = Tools({"calculator": calculator, "lookup": lookup})
    sample = Trajectory(index=0, prompt="", tokens=[1])

    async def calls() -> list[str]:
        out = [await tools.call(sample, "calculator", {"expression": "(2+3)*4"}), await tools.call(sample, "lookup", {"key": "x"})]
        for name, arguments in [("calculator", {"expr": "1"}), ("lookup", {"key": "y"}), ("nope", {}), ("calculator", {"expression": "__import__('os')"})]:
            with pytest.raises(ToolCallError):
                await tools.call(sample, name, arguments)
        return out

    assert asyncio.run(calls()) == ["20", "42"]
    assert sample.stats["tool_calls"] == 6 and sample.stats["tool_errors"] == 4


def test_the_calculator_refuses_what_is_not_arithmetic() -> None:
    assert calculator("2**10 - 1") == "1023" and calculator("7/2") == "3.5"
    for bad in ["2**1000000", "1/0", "open('x')", "a+1", "[1]"]:
        with pytest.raises(ValueError):
            calculator(bad)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real `vime-tool-server` process with the calculator, a user tool that raises, and the
    multi-turn demo's environment."""
    folder = tmp_path_factory.mktemp("tools")
    (folder / "user_tools.py").write_text("def fail(reason):\n    raise RuntimeError(reason)\n")
    process, url = start_tool_server(
        folder / "server.log", "--tool", f"fail={folder / 'user_tools.py'}:fail",
        "--environment", "running_sum=vime.demo.running_sum:make_environment",
    )
    yield url
    process.terminate()
    process.wait(timeout=10)


def test_remote_tools_answer_and_the_calls_own_errors_are_shown_to_the_model(tool_server: str) -> None:
    tools = Tools(remote=RemoteTools(tool_server, timeout_s=10, retries=1))
    sample = Trajectory(index=0, prompt="", tokens=[1])

    async def calls() -> tuple[str, list[str]]:
        try:
            result = await tools.call(sample, "calculator", {"expression": "6*7"})
            errors = []
            for name, arguments in [("fail", {"reason": "no such file"}), ("missing", {}), ("calculator", {"x": 1})]:
                with pytest.raises(ToolCallError) as info:
                    await tools.call(sample, name, arguments)
                errors.append(str(info.value))
            return result, errors
        finally:
            await tools.aclose()

    result, errors = asyncio.run(calls())
    assert result == "42"
    assert "no such file" in errors[0] and "unknown tool 'missing'" in errors[1] and "TypeError" in errors[2]
    assert sample.stats["tool_calls"] == 4 and sample.stats["tool_errors"] == 3


def test_an_unreachable_tool_server_is_unavailable_after_its_retries_never_an_answer() -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tools = Tools(remote=RemoteTools(f"http://127.0.0.1:{port}", timeout_s=2, retries=2, backoff_s=0.01))
    sample = Trajectory(index=0, prompt="", tokens=[1])

    async def call() -> None:
        try:
            await tools.call(sample, "calculator", {"expression": "1+1"})
        finally:
            await tools.aclose()

    with pytest.raises(ToolUnavailable, match="after 3 attempts"):
        asyncio.run(call())
    assert sample.stats["tool_errors"] == 1


def test_a_trajectory_that_ends_after_an_env_turn_cannot_carry_an_r3_trace() -> None:
    sample = Trajectory(index=0, prompt="", tokens=[1, 2])
    trace = np.zeros((3, 1, 2), dtype=np.uint8)  # covers prompt + 2 model tokens - 1
    sample.add_model_turn(ModelTurn(tokens=[3, 4], logprobs=[-1.0, -1.0], versions=[0, 0], finish_reason="stop",
                                    routed_experts=trace, num_experts=4))  # fmt: skip
    assert sample.finish().routed_experts is trace
    sample.add_env_turn([5])
    with pytest.raises(TrajectoryError, match="must end with a model turn"):
        sample.finish()
    assert Status.COMPLETED.value == "completed"


# --- the reward worker and the rollout worker's failed groups ----------------------------------------


def test_the_reward_worker_keeps_environment_rewards_and_rollout_failures_and_scores_the_rest() -> None:
    from vime.protocol.messages import Group, Sample, ScoringGroup
    from vime.workers.reward import LocalScorer, score_groups
    from vime.workers.rollout import failed_sample

    seen: list[str] = []

    async def reward_fn(prompt, response, label, metadata):  # type: ignore[no-untyped-def]
        from vime.rewards.types import RewardResult

        seen.append(response)
        return RewardResult(reward=0.5)

    def sample(i: int, text: str, reward: float | None = None) -> Sample:
        toks = np.arange(2, dtype=np.int32)
        return Sample(i, toks, np.zeros(2, np.float32), np.ones(2, np.uint8), np.zeros(2, np.int32), "stop", text, reward=reward)

    env_rewarded = Group("g0", 0, 0, np.arange(3, dtype=np.int32), "p", 2, "7", {}, 0, [sample(0, "a", 1.0), sample(1, "b")])
    failed = Group("g1", 1, 0, np.arange(3, dtype=np.int32), "p", 2, "7", {}, 0,
                   [failed_sample(i, "Traceback ...\nKeyError: 'search'") for i in range(2)])  # fmt: skip
    for group in (env_rewarded, failed):
        group.validate()  # what the rollout worker sends is a valid message
    scoring = [ScoringGroup.of(g) for g in (env_rewarded, failed)]  # what the broker sends the reward worker
    scores = asyncio.run(score_groups(LocalScorer(reward_fn), scoring))
    assert seen == ["b"]  # only the sample nobody had judged went to the reward function
    assert scores[0].rewards == [1.0, 0.5] and scores[0].failed == [False, False]
    assert scores[1].failed == [True, True] and "KeyError: 'search'" in scores[1].reasons[0]


# --- tool calls in the chat template's syntax (examples/tool_calling) ----------------------------------

QWEN_LIKE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTokenizer:
    """Byte-level ids (one per character) with a Qwen-like chat template rendered by jinja2."""

    eos_token = "<|im_end|>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False) -> str:
        import jinja2

        return jinja2.Template(QWEN_LIKE_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)


def load_example_environment() -> Any:
    from vime.agent.environment import load_environment_factory

    return load_environment_factory(str(REPO / "examples" / "tool_calling" / "env.py") + ":make_environment")


def test_tool_calls_in_the_templates_syntax_run_on_a_tool_server_and_answer_in_a_masked_turn(tool_server: str) -> None:
    from vime.agent.multiturn import generate

    tokenizer = ChatTokenizer()
    turns = [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
        "The answer is 391.",
    ]
    engine = ScriptedEngine(lambda prompt: [7, 8], text=lambda out: turns[min(len(engine.calls), 3) - 1])
    tools = Tools(remote=RemoteTools(tool_server, timeout_s=10, retries=0))
    outcome = run_group(generate, engine, prompt=[1, 2], n=1, tokenizer=tokenizer, env_factory=load_example_environment(),
                        tools=tools)  # fmt: skip
    asyncio.run(tools.aclose())
    assert outcome.failure is None, outcome.failure
    [sample] = outcome.samples
    text = sample.response_text
    # The answer, in the template's tool turn, after the newline the template writes after <|im_end|>:
    assert "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert "unexpected keyword argument 'expr'" in text  # a bad call's error is shown to the model
    assert outcome.stats[0]["tool_calls"] == 2 and outcome.stats[0]["tool_errors"] == 1 and outcome.stats[0]["turns"] == 3
    masked = sample.loss_mask == 0
    assert sample.response_tokens[masked].tolist() == tokenizer.encode(text.replace(turns[0], "").replace(turns[1], "").replace(turns[2], ""))
    assert sample.response_tokens[~masked].tolist() == [7, 8] * 3


def test_a_tool_server_that_goes_away_fails_the_tool_calling_group() -> None:
    from vime.agent.multiturn import generate

    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    tools = Tools(remote=RemoteTools(f"http://127.0.0.1:{port}", timeout_s=2, retries=1, backoff_s=0.01))
    outcome = run_group(generate, ScriptedEngine(lambda p: [7], text=lambda out: call), prompt=[1], n=2,
                        tokenizer=ChatTokenizer(), env_factory=load_example_environment(), tools=tools)  # fmt: skip
    asyncio.run(tools.aclose())
    assert outcome.samples == [] and outcome.failure is not None and "ToolUnavailable" in outcome.failure


def test_malformed_tool_calls_are_the_models_error_to_see() -> None:
    from vime.agent.tool_calls import parse_tool_calls, tool_response_text

    assert parse_tool_calls('a <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[0].arguments == {"x": 1}
    for bad in ["<tool_call>{oops}</tool_call>", '<tool_call>["f"]</tool_call>', '<tool_call>{"name": "f", "arguments": 3}</tool_call>']:
        with pytest.raises(ToolCallError):
            parse_tool_calls(bad)
    # Without a template that renders tool messages: Qwen3's own syntax.
    assert tool_response_text(object(), ["5"]) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


# --- environments on an environment server ------------------------------------------------------------


def test_a_remote_environment_plays_like_the_local_one(tool_server: str) -> None:
    from vime.agent.multiturn import generate
    from vime.agent.remote_environment import RemoteEnvironmentFactory
    from vime.demo import running_sum

    tokenizer = LossyTokenizer()
    [row] = running_sum.make_prompts(1, seed=0)
    answers = iter([str(row["metadata"]["a"] + row["metadata"]["b"]), row["label"]])  # both turns right
    engine = ScriptedEngine(lambda prompt: [5, 6], text=lambda out: next(answers))
    factory = RemoteEnvironmentFactory(f"{tool_server}/environments/running_sum", timeout_s=10, retries=1)

    async def play() -> Any:
        context = EnvContext(cfg=Cfg(), tokenizer=tokenizer, tools=Tools())

        async def environment(sample: Trajectory) -> Any:
            return await make_environment(factory, sample, context)

        try:
            return await generate_group(
                generate, cfg=Cfg(), engine=engine, tokenizer=tokenizer, make_environment=environment,
                prompt_text=row["prompt"], prompt_tokens=[20, 21], label=row["label"], metadata=row["metadata"],
                n_samples=1, sampling=SamplingConfig(max_tokens=8), max_context_len=None,
            )  # fmt: skip
        finally:
            await factory.aclose()

    outcome = asyncio.run(play())
    assert outcome.failure is None, outcome.failure
    assert outcome.rewards == [1.0]  # the server's environment judged the final answer
    operand = row["metadata"]["operands"][0]
    [sample] = outcome.samples
    assert sample.loss_mask.tolist() == [1, 1] + [0] * len(f"+{operand}=") + [1, 1]
    import urllib.request

    health = json.loads(urllib.request.urlopen(f"{tool_server}/health", timeout=10).read())
    assert health["sessions"] == 0  # the trajectory closed its session


def test_a_retried_step_gets_the_first_answer_and_does_not_act_twice(tool_server: str) -> None:
    from vime.agent.http_json import JsonClient

    async def exchange() -> list[tuple[int, dict]]:
        client = JsonClient(tool_server, timeout_s=10, retries=0)
        try:
            _, opened = await client.post("/environments/running_sum/reset", {"prompt": "23+45=", "label": "75", "metadata": {"operands": [7]}})
            session = opened["session"]
            first = await client.post("/environments/running_sum/step", {"session": session, "turn": 1, "action": "68"})
            again = await client.post("/environments/running_sum/step", {"session": session, "turn": 1, "action": "68"})
            final = await client.post("/environments/running_sum/step", {"session": session, "turn": 2, "action": "75"})
            skipped = await client.post("/environments/running_sum/step", {"session": session, "turn": 5, "action": "1"})
            unknown = await client.post("/environments/running_sum/step", {"session": "nope", "turn": 1, "action": "1"})
            missing = await client.post("/environments/nope/reset", {"prompt": "x"})
            return [first, again, final, skipped, unknown, missing]
        finally:
            await client.aclose()

    first, again, final, skipped, unknown, missing = asyncio.run(exchange())
    assert first == again and first[1]["observation"] == "+7=" and not first[1]["done"]
    assert final[1]["done"] and final[1]["reward"] == 1.0  # turn 2 after a retried turn 1: the environment moved once
    assert skipped[0] == 422 and "out of order" in skipped[1]["error"]
    assert unknown[0] == 404 and missing[0] == 404


def test_an_unreachable_environment_server_fails_the_group() -> None:
    import socket

    from vime.agent.multiturn import generate
    from vime.agent.remote_environment import RemoteEnvironmentFactory

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    factory = RemoteEnvironmentFactory(f"http://127.0.0.1:{port}/environments/running_sum", timeout_s=2, retries=1)
    outcome = run_group(generate, ScriptedEngine(lambda p: [1]), prompt=[20], tokenizer=LossyTokenizer(), env_factory=factory)
    asyncio.run(factory.aclose())
    assert outcome.failure is not None and "EnvironmentFailure" in outcome.failure and "gave no answer" in outcome.failure


def test_bad_tool_environment_and_url_specs_fail_at_start_naming_the_flag() -> None:
    from vime.agent.tools import load_local_tools
    from vime.config import ConfigError, load_config
    from vime.plugins import PluginLoadError, split_named_specs

    for bad in (["calculator"], ["=vime.agent.calculator:calculator"], ["calc="]):
        with pytest.raises(PluginLoadError, match="--tool .*expected NAME=path/to/file.py:function"):
            load_local_tools(bad)
    with pytest.raises(PluginLoadError, match="--environment: the name 'sum' is given twice"):
        split_named_specs(["sum=a.py:f", " sum =b.py:g"], "--environment")
    for url in ("http://h:1/tools/x", "h:1/environments/x", "http://h:1/environments/"):
        with pytest.raises(ConfigError, match="environment_url"):
            load_config(None, {"environment_url": url})
    with pytest.raises(ConfigError, match="environment_path and environment_url both"):
        load_config(None, {"environment_url": "http://h:1/environments/x", "environment_path": "e.py:f"})
