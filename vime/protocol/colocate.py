"""Messages between trainer rank 0 and the rollout workers whose engines share its GPU (`--colocate`).

The trainer's `ColocateServer` (ROUTER) and each worker's `ColocateClient` (DEALER), on one host:

    EngineJoin(worker_id, asleep)         every heartbeat: registration and liveness
    EngineSleep(step, level)          ->  EngineAsleep(step, seconds | error)
    EngineWake(step, version, endpoint) -> EngineAwake(step, version, seconds, update timings | error)
    EngineLeave(worker_id)                the worker stops (end of the job): wait for it no more

The trainer takes the GPU (every engine asleep) before a training step and hands it back (every engine
awake, on the newest weights) after publishing. An engine that joins while the trainer holds the GPU
is put to sleep at once. Malformed input is logged and dropped by either side.
"""

from __future__ import annotations

import math

from vime.protocol.codec import Message, require

MAX_ERROR_CHARS = 2000


def _valid_seconds(value: float) -> bool:
    return math.isfinite(value) and value >= 0


class EngineJoin(Message, tag="engine_join"):
    """Worker -> trainer, every heartbeat: this engine shares the trainer's GPU; whether it sleeps now."""

    worker_id: str
    asleep: bool = False
    weight_version: int = 0

    def validate(self) -> None:
        require(0 < len(self.worker_id) <= 256, "worker_id must be 1-256 chars")


class EngineLeave(Message, tag="engine_leave"):
    """Worker -> trainer, as its worker stops: forget this engine now rather than after its heartbeats
    have been missing for the engine timeout (a turn in progress stops waiting for it)."""

    worker_id: str

    def validate(self) -> None:
        require(0 < len(self.worker_id) <= 256, "worker_id must be 1-256 chars")


class EngineSleep(Message, tag="engine_sleep"):
    """Trainer -> worker: free the GPU for training step `step` (vLLM sleep level 1 or 2)."""

    step: int
    level: int

    def validate(self) -> None:
        require(self.level in (1, 2), f"sleep level must be 1 or 2, got {self.level}")


class EngineAsleep(Message, tag="engine_asleep"):
    """Worker -> trainer: the engine sleeps (or `error` says why it could not)."""

    step: int
    seconds: float
    error: str | None = None

    def validate(self) -> None:
        require(_valid_seconds(self.seconds), f"seconds {self.seconds} invalid")
        require(self.error is None or len(self.error) <= MAX_ERROR_CHARS, "error text too long")


class EngineWake(Message, tag="engine_wake"):
    """Trainer -> worker: take the GPU back; load weights >= `version` from `endpoint` first, if given."""

    step: int
    version: int | None = None
    endpoint: str | None = None

    def validate(self) -> None:
        require(self.version is None or self.version >= 0, f"version must be >= 0, got {self.version}")
        require(self.version is None or bool(self.endpoint), "a version to load needs an endpoint")


class EngineAwake(Message, tag="engine_awake"):
    """Worker -> trainer: the engine generates again, with `version`; the update's parts in seconds."""

    step: int
    version: int
    seconds: float
    fetch_s: float = 0.0
    load_s: float = 0.0
    nbytes: int = 0
    transport: str = ""
    error: str | None = None

    def validate(self) -> None:
        require(all(_valid_seconds(v) for v in (self.seconds, self.fetch_s, self.load_s)), "invalid seconds")
        require(self.nbytes >= 0, f"nbytes must be >= 0, got {self.nbytes}")
        require(self.error is None or len(self.error) <= MAX_ERROR_CHARS, "error text too long")


SERVER_ACCEPTS: tuple[type[Message], ...] = (EngineJoin, EngineLeave, EngineAsleep, EngineAwake)
CLIENT_ACCEPTS: tuple[type[Message], ...] = (EngineSleep, EngineWake)
MAX_MESSAGE_BYTES = 16 << 10
