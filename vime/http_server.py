"""Run a FastAPI app under uvicorn the way vime's servers do: structlog lines, the real port logged.

Shared by `vime-reward-server` and `vime-tool-server`: bind and listen first (so `--port 0` picks a free
port, the log says which, and a client that connects as soon as it reads that line is served), forward
uvicorn's stdlib log records to structlog, uvloop + httptools, keep-alive on, and a bounded graceful
shutdown on SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from vime.logging import get_logger


class _ToStructlog(logging.Handler):
    """uvicorn logs through stdlib logging; forward its records so every line is a structlog event."""

    def emit(self, record: logging.LogRecord) -> None:
        get_logger(record.name).log(record.levelno, record.getMessage())


def serve(app: Any, host: str, port: int, *, listening_event: str, **fields: Any) -> None:
    """Bind `host:port`, log `listening_event` with the real port, `url` and `fields`, and serve until
    stopped."""
    import uvicorn

    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers = [_ToStructlog()]
        logger.propagate = False
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(
        app, log_config=None, access_log=False, loop="uvloop", http="httptools", lifespan="on",
        timeout_keep_alive=30, timeout_graceful_shutdown=5,
    )  # fmt: skip
    # Listening before the "listening" line: a client that reads it and connects at once waits in the
    # kernel's queue until uvicorn accepts, instead of being refused while uvicorn starts.
    sock.listen(config.backlog)
    bound = sock.getsockname()[1]
    get_logger("vime.http").info(listening_event, host=host, port=bound, url=f"http://{host}:{bound}", **fields)
    uvicorn.Server(config).run(sockets=[sock])
