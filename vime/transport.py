"""ZeroMQ sockets with the options vime relies on, set explicitly in one place.

- LINGER is bounded so a process never hangs in `term()` on unsent messages.
- MAXMSGSIZE makes libzmq drop oversized input before it is buffered (the codec checks again).
- ROUTER_MANDATORY turns silent drops to vanished peers into errors we log.
- ROUTER_HANDOVER lets a restarted worker reclaim its identity.
- HWMs are generous but finite: they count messages, not bytes.
- TCP keepalive and ZMTP heartbeats detect dead links below the application's own heartbeats.
- Security (CURVE keys, the ZAP allow-list, or the loopback-only plaintext rule) comes from a
  `vime.security` guard and is applied before the socket binds or connects; without a guard the
  plaintext rule applies, so a socket never listens on or connects to a network address unencrypted
  by accident.
"""

from __future__ import annotations

import zmq

from vime.security import ClientGuard, ServerGuard

DEFAULT_HWM = 10_000
LINGER_MS = 1_000


def _common(sock: zmq.Socket, max_message_bytes: int) -> None:  # type: ignore[type-arg]
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, DEFAULT_HWM)
    sock.setsockopt(zmq.RCVHWM, DEFAULT_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 5_000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30_000)


def make_router(
    context: zmq.Context,  # type: ignore[type-arg]
    bind: str,
    *,
    max_message_bytes: int = 1 << 30,
    guard: ServerGuard | None = None,
) -> zmq.Socket:  # type: ignore[type-arg]
    """A bound ROUTER for a server (broker). `guard` secures it (its context must be `context`);
    without one, plaintext on loopback only (SecurityError otherwise)."""
    guard = guard or ServerGuard(context, None, name="router", endpoint=bind)
    sock = context.socket(zmq.ROUTER)
    _common(sock, max_message_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    guard.secure(sock)
    try:
        sock.bind(bind)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


def make_dealer(
    context: zmq.Context,  # type: ignore[type-arg]
    connect: str,
    *,
    identity: bytes | None = None,
    max_message_bytes: int = 1 << 30,
    guard: ClientGuard | None = None,
) -> zmq.Socket:  # type: ignore[type-arg]
    """A DEALER connected to a server; `identity` makes reconnects recognisable to the ROUTER.
    `guard` secures it; without one, plaintext to loopback only (SecurityError otherwise)."""
    guard = guard or ClientGuard(None, role="", name="dealer", endpoint=connect)
    sock = context.socket(zmq.DEALER)
    _common(sock, max_message_bytes)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    guard.secure(sock)
    sock.connect(connect)
    return sock


def bound_endpoint(sock: zmq.Socket) -> str:  # type: ignore[type-arg]
    """The endpoint a socket actually bound (resolves `tcp://host:*` to the real port)."""
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
