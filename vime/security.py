"""Who may talk to a vime job: CURVE keys, the ZAP allow-list, and the plaintext rule.

Every ZeroMQ socket vime opens goes through one of two guards:
- `ServerGuard` for a listening socket (the broker's ROUTER, the weight publisher's ROUTER): with keys
  it makes the socket a CURVE server and starts a ZAP handler (pyzmq's `ThreadAuthenticator`) that
  accepts only the public keys in `KEYS_DIR/authorized/`; without keys it refuses to listen anywhere
  but loopback unless `allow_insecure` is set (then it logs a warning).
- `ClientGuard` for a connecting socket (workers' DEALERs, weight fetchers, `vime status`): with keys
  it makes the socket a CURVE client with its role's key pair and the server's public key; without
  keys the same plaintext rule applies to the address it connects to.
Both watch their socket's handshakes (`HandshakeWatch`): every refused handshake is logged, and a
client remembers the last refusal so it can fail fast with the reason ("the server refused this
client's key") instead of timing out in silence.

Key layout, made by `vime keys DIR` (`create_keys`); files are pyzmq certificates
(`zmq.auth.create_certificates`), secrets readable by their owner only:

    DIR/server.key, DIR/server.key_secret        the job's server pair (broker and weight publisher)
    DIR/clients/<name>.key, <name>.key_secret    one client pair per role: rollout, reward, trainer, status
    DIR/authorized/<name>.key                    public keys the servers accept (the allow-list)

Fail-closed details that matter (measured with libzmq 4.3.5): a CURVE socket with no ZAP handler
running admits any key; with ZAP_ENFORCE_DOMAIN but an empty ZAP domain it skips ZAP and admits any
key too. So the handler is started before the socket binds, and the socket sets both a ZAP domain and
`ZAP_ENFORCE_DOMAIN`: if the handler is ever missing, libzmq refuses every client.

Failure modes: `SecurityError` (missing or unreadable keys, plaintext on a network address) at
construction, before any socket binds or connects; `HandshakeRejected` when a peer refused us.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from vime.logging import get_logger

log = get_logger(__name__)

# The ZAP domain of every vime server socket; the allow-list is registered for it.
ZAP_DOMAIN = "vime"
# Client key pairs `vime keys` creates: one per worker role, and one for `vime status`.
CLIENT_ROLES = ("rollout", "reward", "trainer", "status")
SERVER_NAME = "server"
# How processes vime does not start itself (vLLM's worker processes) learn the settings.
ENV_KEYS_DIR = "VIME_CURVE_KEYS_DIR"
ENV_ALLOW_INSECURE = "VIME_ALLOW_INSECURE"
# Handshake failures of one kind are logged at most this often: a misconfigured peer retries about
# ten times a second, and a flood of bad connections must not become a flood of log lines.
LOG_EVERY_S = 10.0
# A client sees a server that refuses its key hang up during the handshake (NO_DETAIL), and the same
# event when the server is killed while a handshake is under way. A refusal repeats on every
# reconnect (~10 a second); a server's death happens once, after which connects are refused without a
# handshake. So a hang-up is taken as a refusal only after this many in a row.
HANGUPS_TO_REFUSE = 3


class SecurityError(RuntimeError):
    """Keys missing or unreadable, or plaintext on an address other machines can reach."""


class HandshakeRejected(SecurityError):
    """The peer refused this socket's handshake (wrong or missing key, CURVE on one side only)."""


@dataclass(frozen=True)
class Security:
    """A process's security settings: where the keys are, and whether plaintext may leave loopback."""

    keys_dir: Path | None = None
    allow_insecure: bool = False

    @property
    def curve(self) -> bool:
        return self.keys_dir is not None

    @classmethod
    def from_config(cls, cfg: Any) -> Security:
        """From a `VimeConfig` (its `curve_keys_dir` and `allow_insecure` fields)."""
        keys = getattr(cfg, "curve_keys_dir", None)
        return cls(Path(keys) if keys else None, bool(getattr(cfg, "allow_insecure", False)))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Security:
        """From `VIME_CURVE_KEYS_DIR` / `VIME_ALLOW_INSECURE` (see `env`)."""
        env = os.environ if environ is None else environ
        keys = env.get(ENV_KEYS_DIR, "").strip()
        insecure = env.get(ENV_ALLOW_INSECURE, "").strip().lower() in ("1", "true", "yes")
        return cls(Path(keys) if keys else None, insecure)

    def env(self) -> dict[str, str]:
        """Environment variables that carry these settings to child processes (`from_env` reads them)."""
        return {
            ENV_KEYS_DIR: str(self.keys_dir.resolve()) if self.keys_dir else "",
            ENV_ALLOW_INSECURE: "1" if self.allow_insecure else "",
        }


