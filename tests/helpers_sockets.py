"""Shared set-up for the tests that talk to vime's sockets over loopback (test_curve, test_socket_fuzz,
test_weight_faults): a log recorder, a broker on its own thread, bare DEALER sockets, a weight
publisher, a free port.

Not a test module (pytest does not collect it); tests import it as `helpers_sockets`, which works
because tests/ has no __init__.py, so pytest puts tests/ itself on sys.path.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from vime.broker.server import BrokerServer
from vime.broker.settings import BrokerSettings
from vime.broker.state import BrokerState
from vime.data.prompts import Prompt, PromptCursor
from vime.protocol.weights import MIN_CHUNK_BYTES
from vime.security import Security, load_client_keys
from vime.weights import WeightPublisher


class Recorder:
    """Stands in for a module's structlog logger and keeps (level, event, fields). Thread-safe enough:
    list.append is atomic, and the ZAP and monitor threads log from their own threads."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str):  # type: ignore[no-untyped-def]
        def record(event: str, *args: Any, **fields: Any) -> None:
            self.records.append((level, event, fields))

        return record

    def events(self, name: str) -> list[dict[str, Any]]:
        return [fields for _, event, fields in list(self.records) if event == name]

    def count(self, name: str) -> int:
        return len(self.events(name))

    def wait_for(self, name: str, timeout_s: float = 20.0, **match: Any) -> dict[str, Any]:
        """The first `name` record whose fields contain every `match` value (as text); AssertionError
        after `timeout_s` without one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for fields in self.events(name):
                if all(str(v) in str(fields.get(k)) for k, v in match.items()):
                    return fields
            time.sleep(0.02)
        raise AssertionError(f"no {name} {match} logged; got {sorted({e for _, e, _ in self.records})}")


def start_broker(
    security: Security | None = None,
    bind: str = "tcp://127.0.0.1:*",
    *,
    n_prompts: int = 8,
    worker_timeout_s: float = 30.0,
    **server_kwargs: Any,
) -> tuple[str, BrokerServer, threading.Thread]:
    """A broker serving `n_prompts` copies of "1+1=" on a daemon thread; (endpoint, server, thread).
    `server_kwargs` go to BrokerServer (e.g. max_message_bytes)."""
    prompts = [Prompt(i, "1+1=", np.array([1, 2], dtype=np.int32), "2") for i in range(n_prompts)]
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4}
    settings = BrokerSettings(2, 2, 1, 1, 10, worker_timeout_s, sampling)
    state = BrokerState(settings, PromptCursor(prompts, shuffle=False, seed=0))
    server = BrokerServer(state, bind, security=security, **server_kwargs)
    endpoint = server.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    return endpoint, server, thread


def stop_broker(server: BrokerServer, thread: threading.Thread) -> bool:
    """Stops a broker from start_broker; whether its thread ended within 10 s."""
    server.stop()
    thread.join(timeout=10)
    return not thread.is_alive()


def start_publisher(
    state: list[tuple[str, torch.Tensor]] | None = None, *, version: int = 1, **publisher_kwargs: Any
) -> WeightPublisher:
    """A weight publisher with the smallest chunks (unless `chunk_bytes` says otherwise), holding
    `state` as `version` when given. Close it (or use it as a context manager)."""
    publisher_kwargs.setdefault("chunk_bytes", MIN_CHUNK_BYTES)
    pub = WeightPublisher(**publisher_kwargs)
    if state is not None:
        pub.publish(version, state)
    return pub


def dealer(
    ctx: zmq.Context,
    endpoint: str,
    keys_dir: Path | None = None,
    *,
    role: str = "rollout",
    identity: bytes | None = None,
) -> zmq.Socket:
    """A bare DEALER (no vime client code), linger 0: CURVE with `keys_dir`'s client key for `role`,
    or plaintext without `keys_dir`."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if keys_dir is not None:
        k = load_client_keys(keys_dir, role)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = k.server_public, k.public, k.secret
    sock.connect(endpoint)
    return sock


@contextlib.contextmanager
def bare_context() -> Iterator[zmq.Context]:
    """A context for bare sockets, destroyed (sockets closed, linger 0) even when an assertion fails:
    a context left to the garbage collector with open sockets can hang the process in term()."""
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
