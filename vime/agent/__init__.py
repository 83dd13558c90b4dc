"""Agentic rollouts: custom generate functions (slime's contract), multi-turn trajectories, environments
and tools. User docs: docs/agentic.md."""

from vime.agent.custom_generate import GenerateArgs, load_generate_function
from vime.agent.engine_handle import EngineHandle
from vime.agent.environment import EnvContext, Environment, EnvironmentFailure, EnvStep
from vime.agent.tools import RemoteTools, ToolCallError, Tools, ToolUnavailable
from vime.agent.trajectory import ModelTurn, Status, Trajectory, TrajectoryError

__all__ = [
    "EngineHandle", "EnvContext", "EnvStep", "Environment", "EnvironmentFailure", "GenerateArgs", "ModelTurn",
    "RemoteTools", "Status", "ToolCallError", "ToolUnavailable", "Tools", "Trajectory", "TrajectoryError",
    "load_generate_function",
]
