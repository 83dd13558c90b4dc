"""The engine as a custom generate function sees it: one token-in/token-out call at a time.

`EngineHandle.generate(tokens, sampling)` samples one continuation of `tokens` on the rollout worker's
engine and returns a `ModelTurn`: the new tokens, their processed logprobs, the weight version of each
token and the call's R3 trace. Every call is recorded for the trajectory it serves, so a slime-style
function that copies output tokens into `sample.tokens` itself still gets correct logprobs and
versions. `sampling` is a `SamplingConfig` or a dict with slime/SGLang names (`max_new_tokens`,
`temperature`, `top_p`, `top_k`, `stop_token_ids`, `seed`, `ignore_eos`) or vLLM's `max_tokens`;
keys the engine cannot honour (stop strings, detokenizer options) are ignored with one warning each.
A call is clamped to the context budget (`max_context_len`); with no room left it returns an empty
turn finished by "length" without calling the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vime.agent.trajectory import CallRecord, ModelTurn
from vime.logging import get_logger
from vime.rollout.base import RolloutEngine, SamplingConfig

log = get_logger(__name__)

_KEYS = {"temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed", "ignore_eos"}
# SGLang/slime names with the SamplingConfig field they mean.
_ALIASES = {"max_new_tokens": "max_tokens"}
_warned: set[str] = set()


def sampling_from(value: SamplingConfig | Mapping[str, Any], default: SamplingConfig) -> SamplingConfig:
    """A `SamplingConfig` from a config or a slime/vLLM-style dict layered over `default`."""
    if isinstance(value, SamplingConfig):
        return value
    overrides: dict[str, Any] = {}
    for key, item in value.items():
        name = _ALIASES.get(key, key)
        if name in _KEYS:
            if item is not None:
                overrides[name] = item
        elif key not in _warned:
            _warned.add(key)
            log.warning("sampling_key_ignored", key=key, hint="vime's engines take token ids: stop strings and "
                        "detokenizer options do not apply; use stop_token_ids")  # fmt: skip
    if overrides.get("top_k") == -1:
        overrides["top_k"] = 0  # SGLang/vLLM's "disabled"
    return dataclasses.replace(default, **overrides)


class EngineHandle:
    """One trajectory's access to the rollout engine; see the module docstring."""

    def __init__(self, engine: RolloutEngine, default_sampling: SamplingConfig, max_context_len: int | None = None) -> None:
        self._engine = engine
        self.default_sampling = default_sampling
        self.max_context_len = max_context_len
        self.record = CallRecord()
        self.calls = 0

    @property
    def weight_version(self) -> int:
        return self._engine.weight_version

    async def generate(self, tokens: list[int], sampling: SamplingConfig | Mapping[str, Any] | None = None) -> ModelTurn:
        """Sample one continuation of `tokens`. Cancelling the awaiting task aborts the request."""
        params = sampling_from(sampling if sampling is not None else {}, self.default_sampling)
        prompt = [int(t) for t in tokens]
        if self.max_context_len is not None:
            room = self.max_context_len - len(prompt)
            if room <= 0:
                return ModelTurn(tokens=[], logprobs=[], versions=[], finish_reason="length")
            if room < params.max_tokens:
                params = dataclasses.replace(params, max_tokens=room)
        [sample] = await self._engine.generate(prompt, n=1, sampling=params)
        turn = ModelTurn(
            tokens=[int(t) for t in sample.response_tokens],
            logprobs=[float(x) for x in sample.rollout_logprobs],
            versions=[int(v) for v in sample.token_versions],
            finish_reason=sample.finish_reason,
            text=sample.response_text,
            routed_experts=sample.routed_experts,
            num_experts=sample.num_experts,
        )
        self.record.add(prompt, turn)
        self.calls += 1
        return turn
