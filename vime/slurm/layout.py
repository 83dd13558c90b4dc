"""Where every process of a vime job runs in a SLURM allocation, and the checks that it fits.

The layout (prime-rl style, no Ray): the broker on the first node; trainer ranks over the first
`trainer_nodes` nodes (one srun task per rank, the same number per node); rollout workers (one vLLM
engine each) over the next `rollout_nodes` nodes, or on the trainer nodes when `rollout_nodes` is 0
(colocated: the engines take the GPUs after the trainer's); reward workers on the rollout nodes. With
`hetjob`, trainer and rollout nodes are two components of a heterogeneous job, so they can come from
different partitions or node types.

`plan_layout` raises `SlurmLayoutError` (a `ConfigError`) naming the flag or config key that does not
fit: ranks that do not split evenly over nodes, more GPUs wanted on a node than it has, options that
only make sense for heterogeneous jobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vime.config import ConfigError, VimeConfig


class SlurmLayoutError(ConfigError):
    """The job does not fit the requested nodes; the message names the flag or key to change."""


@dataclass(frozen=True)
class SlurmOptions:
    """Everything `vime slurm` needs beyond the job config: node counts, GPUs, scheduler settings."""

    trainer_nodes: int = 1
    rollout_nodes: int = 1  # 0: rollout and reward workers share the trainer nodes
    gpus_per_node: int = 0  # 0: a CPU job (no --gres, vLLM-CPU settings as `vime run` uses)
    rollout_gpus_per_node: int | None = None  # hetjob: GPUs of a rollout node (default gpus_per_node)
    hetjob: bool = False
    partition: str | None = None
    rollout_partition: str | None = None  # hetjob only
    account: str | None = None
    time: str | None = None
    job_name: str | None = None
    interface: str | None = None  # network interface for ZeroMQ, NCCL and Gloo (e.g. ib0)
    broker_port: int | None = None  # default: derived from the job id
    master_port: int | None = None  # torch.distributed; default: broker port + 1
    exclusive: bool = True
    sbatch_args: tuple[str, ...] = ()  # extra `#SBATCH` lines (trainer component for hetjobs)
    rollout_sbatch_args: tuple[str, ...] = ()  # hetjob only: extra lines for the rollout component
    setup: tuple[str, ...] = ()  # shell lines run before anything starts (module load, venv, exports)
    grace_s: int = 60  # after training ends, how long workers get to exit before they are stopped


@dataclass(frozen=True)
class RoleLayout:
    """One srun step: which host array it runs on, how many tasks, and which GPUs each task sees.

    A task sees `gpus_per_task` GPUs starting at `gpu_first + gpu_stride * SLURM_LOCALID` in the
    node's GPU list (stride 0: every task of the node shares one slice, as trainer ranks do).
    """

    role: str
    hosts: str  # name of the bash array holding this step's hosts
    nodes: int
    ntasks: int
    tasks_per_node: int | None  # None: srun spreads `ntasks` over `nodes`
    het_group: int | None = None
    gpu_first: int = 0
    gpus_per_task: int = 0
    gpu_stride: int = 0


@dataclass(frozen=True)
class JobLayout:
    options: SlurmOptions
    trainer: RoleLayout
    rollout: RoleLayout
    reward: RoleLayout
    gpus_per_engine: int
    colocated: bool
    notes: list[str] = field(default_factory=list)

    @property
    def total_nodes(self) -> int:
        return self.options.trainer_nodes + self.options.rollout_nodes

    @property
    def cpu_only(self) -> bool:
        return self.options.gpus_per_node == 0 and not (self.options.rollout_gpus_per_node or 0)

    def summary(self) -> list[str]:
        """One line per role, for the script's header and the command's output."""
        o, t, r, w = self.options, self.trainer, self.rollout, self.reward
        trainer_nodes = "node 0" if o.trainer_nodes == 1 else f"nodes 0-{o.trainer_nodes - 1}"
        if self.colocated:
            rollout_nodes = f"the trainer {'node' if o.trainer_nodes == 1 else 'nodes'}"
        elif o.rollout_nodes == 1:
            rollout_nodes = f"node {o.trainer_nodes}"
        else:
            rollout_nodes = f"nodes {o.trainer_nodes}-{self.total_nodes - 1}"
        gpus = lambda n: f", {n} GPU{'s' if n != 1 else ''} each" if n else ""  # noqa: E731
        return [
            "broker: node 0",
            f"trainer: {t.ntasks} rank{'s' if t.ntasks != 1 else ''} on {trainer_nodes} "
            f"({t.tasks_per_node} per node{', one GPU each' if t.gpus_per_task else ''})",
            f"rollout: {r.ntasks} worker{'s' if r.ntasks != 1 else ''} on {rollout_nodes} "
            f"({r.tasks_per_node} per node{gpus(r.gpus_per_task)})",
            f"reward: {w.ntasks} worker{'s' if w.ntasks != 1 else ''} on {rollout_nodes}",
        ]


def gpus_per_engine(cfg: VimeConfig) -> int:
    """GPUs one rollout worker's vLLM engine needs (tensor x pipeline parallel size)."""
    tp = int(cfg.vllm.get("tensor_parallel_size", 1))
    pp = int(cfg.vllm.get("pipeline_parallel_size", 1))
    return max(1, tp) * max(1, pp)


