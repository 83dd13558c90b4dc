"""An environment that lives on an environment server (`--environment-url URL/environments/NAME`).

The server (`vime-tool-server --environment NAME=path.py:make_env`) holds one session per trajectory;
this client opens it at `reset`, sends each model turn's text to `step` and closes it when the
trajectory ends. Each step carries its turn number, so a step retried after a lost answer gets the
answer of the first try instead of acting twice. Requests are retried like the remote reward client's
(`vime.agent.http_json`); a server that does not answer, refuses the session or fails a step raises
`EnvironmentFailure`: the trajectory's group fails, nothing is made up.
"""

from __future__ import annotations

from typing import Any

from vime.agent.environment import EnvContext, EnvironmentFailure, EnvStep
from vime.agent.http_json import JsonClient, ServiceUnavailable
from vime.agent.trajectory import ModelTurn, Trajectory


class RemoteEnvironment:
    def __init__(self, client: JsonClient, name: str) -> None:
        self._client = client
        self._name = name
        self._session: str | None = None
        self._turn = 0
        self._stats: dict[str, float] = {}

    async def _post(self, action: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            status, reply = await self._client.post(f"/environments/{self._name}/{action}", payload)
        except (ServiceUnavailable, ValueError) as exc:
            raise EnvironmentFailure(f"environment {self._name!r} {action}: {exc}") from None
        if status >= 400:
            raise EnvironmentFailure(f"environment {self._name!r} {action}: HTTP {status}: {reply.get('error', reply)}")
        return reply

    def _merge_stats(self, sample: Trajectory, reply: dict[str, Any]) -> None:
        """The server's counters of this session (tool calls, ...) are cumulative: add what is new."""
        for key, value in (reply.get("stats") or {}).items():
            if isinstance(value, (int, float)):
                sample.count(key, float(value) - self._stats.get(key, 0.0))
                self._stats[key] = float(value)

    async def reset(self, sample: Trajectory) -> str | None:
        reply = await self._post("reset", {"prompt": sample.prompt, "label": sample.label, "metadata": sample.metadata})
        if not isinstance(reply.get("session"), str):
            raise EnvironmentFailure(f"environment {self._name!r} reset: the answer names no session: {str(reply)[:200]}")
        self._session = reply["session"]
        self._merge_stats(sample, reply)
        observation = reply.get("observation")
        return observation if isinstance(observation, str) and observation else None

    async def step(self, sample: Trajectory, turn: ModelTurn) -> EnvStep:
        self._turn += 1
        reply = await self._post("step", {"session": self._session, "turn": self._turn, "action": turn.text})
        self._merge_stats(sample, reply)
        reward = reply.get("reward")
        if reward is not None and not isinstance(reward, (int, float)):
            raise EnvironmentFailure(f"environment {self._name!r} step: reward {reward!r} is not a number")
        return EnvStep(observation=str(reply.get("observation") or ""), done=bool(reply.get("done")),
                       reward=None if reward is None else float(reward), info=dict(reply.get("info") or {}))  # fmt: skip

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            try:
                await self._client.post(f"/environments/{self._name}/close", {"session": session})
            except (ServiceUnavailable, ValueError):
                pass  # the server drops idle sessions itself


class RemoteEnvironmentFactory:
    """`make_env(sample, context)` for `--environment-url http://HOST:PORT/environments/NAME`."""

    def __init__(self, url: str, *, timeout_s: float, retries: int) -> None:
        base, sep, name = url.rstrip("/").rpartition("/environments/")
        if not sep or not name or "/" in name:
            raise ValueError(f"--environment-url {url!r} must look like http://HOST:PORT/environments/NAME")
        self.name = name
        self.client = JsonClient(base, timeout_s=timeout_s, retries=retries)

    def __call__(self, sample: Trajectory, context: EnvContext) -> RemoteEnvironment:
        return RemoteEnvironment(self.client, self.name)

    async def aclose(self) -> None:
        await self.client.aclose()
