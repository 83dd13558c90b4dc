"""Render the sbatch script of a vime job from `templates/job.sbatch.j2`.

The script is a template rather than code-built text so that what users read and edit is what the
template says, comments included. Rendering is strict: a value the template names but the caller did
not pass is an error (jinja2's StrictUndefined), never an empty string in a shell command. Every path
and user-supplied value that lands in a command is shell-quoted (`|q`).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from vime.config import ConfigError
from vime.rollout.vllm_environment import cpu_rollout_environment
from vime.slurm.layout import JobLayout

TEMPLATE = "job.sbatch.j2"


@dataclass(frozen=True)
class ScriptPaths:
    """Absolute paths the script refers to; the run directory must be on a filesystem every node sees."""

    workdir: Path  # the job's working directory: relative paths in the config mean the same as here
    run_dir: Path
    config_path: Path
    vime_bin: Path  # holds vime-broker, vime-worker and vime

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def slurm_dir(self) -> Path:
        return self.run_dir / "slurm"


def find_vime_bin() -> Path:
    """Where the vime executables are: the repository's bin/ (a checkout), else next to this Python.

    FileNotFoundError names both places when neither has them.
    """
    checkout = Path(__file__).resolve().parents[2] / "bin"
    if (checkout / "vime-worker").is_file():
        return checkout
    installed = Path(sys.executable).parent
    if (installed / "vime-worker").is_file():
        return installed
    raise FileNotFoundError(f"no vime-worker in {checkout} or {installed}: install vime (pip install -e .) first")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("vime.slurm", "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,  # a shell script, not HTML; values are shell-quoted with |q instead
        # Bash's ${#array[@]} would open a jinja2 comment ({#): template comments are <#-- ... --#>.
        comment_start_string="<#--",
        comment_end_string="--#>",
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    env.filters["sbatch_value"] = sbatch_value
    return env


def sbatch_value(value: object) -> str:
    """A value for an `#SBATCH --opt=VALUE` line: sbatch reads double quotes, not shell quoting."""
    text = str(value)
    if '"' in text or "\n" in text:
        raise ConfigError(f"{text!r} cannot be written on an #SBATCH line (it holds a double quote or newline)")
    return f'"{text}"' if any(c.isspace() for c in text) else text


def render_script(
    layout: JobLayout,
    paths: ScriptPaths,
    *,
    job_name: str,
    generated_by: str,
    make_demo_model: bool = False,
    hf_checkpoint: str = "",
    demo_task: str = "arithmetic",
    engine_args: Mapping[str, Any] | None = None,
) -> str:
    """The sbatch script for `layout`.

    ConfigError for a scheduler value an #SBATCH line cannot hold; jinja2 errors (a template bug)
    propagate with their template line.
    """
    o = layout.options
    for value, flag in [(job_name, "--job-name"), (o.partition, "--partition"), (o.account, "--account"), (o.time, "--time")]:
        if value is not None and any(c.isspace() for c in value):
            raise ConfigError(f"{flag} {value!r} contains whitespace, which an #SBATCH line cannot hold")
    rollout_gpus = o.rollout_gpus_per_node if o.rollout_gpus_per_node is not None else o.gpus_per_node
    return _environment().get_template(TEMPLATE).render(
        layout=layout,
        o=o,
        job_name=job_name,
        generated_by=generated_by,
        workdir=paths.workdir,
        run_dir=paths.run_dir,
        logs_dir=paths.logs_dir,
        slurm_dir=paths.slurm_dir,
        config_path=paths.config_path,
        vime_bin=paths.vime_bin,
        make_demo_model=make_demo_model,
        hf_checkpoint=hf_checkpoint,
        demo_task=demo_task,
        rollout_gpus_per_node=rollout_gpus,
        cpu_rollout_env=cpu_rollout_environment(engine_args or {}),
    )


__all__ = ["ScriptPaths", "find_vime_bin", "render_script"]
