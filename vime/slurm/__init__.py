"""Multi-node jobs on SLURM: host layout, the sbatch script (`vime slurm`), reachable endpoints.

`layout` places the processes on nodes and checks that they fit; `render` writes the sbatch script
from `templates/job.sbatch.j2`; `command` is the `vime slurm` subcommand; `network` turns a bound
ZeroMQ endpoint into one that other machines can connect to.
"""

from vime.slurm.layout import JobLayout, RoleLayout, SlurmLayoutError, SlurmOptions, plan_layout
from vime.slurm.network import advertised_endpoint

__all__ = ["JobLayout", "RoleLayout", "SlurmLayoutError", "SlurmOptions", "advertised_endpoint", "plan_layout"]
