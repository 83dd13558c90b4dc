"""Colocation (`--colocate`): the trainer and the rollout engines take turns on the same GPU.

`ColocateServer` runs in trainer rank 0 and takes the GPU before each step; `ColocateClient` runs in
each rollout worker and puts its engine to sleep and wakes it on command. Messages:
`vime.protocol.colocate`; the design and its measurements: docs/colocate.md.
"""

from vime.colocate.client import ColocateClient
from vime.colocate.server import ColocateError, ColocateServer, TurnStats

__all__ = ["ColocateClient", "ColocateError", "ColocateServer", "TurnStats"]
