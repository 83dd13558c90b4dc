"""A rollout worker's agentic setup: the generate function, tokenizer, tools and environment factory.

Built once per worker from the job's config (`AgentRollout.from_config`, None for plain sampling),
then `generate_group` runs the generate function for each sample of a dispatched group
(`vime.agent.custom_generate`). `--environment-path` (or `--environment-url`, an environment on an
environment server) alone selects `vime.agent.multiturn.generate`; `--custom-generate-function-path`
replaces it (and may use the environment too).
"""

from __future__ import annotations

from typing import Any

from vime.agent.custom_generate import GenerateFunction, GroupOutcome, generate_group, load_generate_function
from vime.agent.environment import EnvContext, Environment, load_environment_factory, make_environment
from vime.agent.remote_environment import RemoteEnvironmentFactory
from vime.agent.tools import RemoteTools, Tools, load_local_tools
from vime.agent.trajectory import Trajectory
from vime.rollout.base import RolloutEngine, SamplingConfig


class AgentRollout:
    def __init__(self, cfg: Any, fn: GenerateFunction, tokenizer: Any, env_factory: Any | None, tools: Tools) -> None:
        self.cfg = cfg
        self.fn = fn
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self.tools = tools
        self.context = EnvContext(cfg=cfg, tokenizer=tokenizer, tools=tools)

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any = None) -> AgentRollout | None:
        """None when the job samples plainly; raises PluginLoadError for a bad spec (at start-up)."""
        if not cfg.agent_rollout:
            return None
        if cfg.custom_generate_function_path:
            fn = load_generate_function(cfg.custom_generate_function_path)
        else:
            from vime.agent.multiturn import generate as fn  # type: ignore[assignment]
        env_factory: Any = None
        if cfg.environment_path:
            env_factory = load_environment_factory(cfg.environment_path)
        elif cfg.environment_url:
            env_factory = RemoteEnvironmentFactory(cfg.environment_url, timeout_s=cfg.tool_timeout_s, retries=cfg.tool_retries)
        remote = (RemoteTools(cfg.tool_server_url, timeout_s=cfg.tool_timeout_s, retries=cfg.tool_retries)
                  if cfg.tool_server_url else None)  # fmt: skip
        tools = Tools(load_local_tools(list(cfg.tool)), remote)
        if tokenizer is None:
            from vime.data.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(cfg.hf_checkpoint)
        return cls(cfg, fn, tokenizer, env_factory, tools)

    async def _environment(self, sample: Trajectory) -> Environment:
        return await make_environment(self.env_factory, sample, self.context)

    async def generate_group(
        self, engine: RolloutEngine, *, prompt_text: str, prompt_tokens: list[int], label: str | None,
        metadata: dict[str, Any], n_samples: int, sampling: SamplingConfig,
    ) -> GroupOutcome:  # fmt: skip
        return await generate_group(
            self.fn, cfg=self.cfg, engine=engine, tokenizer=self.tokenizer,
            make_environment=self._environment if self.env_factory is not None else None,
            prompt_text=prompt_text, prompt_tokens=prompt_tokens, label=label, metadata=metadata,
            n_samples=n_samples, sampling=sampling, max_context_len=self.cfg.rollout_max_context_len,
        )  # fmt: skip

    async def aclose(self) -> None:
        await self.tools.aclose()
        if isinstance(self.env_factory, RemoteEnvironmentFactory):
            await self.env_factory.aclose()
