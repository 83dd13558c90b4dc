"""The executor of a one-worker vLLM engine on the CPU: vLLM's in-process executor, usable there.

vLLM-CPU turns the name "uni" into its multiprocess executor. That executor's worker process
busy-polls its shared-memory queue for a second after every step, so while rollouts flow it never
gives its core back, and every step crosses one more process. Passed as a class, the in-process
executor is kept: the worker runs inside the engine core process, with the thread count of
OMP_NUM_THREADS (vime's launcher sets 1 on CPU) and no core pinned. Measurements: docs/benchmarks.md.
"""

from __future__ import annotations

import torch
from vllm.v1.executor.uniproc_executor import UniProcExecutor


class CpuInCoreExecutor(UniProcExecutor):
    """`UniProcExecutor` that first lets the process use AMX tiles, where the processor has them."""

    def _init_executor(self) -> None:
        # vLLM's CPU attention kernels use AMX where present, and Linux grants AMX to a process only on
        # request. The multiprocess worker start and torch.compile's ISA probe happen to ask; an eager
        # in-process engine does not, and its first attention step dies of SIGILL.
        if torch.cpu._is_amx_tile_supported():
            torch.cpu._init_amx()
        super()._init_executor()