# --- keys -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyPaths:
    """Where the files of a key directory live (see the module docstring)."""

    root: Path

    @property
    def server_public(self) -> Path:
        return self.root / f"{SERVER_NAME}.key"

    @property
    def server_secret(self) -> Path:
        return self.root / f"{SERVER_NAME}.key_secret"

    @property
    def clients(self) -> Path:
        return self.root / "clients"

    @property
    def authorized(self) -> Path:
        return self.root / "authorized"

    def client_secret(self, name: str) -> Path:
        return self.clients / f"{name}.key_secret"


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise ValueError(f"client name {name!r} must be letters, digits, '-', '_' or '.'")


def _new_pair(directory: Path, name: str) -> list[Path]:
    public, secret = (Path(p) for p in zmq.auth.create_certificates(directory, name))
    secret.chmod(0o600)
    public.chmod(0o644)
    return [public, secret]


def create_keys(directory: Path, clients: Iterable[str] = CLIENT_ROLES, *, force: bool = False) -> list[Path]:
    """Create the key directory's missing pieces; returns the files written.

    Existing keys are kept (so adding a client to a running job's directory is safe) unless `force`,
    which makes new pairs for the server and the named clients: every process must then be restarted
    with the new files. Each client's public key is copied to `authorized/`. Directories are made
    owner-only (0700), secret files 0600.
    """
    paths = KeyPaths(Path(directory))
    names = list(clients)
    for name in names:
        _check_name(name)
    for d in (paths.root, paths.clients, paths.authorized):
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)  # before any secret is written into it
    written: list[Path] = []
    if force or not paths.server_secret.exists():
        written += _new_pair(paths.root, SERVER_NAME)
    for name in names:
        if force or not paths.client_secret(name).exists():
            written += _new_pair(paths.clients, name)
        allowed = paths.authorized / f"{name}.key"
        if force or not allowed.exists():
            shutil.copyfile(paths.clients / f"{name}.key", allowed)
            written.append(allowed)
    return written


