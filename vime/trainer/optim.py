"""AdamW for the torch backend's policy and critic, with the kernel implementation chosen by need.

PyTorch's AdamW has three implementations of the same update: `fused` (one kernel over all parameters,
no temporaries; CPU and CUDA), `foreach` (multi-tensor ops, which allocate parameter-sized temporaries
for the intermediate terms) and `for-loop` (one parameter at a time; PyTorch's CPU default). "auto"
picks `fused`, except for FSDP2's sharded (DTensor) parameters, where it picks `foreach`, the
implementation PyTorch documents for them. The figures (step time and peak memory) are in
docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch

OptimizerImplementation = Literal["auto", "fused", "foreach", "for-loop"]


def adamw(
    params: Iterable[Any], *, lr: float, implementation: OptimizerImplementation = "auto", sharded: bool = False,
    **kwargs: Any,
) -> torch.optim.AdamW:  # fmt: skip
    """`torch.optim.AdamW(params, lr, **kwargs)` with `implementation`'s kernels (`sharded`: the
    parameters are FSDP2 DTensors). Raises ValueError for an unknown implementation."""
    if implementation == "auto":
        implementation = "foreach" if sharded else "fused"
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    if implementation not in flags:
        raise ValueError(f"optimizer_implementation must be one of auto, {', '.join(flags)}; got {implementation!r}")
    return torch.optim.AdamW(params, lr=lr, **flags[implementation], **kwargs)