def _per_node(total: int, nodes: int, what: str, flag: str) -> int:
    if nodes < 1:
        raise SlurmLayoutError(f"{flag} must be at least 1, got {nodes}")
    if total < nodes:
        raise SlurmLayoutError(f"{what} = {total} is fewer than {flag} {nodes}: some nodes would be idle")
    if total % nodes:
        raise SlurmLayoutError(
            f"{what} = {total} does not split evenly over {flag} {nodes} (every node runs the same number)"
        )
    return total // nodes


def plan_layout(cfg: VimeConfig, options: SlurmOptions) -> JobLayout:
    """Place the job's processes on nodes; SlurmLayoutError says what does not fit."""
    o = options
    if o.rollout_nodes < 0:
        raise SlurmLayoutError(f"--rollout-nodes must be 0 (colocated) or more, got {o.rollout_nodes}")
    if o.gpus_per_node < 0 or (o.rollout_gpus_per_node or 0) < 0:
        raise SlurmLayoutError("--gpus-per-node and --rollout-gpus-per-node cannot be negative")
    if not o.hetjob:
        for value, flag in [
            (o.rollout_partition, "--rollout-partition"),
            (o.rollout_gpus_per_node, "--rollout-gpus-per-node"),
            (o.rollout_sbatch_args or None, "--rollout-sbatch"),
        ]:
            if value is not None:
                raise SlurmLayoutError(f"{flag} describes the rollout component of a heterogeneous job: add --hetjob")
    elif o.rollout_nodes == 0:
        raise SlurmLayoutError("--hetjob needs rollout nodes of their own: --rollout-nodes 1 or more")
    colocated = o.rollout_nodes == 0
    if o.grace_s < 0:
        raise SlurmLayoutError(f"--grace must be >= 0 seconds, got {o.grace_s}")

    ranks_per_node = _per_node(cfg.trainer_world_size, o.trainer_nodes, "trainer_world_size", "--trainer-nodes")
    rollout_host_count = o.trainer_nodes if colocated else o.rollout_nodes
    engines_per_node = _per_node(
        cfg.num_rollout_workers, rollout_host_count, "num_rollout_workers",
        "--trainer-nodes (rollout workers colocated)" if colocated else "--rollout-nodes",
    )  # fmt: skip
    per_engine = gpus_per_engine(cfg)
    trainer_gpus = o.gpus_per_node
    rollout_gpus = o.rollout_gpus_per_node if o.rollout_gpus_per_node is not None else o.gpus_per_node
    notes: list[str] = []
    if trainer_gpus and ranks_per_node > trainer_gpus:
        raise SlurmLayoutError(
            f"{ranks_per_node} trainer ranks per node need {ranks_per_node} GPUs but --gpus-per-node is {trainer_gpus}: "
            f"raise --trainer-nodes or lower trainer_world_size"
        )
    rollout_first = ranks_per_node if (colocated and trainer_gpus) else 0
    if rollout_gpus:
        wanted = rollout_first + engines_per_node * per_engine
        if wanted > rollout_gpus:
            where = f"{ranks_per_node} trainer ranks + " if rollout_first else ""
            raise SlurmLayoutError(
                f"a {'trainer' if colocated else 'rollout'} node needs {wanted} GPUs ({where}{engines_per_node} rollout "
                f"engines x {per_engine} GPUs: vllm tensor_parallel_size x pipeline_parallel_size) but has "
                f"{rollout_gpus} (--{'rollout-' if o.rollout_gpus_per_node is not None else ''}gpus-per-node)"
            )
        if wanted < rollout_gpus:
            notes.append(f"{rollout_gpus - wanted} GPU(s) per rollout node stay unused")
    reward_group = 1 if o.hetjob else None
    trainer = RoleLayout(
        "trainer", "TRAINER_HOSTS", o.trainer_nodes, cfg.trainer_world_size, ranks_per_node,
        het_group=0 if o.hetjob else None, gpu_first=0, gpus_per_task=ranks_per_node if trainer_gpus else 0,
    )  # fmt: skip
    rollout = RoleLayout(
        "rollout", "ROLLOUT_HOSTS", rollout_host_count, cfg.num_rollout_workers, engines_per_node,
        het_group=reward_group, gpu_first=rollout_first, gpus_per_task=per_engine if rollout_gpus else 0,
        gpu_stride=per_engine if rollout_gpus else 0,
    )  # fmt: skip
    reward = RoleLayout(
        "reward", "REWARD_HOSTS", min(cfg.num_reward_workers, rollout_host_count), cfg.num_reward_workers, None,
        het_group=reward_group,
    )  # fmt: skip
    return JobLayout(o, trainer, rollout, reward, per_engine, colocated, notes)


__all__ = ["JobLayout", "RoleLayout", "SlurmLayoutError", "SlurmOptions", "gpus_per_engine", "plan_layout"]