def _load(path: Path, *, secret: bool, hint: Path) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise SecurityError(f"CURVE key file {path} does not exist (create keys with `vime keys {hint}`)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"CURVE key file {path} is unreadable: {exc}") from None
    if secret and not secret_key:
        raise SecurityError(f"CURVE key file {path} holds no secret key")
    return public, secret_key


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    allowed: dict[bytes, str]  # z85 public key -> client name (file stem in authorized/)


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def load_server_keys(keys_dir: Path) -> ServerKeys:
    """The server pair and the allow-list; SecurityError names the missing or bad file."""
    paths = KeyPaths(Path(keys_dir))
    public, secret = _load(paths.server_secret, secret=True, hint=paths.root)
    allowed: dict[bytes, str] = {}
    for path in sorted(paths.authorized.glob("*.key")) if paths.authorized.is_dir() else []:
        key, _ = _load(path, secret=False, hint=paths.root)
        allowed[key] = path.stem
    if not allowed:
        raise SecurityError(f"no client keys in {paths.authorized}/ (the allow-list): run `vime keys {paths.root}`")
    assert secret is not None
    return ServerKeys(public, secret, allowed)


def load_client_keys(keys_dir: Path, name: str) -> ClientKeys:
    """Client `name`'s pair and the server's public key; SecurityError names the missing or bad file."""
    paths = KeyPaths(Path(keys_dir))
    public, secret = _load(paths.client_secret(name), secret=True, hint=paths.root)
    server_public, _ = _load(paths.server_public, secret=False, hint=paths.root)
    assert secret is not None
    return ClientKeys(public, secret, server_public)


# --- the plaintext rule -----------------------------------------------------------------------------


def _interface_is_loopback(name: str) -> bool | None:
    """Whether NIC `name` is a loopback interface; None if there is no such interface."""
    try:
        names = {n for _, n in socket.if_nameindex()}
    except OSError:
        names = set()
    if name not in names:
        return None
    flags = Path(f"/sys/class/net/{name}/flags")
    try:
        return bool(int(flags.read_text().strip(), 16) & 0x8)  # IFF_LOOPBACK
    except (OSError, ValueError):
        return name in ("lo", "lo0")


def is_local_endpoint(endpoint: str) -> bool:
    """Whether only this machine can use `endpoint`: inproc, ipc, or tcp on a loopback address,
    loopback interface name (`tcp://lo:5555`) or a host name that resolves to loopback only.

    Wildcards (`tcp://*:5555`), other interfaces, unresolvable names and other transports are not.
    """
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("inproc", "ipc"):
        return True
    if scheme != "tcp":
        return False
    rest = rest.rpartition(";")[2]  # connect syntax: tcp://SOURCE;HOST:PORT
    host = rest.rpartition(":")[0].strip("[]")
    if not host or host in ("*", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        pass
    nic = _interface_is_loopback(host)
    if nic is not None:
        return nic
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_plaintext(endpoint: str, security: Security, *, what: str) -> None:
    """Allow plaintext on `endpoint`, or raise SecurityError saying how to secure it.

    Loopback is always allowed; any other address only with `allow_insecure`, and then logged.
    """
    if is_local_endpoint(endpoint):
        return
    if security.allow_insecure:
        log.warning("plaintext_zmq_on_network", what=what, endpoint=endpoint,
                    risk="anyone who can reach this address can send work, results or read weights")  # fmt: skip
        return
    raise SecurityError(
        f"{what} {endpoint}, which is not a loopback address, and no CURVE keys are configured: anyone "
        "who can reach it could submit work or read the weights. Create keys with `vime keys DIR` and "
        "pass --curve-keys-dir DIR to every process, or pass --allow-insecure on a network you trust"
    )


def check_job(cfg: Any) -> Security:
    """Check a job's security before starting its processes (`vime run`): with keys, every file each
    process will load exists and parses; without, every endpoint is loopback (or allow_insecure).
    Returns the settings; raises SecurityError naming the file or endpoint."""
    security = Security.from_config(cfg)
    if security.curve:
        assert security.keys_dir is not None
        load_server_keys(security.keys_dir)
        for role in ("rollout", "reward", "trainer"):
            load_client_keys(security.keys_dir, role)
        return security
    for what, endpoint in (
        ("the broker listens on", cfg.broker_bind or cfg.broker_address),
        ("workers connect to the broker at", cfg.broker_address),
        ("the weight publisher listens on", cfg.weight_bind),
    ):
        check_plaintext(endpoint, security, what=what)
    return security


# --- handshake monitoring ---------------------------------------------------------------------------

_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_MONITOR_STOPPED
)
_PROTOCOL_ERRORS = {
    getattr(zmq, n): n.removeprefix("PROTOCOL_ERROR_") for n in dir(zmq) if n.startswith("PROTOCOL_ERROR_")
}


def describe_handshake_failure(event: int, value: int, *, side: str) -> str:
    """Words for a failed-handshake monitor event, from the point of view of `side` (server/client)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if side == "client":
            return f"the server's ZAP handler refused this client's CURVE key (status {value})"
        return f"ZAP refused the client's key (status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "security mechanism mismatch: one side uses CURVE, the other plaintext"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            # libzmq reports a client holding a wrong server key (its HELLO does not open) and one whose
            # secret key is not its public key's (its INITIATE vouch does not open) the same way, before
            # ZAP sees the key: which of the two it was is not known.
            return (
                "CURVE cryptographic error: the client has a wrong server public key, or its secret key does "
                "not match the public key it presents (libzmq refuses both before ZAP sees the key and does not "
                "say which)"
            )
        return f"ZMTP protocol error {_PROTOCOL_ERRORS.get(value, hex(value))}"
    if side == "client":
        # The same for both of the cases above (measured, libzmq 4.3.5): the server just hangs up.
        return (
            "the server closed the connection during the handshake (wrong server public key, or this "
            "client's secret key does not match its public key?)"
        )
    if value == errno.EFAULT:  # what libzmq reports when ZAP_ENFORCE_DOMAIN finds no ZAP handler
        return "no ZAP handler is running to check the client's key, so it was refused (fail closed)"
    return f"handshake failed (errno {value}: {os.strerror(value) if value > 0 else '?'})"


class HandshakeWatch:
    """Watches one socket's handshakes through a ZeroMQ monitor socket, in a daemon thread.

    Failed handshakes are logged (the first of each kind at once, then at most one line per
    `LOG_EVERY_S` with a count); servers also log disconnects, which is how a message over MAXMSGSIZE
    shows up (libzmq drops the connection before reading it). `rejection` holds the last failure
    until a handshake succeeds; on a client, a server hanging up mid-handshake counts only once it
    happens `HANGUPS_TO_REFUSE` times in a row (one hang-up may be a server that was killed). The
    thread ends when the socket closes (EVENT_MONITOR_STOPPED) or its context is terminated; it never
    raises.
    """

    def __init__(self, sock: zmq.Socket, *, name: str, side: str) -> None:  # type: ignore[type-arg]
        self.name = name
        self.side = side
        self.rejection: str | None = None
        self.failures = 0
        self.hangups = 0  # client side: handshakes the server hung up on since the last success
        # Connections this socket lost (peer closed, died, or stopped answering); on a client, only
        # connections whose handshake had succeeded.
        self.disconnects = 0
        self._established = False
        self._last_logged: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        address = f"inproc://vime-handshake-watch-{id(self)}"
        sock.monitor(address, _EVENTS)
        # A plain (non-asyncio) view of the socket's context: the monitor is read from a thread.
        self._pair = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self._pair.setsockopt(zmq.LINGER, 0)
        self._pair.connect(address)
        self._thread = threading.Thread(target=self._run, name=f"vime-watch-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                try:
                    event = parse_monitor_message(self._pair.recv_multipart())
                except zmq.ContextTerminated:
                    return
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                self._on_event(int(event["event"]), int(event["value"]), _text(event.get("endpoint")))
        except Exception:  # a bug here must never take the process down
            log.exception("handshake_watch_failed", socket=self.name)
        finally:
            self._flush()
            self._pair.close(linger=0)

    def _on_event(self, event: int, value: int, endpoint: str) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.rejection = None
            self.hangups = 0
            self._established = True
            return
        if event == zmq.EVENT_DISCONNECTED:
            if self.side == "client":
                if not self._established:
                    return  # a handshake that failed, counted above: no connection was lost
                self._established = False
            self.disconnects += 1
            if self.side == "server":
                self._log("zmq_peer_disconnected", "info", endpoint=endpoint)
            return
        self.failures += 1
        reason = describe_handshake_failure(event, value, side=self.side)
        self._log("zmq_handshake_failed", "warning", endpoint=endpoint, reason=reason)
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and self.side == "client":
            self.hangups += 1
            if self.hangups < HANGUPS_TO_REFUSE:
                return
        self.rejection = reason

    def _log(self, kind: str, level: str, **fields: Any) -> None:
        key = f"{kind}:{fields.get('reason', '')}"
        now = time.monotonic()
        if now - self._last_logged.get(key, float("-inf")) < LOG_EVERY_S:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last_logged[key] = now
        suppressed = self._suppressed.pop(key, 0)
        getattr(log, level)(
            kind, socket=self.name, side=self.side, **fields, **({"more_since_last": suppressed} if suppressed else {})
        )

    def _flush(self) -> None:
        for key, count in self._suppressed.items():
            log.info("zmq_events_not_logged", socket=self.name, kind=key.rstrip(":"), count=count)
        self._suppressed.clear()


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value or "")


def peer_of(frame: Any) -> str:
    """Who sent a received frame, for log lines: its IP address, plus its client name under CURVE
    (the key's name in `authorized/`, which the ZAP handler reports as the ZMQ User-Id)."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        address = "?"
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        user = None
    return f"{address} ({user})" if user else str(address)


ROLES = ("rollout", "reward", "trainer", "status")


def key_role(key_name: str) -> str | None:
    """The role a client key is bound to by its name: "rollout" and "rollout-node7" are rollout keys.
    A name that starts with no role (e.g. "node7") binds none (any role; the broker warns)."""
    for role in ROLES:
        if key_name == role or key_name.startswith(role + "-"):
            return role
    return None


def sender_key_name(frame: Any) -> str | None:
    """The CURVE client key name of a received frame (its ZMQ User-Id), None under plaintext."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return _text(user) or None


# --- ZAP --------------------------------------------------------------------------------------------


class _AllowList:
    """pyzmq credentials provider: a client key is accepted iff it is in the allow-list; refusals logged."""

    def __init__(self, allowed: dict[bytes, str], name: str, auth: _Authenticator) -> None:
        self.allowed = allowed
        self.name = name
        self.auth = auth

    def callback(self, domain: str, key: bytes) -> bool:
        who = self.allowed.get(key)
        if who is None:
            log.warning(
                "zap_denied", socket=self.name, domain=domain, client_key=key.decode(), address=self.auth.address
            )
            return False
        log.debug("zap_allowed", socket=self.name, client=who, address=self.auth.address)
        return True


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, remembering the address of the request being handled (for the logs) and
    reporting each accepted client's key name as its ZMQ User-Id."""

    def __init__(self, context: zmq.Context, names: dict[bytes, str]) -> None:  # type: ignore[type-arg]
        super().__init__(context)
        self.names = names  # z85 public key -> client name
        self.address = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self.address = msg[3].decode(errors="replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)

    def curve_user_id(self, client_public_key: bytes) -> str:
        from zmq.utils import z85

        return self.names.get(z85.encode(client_public_key), super().curve_user_id(client_public_key))


@dataclass
class ServerGuard:
    """Security of one listening socket. Create it before the socket, call `secure(sock)` before
    `bind`, and `close()` before terminating the context (the ZAP thread holds a socket in it).

    Raises SecurityError at construction: keys missing/unreadable, or plaintext on a network address.
    """

    context: zmq.Context  # type: ignore[type-arg]
    security: Security | None
    name: str
    endpoint: str
    keys: ServerKeys | None = field(init=False, default=None)
    watch: HandshakeWatch | None = field(init=False, default=None)
    _auth: _Authenticator | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        security = self.security or Security()
        if not security.curve:
            check_plaintext(self.endpoint, security, what=f"the {self.name} listens on")
            return
        assert security.keys_dir is not None
        self.keys = load_server_keys(security.keys_dir)
        auth = _Authenticator(self.context, dict(self.keys.allowed))
        auth.start()  # before bind: no handshake may happen without the allow-list in place
        auth.configure_curve_callback(ZAP_DOMAIN, _AllowList(self.keys.allowed, self.name, auth))
        self._auth = auth
        log.info("curve_server", socket=self.name, endpoint=self.endpoint, allowed=sorted(self.keys.allowed.values()))

    def secure(self, sock: zmq.Socket) -> None:  # type: ignore[type-arg]
        """Set the socket's security options and start watching its handshakes (before `bind`)."""
        if self.keys is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler -> nobody gets in
        self.watch = HandshakeWatch(sock, name=self.name, side="server")

    def close(self) -> None:
        """Stop the ZAP thread. Idempotent."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


@dataclass
class ClientGuard:
    """Security of one connecting socket, as client `role` (its key pair is `clients/<role>`).

    Raises SecurityError at construction: keys missing/unreadable, or plaintext to a network address.
    """

    security: Security | None
    role: str
    name: str
    endpoint: str
    keys: ClientKeys | None = field(init=False, default=None)
    watch: HandshakeWatch | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        security = self.security or Security()
        if not security.curve:
            check_plaintext(self.endpoint, security, what=f"the {self.name} connects to")
            return
        assert security.keys_dir is not None
        self.keys = load_client_keys(security.keys_dir, self.role)

    def secure(self, sock: zmq.Socket) -> None:  # type: ignore[type-arg]
        """Set the socket's security options and start watching its handshakes (before `connect`)."""
        if self.keys is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.keys.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)
        self.watch = HandshakeWatch(sock, name=self.name, side="client")

    @property
    def rejection(self) -> str | None:
        """Why the last handshake failed, if it did and none succeeded since."""
        return self.watch.rejection if self.watch is not None else None

    @property
    def disconnects(self) -> int:
        """How many times this socket's connection to the server was lost."""
        return self.watch.disconnects if self.watch is not None else 0

    def raise_if_rejected(self) -> None:
        """Raise HandshakeRejected if the server refused this socket's handshake."""
        reason = self.rejection
        if reason is not None:
            raise HandshakeRejected(f"{self.endpoint} refused the {self.name}'s connection: {reason}{self._hint()}")

    def _hint(self) -> str:
        if self.keys is None:
            return " (this process has no CURVE keys: pass --curve-keys-dir, as the server has)"
        return " (are both sides using keys from the same `vime keys` directory?)"


__all__ = [
    "CLIENT_ROLES",
    "ClientGuard",
    "ClientKeys",
    "HandshakeRejected",
    "HandshakeWatch",
    "KeyPaths",
    "Security",
    "SecurityError",
    "ServerGuard",
    "ServerKeys",
    "check_job",
    "check_plaintext",
    "create_keys",
    "describe_handshake_failure",
    "is_local_endpoint",
    "load_client_keys",
    "load_server_keys",
    "peer_of",
]
