"""A tool-calling environment in the chat template's own syntax (Qwen3 / Hermes `<tool_call>` blocks).

    vime run my-job.yaml --apply-chat-template \
        --environment-path examples/tool_calling/env.py:make_environment \
        --tool-server-url http://127.0.0.1:8100 --max-turns 4 --rollout-max-context-len 4096

Each model turn is read for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks. With calls,
each is run through the job's tools (`--tool`, `--tool-server-url`) and the answers are appended as the
template renders `tool` messages, then the model's next turn. Without calls, the turn is the final
answer and the trajectory is done; the job's reward function (`--rm-type`, e.g. math) scores it.

A call the tool rejects (bad arguments, unknown tool, malformed JSON) is the model's mistake: its error
is shown to the model as the tool's answer, and counted (`rollout/tool_errors`). A tool server that does
not answer raises `ToolUnavailable`, which fails the trajectory's group: no answer is invented.
"""

from __future__ import annotations

from vime.agent import EnvContext, EnvStep, ModelTurn, ToolCallError, Trajectory
from vime.agent.tool_calls import parse_tool_calls, tool_response_text


class ToolCallingEnvironment:
    def __init__(self, context: EnvContext) -> None:
        self.context = context

    async def reset(self, sample: Trajectory) -> str | None:
        return None

    async def step(self, sample: Trajectory, turn: ModelTurn) -> EnvStep:
        try:
            calls = parse_tool_calls(turn.text)
        except ToolCallError as exc:
            sample.count("tool_errors")
            return EnvStep(observation=tool_response_text(self.context.tokenizer, [f"error: {exc}"], turn.text))
        if not calls:
            return EnvStep(done=True)  # a final answer: the job's reward function scores the response
        results = []
        for call in calls:
            try:
                results.append(await self.context.tools.call(sample, call.name, call.arguments))
            except ToolCallError as exc:  # ToolUnavailable propagates: the group fails
                results.append(f"error: {exc}")
        return EnvStep(observation=tool_response_text(self.context.tokenizer, results, turn.text))


def make_environment(sample: Trajectory, context: EnvContext) -> ToolCallingEnvironment:
    return ToolCallingEnvironment(context)
