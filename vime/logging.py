"""Structured logging for every vime process.

Every log line is a structlog event. On a terminal it renders for humans; anywhere else (files, pipes,
SLURM logs) it is one JSON object per line so logs can be grepped and joined across processes. Each
process binds its identity once (`bind_process`) and long-lived loops bind the moving parts (weight
version, step) with `bind_progress`, so every line says who wrote it and at which point of training.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured = False


def configure_logging(level: str | None = None, json: bool | None = None) -> None:
    """Set up structlog once per process; later calls are no-ops.

    `json=None` picks JSON when stderr is not a terminal. `VIME_LOG_LEVEL` overrides the level.
    """
    global _configured
    if _configured:
        return
    level_name = (level or os.environ.get("VIME_LOG_LEVEL", "INFO")).upper()
    numeric_level = getattr(logging, level_name, logging.INFO)
    use_json = (not sys.stderr.isatty()) if json is None else json
    renderer: Any = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A logger for a module; configures logging with defaults if nobody did yet."""
    configure_logging()
    return structlog.get_logger(name)


def bind_process(role: str, worker_id: str, **extra: Any) -> None:
    """Bind the process identity (role, worker id) to every later log line of this process."""
    structlog.contextvars.bind_contextvars(role=role, worker_id=worker_id, pid=os.getpid(), **extra)


def bind_progress(weight_version: int | None = None, step: int | None = None) -> None:
    """Bind the current weight version and/or training step to every later log line."""
    values: dict[str, Any] = {}
    if weight_version is not None:
        values["weight_version"] = weight_version
    if step is not None:
        values["step"] = step
    structlog.contextvars.bind_contextvars(**values)
