"""Endpoints that other machines can connect to.

A process that binds a wildcard address (`tcp://*:*`, `tcp://0.0.0.0:5555`) listens on every
interface, but the endpoint ZeroMQ reports for it (`tcp://0.0.0.0:41234`) means "this machine" to
whoever connects to it, so it must not be handed to workers on other nodes as is. `advertised_endpoint`
turns a bound endpoint into one to advertise: an explicit host wins, a concrete bound address is kept,
and a wildcard falls back to this machine's host name (which then has to resolve on the other nodes;
pass the host explicitly, e.g. the IP of the cluster interface, when it does not).
"""

from __future__ import annotations

import socket

WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})


def split_tcp_endpoint(endpoint: str) -> tuple[str, str]:
    """`tcp://HOST:PORT` -> (HOST, PORT); ValueError naming the endpoint if it is not of that shape."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or not port:
        raise ValueError(f"not a tcp://HOST:PORT endpoint: {endpoint!r}")
    return host, port


def advertised_endpoint(bound: str, host: str | None = None) -> str:
    """The endpoint peers should connect to for a socket bound at `bound` (its LAST_ENDPOINT).

    Non-TCP endpoints (ipc://, inproc://) are returned unchanged: they only work on this machine
    anyway. `host` replaces the bound host when given (IPv6 literals get their brackets).
    """
    if not bound.startswith("tcp://"):
        return bound
    bound_host, port = split_tcp_endpoint(bound)
    if host is None:
        if bound_host not in WILDCARD_HOSTS:
            return bound
        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


__all__ = ["WILDCARD_HOSTS", "advertised_endpoint", "split_tcp_endpoint"]
