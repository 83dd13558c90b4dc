"""Tool calls in a chat model's own syntax: parse them from a model turn, format the answers back.

Qwen3 (and Hermes-style templates) have the assistant write

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "17*23"}}
    </tool_call>

and put tool results in the next turn as `<tool_response>...</tool_response>`. `parse_tool_calls` reads
the first; `tool_response_text` renders the second with the tokenizer's own chat template, so the
environment appends exactly the text the template would have produced for a `tool` message, followed
by the template's generation prompt for the next assistant turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from vime.agent.tools import ToolCallError

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Qwen3's template for tool results, used when the tokenizer has no chat template that renders them.
QWEN3_TOOL_TURN = "\n<|im_start|>user\n{responses}<|im_end|>\n<|im_start|>assistant\n"
QWEN3_TOOL_RESPONSE = "<tool_response>\n{result}\n</tool_response>"


@dataclass(frozen=True)
class ToolCallRequest:
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(text: str) -> list[ToolCallRequest]:
    """Every `<tool_call>` of a model turn, in order; ToolCallError (to show the model) for one that is
    not a JSON object with a string `name` and an object `arguments`."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            payload = json.loads(body)
        except ValueError as exc:
            raise ToolCallError(f"the tool call is not valid JSON ({exc.msg} at position {exc.pos}): {body[:200]}") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            raise ToolCallError(f"a tool call needs a JSON object with a \"name\": {body[:200]}")
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ToolCallError(f"the arguments of tool {payload['name']!r} are not a JSON object: {arguments[:200]}") from None
        if not isinstance(arguments, dict):
            raise ToolCallError(f"the arguments of tool {payload['name']!r} must be a JSON object")
        calls.append(ToolCallRequest(payload["name"], arguments))
    return calls


def tool_response_text(tokenizer: Any, results: list[str], assistant_text: str = "x") -> str:
    """The text to append after an assistant turn that ended with the tokenizer's EOS token: the
    results as `tool` messages and the next assistant turn's header, rendered by the tokenizer's chat
    template (Qwen3's syntax where the template cannot render them).

    The template renders a conversation ending with the assistant turn and the same conversation with
    the tool messages and a generation prompt; the second minus the first, plus whatever the template
    writes after the assistant's EOS (Qwen3: a newline), is what the model has not seen yet."""
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": assistant_text}]
    tools = [{"role": "tool", "content": r} for r in results]
    eos = getattr(tokenizer, "eos_token", None)
    try:
        before = tokenizer.apply_chat_template(history, tokenize=False)
        after = tokenizer.apply_chat_template(history + tools, tokenize=False, add_generation_prompt=True)
    except Exception:  # no template, or one without tool messages
        before = after = ""
    if eos and before and after.startswith(before) and eos in before and all(r in after for r in results):
        tail = before[before.rindex(eos) + len(eos) :]
        return tail + after[len(before) :]
    return QWEN3_TOOL_TURN.format(responses="\n".join(QWEN3_TOOL_RESPONSE.format(result=r) for r in results))
