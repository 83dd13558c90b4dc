"""`vime slurm CONFIG [flags]`: write (and with --submit, submit) the sbatch script of a job.

Takes the same job flags as `vime run` (they are applied to CONFIG and the result is written to
RUN_DIR/config.yaml, which every process of the job reads) plus layout flags: how many trainer and
rollout nodes, GPUs per node, partitions, the network interface. The script goes to
RUN_DIR/slurm/job.sbatch (or --output; `-` prints it). Nothing is submitted without --submit.

Failure modes, each a message and exit code 2: a layout that does not fit (`SlurmLayoutError` names
the flag), an invalid config (`ConfigError`), no `sbatch` on PATH when --submit is given.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from vime.config import ConfigError, VimeConfig, add_config_flags, parse_config
from vime.demo.tasks import demo_task_of
from vime.slurm.layout import JobLayout, SlurmOptions, plan_layout
from vime.slurm.render import ScriptPaths, find_vime_bin, render_script


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vime slurm",
        description="write the sbatch script of a vime job (broker, trainer ranks, rollout and reward workers "
        "over SLURM nodes); --submit submits it",
        allow_abbrev=False,
    )
    parser.add_argument("config", type=Path, help="YAML job config (job flags below override it)")
    g = parser.add_argument_group("layout")
    g.add_argument("--trainer-nodes", type=int, default=1,
                   help="nodes for the trainer ranks (trainer_world_size / N per node); the first also runs the broker")
    g.add_argument("--rollout-nodes", type=int, default=1,
                   help="nodes for rollout (and reward) workers; 0: share the trainer nodes")
    g.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: a CPU job)")
    g.add_argument("--rollout-gpus-per-node", type=int, default=None, help="--hetjob: GPUs of a rollout node")
    g.add_argument("--hetjob", action="store_true",
                   help="trainer and rollout nodes as two components of a heterogeneous job")
    s = parser.add_argument_group("scheduler")
    s.add_argument("--partition", default=None)
    s.add_argument("--rollout-partition", default=None, help="--hetjob: partition of the rollout nodes")
    s.add_argument("--account", default=None)
    s.add_argument("--time", default=None, help="time limit, e.g. 24:00:00")
    s.add_argument("--job-name", default=None, help="default: vime-<run dir name>")
    s.add_argument("--no-exclusive", dest="exclusive", action="store_false", help="do not ask for whole nodes")
    s.add_argument("--sbatch", dest="sbatch_args", action="append", default=[], metavar="ARG",
                   help="extra #SBATCH line, e.g. --sbatch=--constraint=h100 (repeatable)")  # fmt: skip
    s.add_argument("--rollout-sbatch", dest="rollout_sbatch_args", action="append", default=[], metavar="ARG",
                   help="--hetjob: extra #SBATCH line for the rollout component (repeatable)")  # fmt: skip
    s.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="shell line run first, e.g. 'source /shared/venv/bin/activate' (repeatable)")  # fmt: skip
    n = parser.add_argument_group("network")
    n.add_argument("--interface", default=None, help="network interface for ZeroMQ, NCCL and Gloo (e.g. ib0, eth0)")
    n.add_argument("--broker-port", type=int, default=None, help="default: 20000 + job id %% 20000")
    n.add_argument("--master-port", type=int, default=None, help="torch.distributed port (default: broker port + 1)")
    r = parser.add_argument_group("output")
    r.add_argument("--grace", dest="grace_s", type=int, default=60, help="seconds processes get to exit at the end")
    r.add_argument("--output", default=None, help="script path (default RUN_DIR/slurm/job.sbatch; - prints it)")
    r.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    r.add_argument("--wait", action="store_true", help="with --submit: wait for the job and return its exit code")
    add_config_flags(parser)
    return parser


def options_from_args(args: argparse.Namespace) -> SlurmOptions:
    return SlurmOptions(
        trainer_nodes=args.trainer_nodes,
        rollout_nodes=args.rollout_nodes,
        gpus_per_node=args.gpus_per_node,
        rollout_gpus_per_node=args.rollout_gpus_per_node,
        hetjob=args.hetjob,
        partition=args.partition,
        rollout_partition=args.rollout_partition,
        account=args.account,
        time=args.time,
        job_name=args.job_name,
        interface=args.interface,
        broker_port=args.broker_port,
        master_port=args.master_port,
        exclusive=args.exclusive,
        sbatch_args=tuple(args.sbatch_args),
        rollout_sbatch_args=tuple(args.rollout_sbatch_args),
        setup=tuple(args.setup),
        grace_s=args.grace_s,
    )


def write_job(
    cfg: VimeConfig, layout: JobLayout, *, output: str | None, generated_by: str, workdir: Path | None = None
) -> tuple[str, Path | None]:
    """Write RUN_DIR/config.yaml and the script; returns (script text, its path or None for stdout)."""
    workdir = (workdir or Path.cwd()).resolve()
    run_dir = (workdir / cfg.run_dir).resolve()
    paths = ScriptPaths(
        workdir=workdir, run_dir=run_dir, config_path=run_dir / "config.yaml", vime_bin=find_vime_bin()
    )  # fmt: skip
    job_name = layout.options.job_name or "vime-" + re.sub(r"\s+", "-", run_dir.name)
    text = render_script(
        layout, paths, job_name=job_name, generated_by=generated_by,
        make_demo_model=cfg.make_demo_model, hf_checkpoint=str(cfg.hf_checkpoint), engine_args=cfg.vllm,
        demo_task=demo_task_of(cfg.prompt_data),
    )  # fmt: skip
    # sbatch does not create the directory of --output, and srun does not create the log directory.
    for directory in (paths.slurm_dir, paths.logs_dir):
        directory.mkdir(parents=True, exist_ok=True)
    paths.config_path.write_text(cfg.to_yaml())
    if output == "-":
        return text, None
    script = Path(output).resolve() if output else paths.slurm_dir / "job.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    script.chmod(0o755)
    return text, script


def with_job_keys(cfg: VimeConfig) -> VimeConfig:
    """A SLURM job's processes talk across nodes, so they use CURVE (docs/reliability.md): unless the
    config names its keys (--curve-keys-dir) or opts out (--allow-insecure), keys for the job are made
    (or reused) in RUN_DIR/keys, owner-only, and the written config points every process at them."""
    if cfg.curve_keys_dir is not None or cfg.allow_insecure:
        return cfg
    from vime.security import create_keys

    keys = (Path.cwd() / cfg.run_dir / "keys").resolve()
    create_keys(keys)
    print(f"vime slurm: CURVE keys of this job in {keys} (--curve-keys-dir DIR: your own; --allow-insecure: none)",
          file=sys.stderr)  # fmt: skip
    return cfg.model_copy(update={"curve_keys_dir": keys})


def submit(script: Path, *, wait: bool) -> int:
    """sbatch the script; with `wait`, block until the job ends and return its exit code."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print(f"vime slurm: sbatch is not on PATH: run this on a SLURM login node, or submit {script} by hand",
              file=sys.stderr)  # fmt: skip
        return 2
    argv = [sbatch, "--parsable", *(["--wait"] if wait else []), str(script)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    job_id = proc.stdout.readline().strip().split(";")[0]  # --parsable: "id" or "id;cluster", printed at once
    if job_id:
        print(f"vime slurm: submitted job {job_id}" + ("; waiting for it to end" if wait else ""), flush=True)
    rest = proc.stdout.read()
    code = proc.wait()
    if rest.strip():
        print(rest.rstrip())
    if wait or code != 0:
        print(f"vime slurm: sbatch exited with code {code}" + (f" (job {job_id})" if job_id else ""), file=sys.stderr)
    return code


def main(argv: list[str]) -> int:
    cfg, args = parse_config(argv, build_parser())
    if args.wait and not args.submit:
        print("vime slurm: --wait needs --submit", file=sys.stderr)
        return 2
    generated_by = "vime slurm " + shlex.join(argv)
    try:
        layout = plan_layout(cfg, options_from_args(args))
        cfg = with_job_keys(cfg)
        text, script = write_job(cfg, layout, output=args.output, generated_by=generated_by)
    except ConfigError as exc:
        print(f"vime slurm: {exc}", file=sys.stderr)
        return 2
    if script is None:
        sys.stdout.write(text)
        return 0
    print(f"vime slurm: wrote {script}")
    for line in layout.summary():
        print(f"  {line}")
    for note in layout.notes:
        print(f"  note: {note}")
    print(f"  config {cfg.run_dir / 'config.yaml'}; logs {cfg.run_dir / 'logs'}/")
    if not args.submit:
        print(f"submit with: sbatch {script}")
        return 0
    return submit(script, wait=args.wait)


__all__ = ["build_parser", "main", "options_from_args", "submit", "with_job_keys", "write_job"]
