"""The trainer's side of the weight channel: snapshot a state dict, serve it in chunks over ZeroMQ.

`WeightPublisher.publish(version, tensors)` copies the tensors (any dtype, CPU or CUDA) into one
contiguous host buffer, records a manifest (name, dtype, shape, byte range per tensor) and an XXH3-64
checksum per chunk (`chunk_checksum`), and makes it the latest version. A background thread with its
own ZeroMQ context answers fetchers on a ROUTER socket; every chunk is sent as a zero-copy view of the
snapshot, so serving N fetchers costs no extra memory.

Versions and memory: the publisher keeps the newest `keep` snapshots (default 2). A fetch that started
on version v finishes on v even if v+1 is published meanwhile; only when v falls out of the window
(v+2 published with keep=2) are its chunk requests answered with `superseded`, and the fetcher restarts
on the latest version. So a fetch that takes less than one publish interval always completes, and the
host holds at most `keep` snapshots: the oldest is dropped *before* a new one is built, and its buffer
is reused for the new one when the size matches and ZeroMQ has finished sending every chunk queued
from it (chunk sends are tracked); otherwise it is freed once those sends complete and a fresh buffer
is allocated. Reuse matters: writing into fresh memory page-faults, and publish blocks the trainer.

GPU copy (`cuda_ipc=True`, CUDA tensors): each snapshot is also copied into one GPU buffer that fetchers
on the same GPU map over CUDA IPC (`WeightIpcFetch`; docs/colocate.md) instead of pulling chunks. The
buffer is reused for a later version only once every reader has reported done (or was given up as
stalled); otherwise a new one is allocated and torch keeps the old one alive while it is mapped.

Failure modes: `publish` raises ValueError for a non-increasing version, a duplicate or empty name or an
unsupported dtype, before anything changes. The server thread never dies on input: malformed or
unexpected requests get a `WeightError` reply and a log line; a bug while handling a request is logged
with its traceback and answered `internal`. Replies to peers that vanished or stopped reading are
dropped (ROUTER_MANDATORY turns those into errors we can log instead of silent drops).

Stuck fetchers never block the trainer: `publish` waits for no fetcher, replies are sent without
blocking, and a fetch is tracked (peer, version, chunks served) only to report it: one that sends no
request for `stall_timeout_s` is given up, logged as "weight fetch stalled" naming the version and the
peer, and counted in `stalled_fetches`. ZMTP heartbeats close connections to peers that stop
answering altogether (a frozen process), which frees the chunk frames queued for them.

Security: the ROUTER is secured by a `vime.security.ServerGuard`: CURVE with the job's server key and
the ZAP allow-list when `security` has keys, else plaintext on loopback only (SecurityError at
construction otherwise). MAXMSGSIZE (`MAX_REQUEST_BYTES`) makes libzmq drop any larger message, and the
connection that sent it, before buffering it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from vime.logging import get_logger
from vime.protocol.codec import Message, ProtocolError, decode, encode
from vime.security import Security, ServerGuard, peer_of
from vime.weights import cuda_ipc
from vime.protocol.weights import (
    CHECKSUM_ALGORITHM,
    CudaIpcHandle,
    DEFAULT_CHUNK_BYTES,
    MAX_ADAPTER_CONFIG_BYTES,
    ERROR_BAD_REQUEST,
    ERROR_INTERNAL,
    ERROR_NOT_LOCAL,
    ERROR_NOT_READY,
    ERROR_SUPERSEDED,
    ERROR_UNKNOWN_VERSION,
    MAX_CHUNK_BYTES,
    MAX_REQUEST_BYTES,
    MIN_CHUNK_BYTES,
    PUBLISHER_ACCEPTS,
    TENSOR_ALIGN,
    WEIGHT_DTYPES,
    TensorSpec,
    WeightChunk,
    WeightChunkRequest,
    WeightError,
    WeightFetch,
    WeightFetchAck,
    WeightFetchDone,
    WeightIpcFetch,
    WeightIpcManifest,
    WeightManifest,
    chunk_checksum,
    chunk_count,
    chunk_span,
)

log = get_logger(__name__)

# Replies queued per fetcher before the ROUTER refuses more. Fetchers keep only a few requests in
# flight, so this is only reached by a peer that sends requests without reading replies.
_SNDHWM = 1024
_RCVHWM = 1024
# How many requests one loop iteration drains before checking the control socket again.
_BURST = 64
# A held snapshot's list of chunk-send trackers is pruned of finished ones past this length.
_PRUNE_TRACKERS = 256
# Fetches tracked at once (for stall reports); beyond it the oldest record is forgotten, so a peer
# that floods manifest requests cannot grow the publisher's memory.
_MAX_TRACKED_FETCHES = 4096
# How often the server thread wakes without requests, to give up on stalled fetches.
_HOUSEKEEPING_S = 1.0
# ZMTP heartbeats: a peer that answers no PING for this long is disconnected by libzmq.
_HEARTBEAT_IVL_MS = 5_000
_HEARTBEAT_TIMEOUT_MS = 30_000


@dataclass
class _Fetch:
    """One fetch in progress, as the publisher sees it (server thread only)."""

    version: int
    peer: str
    started: float
    last_seen: float
    chunks: int = 0


@dataclass(frozen=True)
class PublishStats:
    """What one `publish` did: bytes snapshotted (incl. alignment padding) and time taken.

    `checksum_seconds` is the part spent computing the per-chunk `CHECKSUM_ALGORITHM` checksums.
    """

    version: int
    nbytes: int
    num_tensors: int
    num_chunks: int
    seconds: float
    copy_seconds: float
    checksum_seconds: float


@dataclass
class _Snapshot:
    """One published version. `buffer` is not written while the snapshot is held or being sent."""

    version: int
    buffer: np.ndarray  # uint8, total_bytes long
    chunk_bytes: int
    tensors: list[TensorSpec]
    chunk_checksums: list[int]
    # The same bytes in GPU memory, shared over CUDA IPC with fetchers on that GPU (cuda_ipc=True and
    # CUDA tensors only). Not rewritten while `ipc_readers` (peer, fetch_id) have not reported done.
    gpu: torch.Tensor | None = None
    gpu_handle: CudaIpcHandle | None = None
    ipc_readers: set[tuple[bytes, int]] = field(default_factory=set)
    # Trackers of zero-copy chunk sends from `buffer` (appended by the server thread under the
    # publisher's lock). The buffer may be rewritten only when all are done.
    trackers: list[zmq.MessageTracker] = field(default_factory=list)
    adapter_config: str | None = None  # a LoRA adapter version's adapter_config.json

    def sending(self) -> bool:
        """Whether libzmq still holds chunk frames that point into `buffer`."""
        self.trackers = [t for t in self.trackers if not t.done]
        return bool(self.trackers)

    def manifest(self, fetch_id: int) -> WeightManifest:
        return WeightManifest(
            fetch_id=fetch_id,
            version=self.version,
            total_bytes=int(self.buffer.size),
            chunk_bytes=self.chunk_bytes,
            tensors=self.tensors,
            checksum=CHECKSUM_ALGORITHM,
            chunk_checksums=self.chunk_checksums,
            adapter_config=self.adapter_config,
        )

    def ipc_manifest(self, fetch_id: int) -> WeightIpcManifest:
        assert self.gpu_handle is not None
        return WeightIpcManifest(
            fetch_id=fetch_id, version=self.version, total_bytes=int(self.buffer.size), tensors=self.tensors,
            buffer=self.gpu_handle, adapter_config=self.adapter_config,
        )  # fmt: skip

    def chunk(self, index: int) -> np.ndarray:
        start, end = chunk_span(index, int(self.buffer.size), self.chunk_bytes)
        return self.buffer[start:end]


def _adapter_config_text(config: dict[str, Any]) -> str:
    try:
        text = msgspec.json.encode(config).decode()
    except (TypeError, msgspec.EncodeError) as exc:
        raise ValueError(f"adapter_config is not JSON: {exc}") from None
    if len(text) > MAX_ADAPTER_CONFIG_BYTES:
        raise ValueError(f"adapter_config of {len(text)} chars, at most {MAX_ADAPTER_CONFIG_BYTES}")
    return text


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _not_ready(latest: int | None, min_version: int, fetch_id: int) -> WeightError:
    return WeightError(code=ERROR_NOT_READY, detail=f"latest version is {latest}, asked for >= {min_version}",
                       fetch_id=fetch_id, latest_version=latest)  # fmt: skip


def _align(offset: int) -> int:
    return -(-offset // TENSOR_ALIGN) * TENSOR_ALIGN


class WeightPublisher:
    """Serves versioned weight snapshots to any number of `WeightFetcher`s.

    Create it in the trainer's rank-0 process (after any fork). `publish` is called from the training
    loop; the serving thread runs until `close()`. Also a context manager.
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:*",
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        keep: int = 2,
        security: Security | None = None,
        stall_timeout_s: float = 60.0,
        cuda_ipc: bool = False,
    ) -> None:
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self._stall_timeout_s = float(stall_timeout_s)
        self._cuda_ipc = bool(cuda_ipc)
        self._fetches: dict[tuple[bytes, int], _Fetch] = {}  # (peer identity, fetch_id); server thread only
        self.stalled_fetches = 0  # fetches given up for silence (read from any thread)
        self._chunk_bytes = chunk_bytes
        self._keep = keep
        self._snapshots: dict[int, _Snapshot] = {}  # guarded by _lock; the server thread reads it
        self._latest: int | None = None
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()  # one publish at a time
        self._completed: dict[int, int] = {}  # version -> fetches reported done (server thread only)
        # Test hook: called with (version, index, chunk) before a chunk is sent; returns the array to
        # send. Lets tests corrupt chunks in flight. None in production.
        self._chunk_filter: Callable[[int, int, np.ndarray], np.ndarray] | None = None

        # Own context: the trainer process may have others (or fork-unsafe ones); ours ends with us.
        self._ctx = zmq.Context()
        try:  # SecurityError (missing keys, plaintext on a network address) before anything binds
            self._guard = ServerGuard(self._ctx, security, name="weight publisher", endpoint=bind)
        except BaseException:
            self._ctx.term()
            raise
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)  # close() must not wait for slow fetchers
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable replies raise instead of vanishing
        self._router.setsockopt(zmq.SNDHWM, _SNDHWM)
        self._router.setsockopt(zmq.RCVHWM, _RCVHWM)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # requests are tiny; drop floods
        self._router.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        self._guard.secure(self._router)
        try:
            self._router.bind(bind)
        except zmq.ZMQError:
            self._router.close()
            self._guard.close()
            self._ctx.term()
            raise
        self._endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        # close() wakes the server thread at once through this pair (it otherwise wakes every second).
        wake_addr = f"inproc://vime-weights-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake_addr)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="vime-weight-publisher", daemon=True)
        self._thread.start()
        log.info("weight publisher listening", endpoint=self._endpoint, chunk_bytes=chunk_bytes, keep=keep)

    @property
    def endpoint(self) -> str:
        """The bound endpoint with the real port, e.g. "tcp://127.0.0.1:41234"."""
        return self._endpoint

    @property
    def cuda_ipc(self) -> bool:
        """Whether publishes of CUDA tensors also keep a GPU copy for fetchers on that GPU."""
        return self._cuda_ipc

    @property
    def latest_version(self) -> int | None:
        """The newest published version, or None before the first publish."""
        return self._latest

    def completed_fetches(self, version: int) -> int:
        """How many fetchers reported (WeightFetchDone) that they hold `version`."""
        return self._completed.get(version, 0)

    def publish(
        self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], *, adapter_config: dict[str, Any] | None = None,
    ) -> PublishStats:  # fmt: skip
        """Snapshot `tensors` as `version` and make it the one fetchers get.

        Copies every tensor (CPU or CUDA, any dtype in WEIGHT_DTYPES) into one host buffer, so the
        caller may modify or free its tensors as soon as this returns. `adapter_config` (peft's
        adapter_config.json as a dict) marks the version as a LoRA adapter: `tensors` are the adapter's
        and fetchers load them on top of the base they hold. Raises ValueError, changing nothing, if
        `version` is not greater than the latest or a tensor or the adapter config is unusable.
        """
        start = time.perf_counter()
        with self._publish_lock:
            if self._closed:
                raise RuntimeError("publish on a closed WeightPublisher")
            if not isinstance(version, int) or version < 0:
                raise ValueError(f"version must be a non-negative int, got {version!r}")
            if self._latest is not None and version <= self._latest:
                raise ValueError(f"versions must increase: latest is {self._latest}, got {version}")
            items = list(tensors)  # references only; we need sizes before allocating
            specs = self._layout(items)
            config_text = None if adapter_config is None else _adapter_config_text(adapter_config)
            total = _align(max((s.offset + s.nbytes for s in specs), default=0))

            # Make room first, so the host never holds more than `keep` snapshots at once. Once a
            # snapshot is out of the dict the server thread starts no new sends from it.
            with self._lock:
                dropped = []
                while len(self._snapshots) >= self._keep:
                    dropped.append(self._snapshots.pop(min(self._snapshots)))
            buffer = self._reusable_buffer(dropped, total)
            gpu_buffer = self._gpu_buffer(items, dropped, total)
            del dropped

            copy_start = time.perf_counter()
            host = torch.from_numpy(buffer)
            cursor = 0
            for (_, tensor), spec in zip(items, specs):
                host[cursor : spec.offset].zero_()  # padding: deterministic bytes, no stale data
                if spec.nbytes:
                    src = tensor.detach().reshape(-1).view(torch.uint8)  # reshape copies only if strided
                    host[spec.offset : spec.offset + spec.nbytes].copy_(src)
                    if gpu_buffer is not None:
                        gpu_buffer[spec.offset : spec.offset + spec.nbytes].copy_(src)
                cursor = max(cursor, spec.offset + spec.nbytes)
            host[cursor:].zero_()
            gpu_handle = cuda_ipc.share(gpu_buffer) if gpu_buffer is not None else None
            copy_seconds = time.perf_counter() - copy_start

            checksum_start = time.perf_counter()
            n_chunks = chunk_count(total, self._chunk_bytes)
            checksums = [
                chunk_checksum(buffer[slice(*chunk_span(i, total, self._chunk_bytes))]) for i in range(n_chunks)
            ]
            checksum_seconds = time.perf_counter() - checksum_start

            snapshot = _Snapshot(
                version, buffer, self._chunk_bytes, specs, checksums, gpu_buffer, gpu_handle, adapter_config=config_text,
            )  # fmt: skip
            with self._lock:
                self._snapshots[version] = snapshot
                self._latest = version
        stats = PublishStats(
            version=version,
            nbytes=total,
            num_tensors=len(specs),
            num_chunks=n_chunks,
            seconds=time.perf_counter() - start,
            copy_seconds=copy_seconds,
            checksum_seconds=checksum_seconds,
        )
        log.info(
            "weights published",
            version=version,
            nbytes=total,
            tensors=len(specs),
            chunks=n_chunks,
            seconds=round(stats.seconds, 4),
        )
        return stats

    @staticmethod
    def _reusable_buffer(dropped: list[_Snapshot], total: int) -> np.ndarray:
        """A dropped snapshot's buffer if it has the right size and nothing is sending from it, else a new one."""
        for old in dropped:
            if old.buffer.size == total and not old.sending():
                log.debug("weight snapshot buffer reused", dropped_version=old.version, nbytes=total)
                return old.buffer
        # Dropped buffers still being sent stay alive (pyzmq holds them) until their sends finish.
        return np.empty(total, dtype=np.uint8)

    def _gpu_buffer(self, items: list[tuple[str, torch.Tensor]], dropped: list[_Snapshot], total: int) -> torch.Tensor | None:
        """Where the GPU copy of a new snapshot goes: None unless cuda_ipc is on and every tensor lives on
        one CUDA device; a dropped snapshot's copy if its size matches and no reader still maps it."""
        if not self._cuda_ipc or not items or total == 0:
            return None
        devices = {t.device for _, t in items}
        device = next(iter(devices))
        if len(devices) != 1 or device.type != "cuda":
            return None
        with self._lock:  # the server thread edits ipc_readers under this lock
            for old in dropped:
                if old.gpu is not None and old.gpu.numel() == total and old.gpu.device == device and not old.ipc_readers:
                    return old.gpu
        # A copy still mapped by a reader stays allocated (torch's IPC refcount) until it lets go.
        return torch.empty(total, dtype=torch.uint8, device=device)

    @staticmethod
    def _layout(items: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
        """Check names and dtypes and assign each tensor an aligned byte range."""
        specs: list[TensorSpec] = []
        seen: set[str] = set()
        offset = 0
        for entry in items:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise ValueError(f"expected (name, tensor) pairs, got {type(entry).__name__}")
            name, tensor = entry
            if not isinstance(name, str) or not name:
                raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice")
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            dtype = _dtype_name(tensor)
            if dtype not in WEIGHT_DTYPES:
                raise ValueError(f"{name!r} has dtype {dtype}, supported: {sorted(WEIGHT_DTYPES)}")
            seen.add(name)
            nbytes = tensor.numel() * tensor.element_size()
            specs.append(TensorSpec(name=name, dtype=dtype, shape=list(tensor.shape), offset=offset, nbytes=nbytes))
            offset = _align(offset + nbytes)
        return specs

    def close(self) -> None:
        """Stop serving and free the sockets and snapshots. Idempotent; fetches in flight will time out."""
        with self._publish_lock:
            if self._closed:
                return
            self._closed = True
        self._wake_tx.send(b"stop")
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():  # should not happen: the loop checks the wake socket every burst
            log.error("weight publisher thread did not stop; leaking its sockets")
            return
        self._wake_tx.close()
        self._guard.close()  # the ZAP thread's socket would keep term() waiting
        self._ctx.term()
        with self._lock:
            self._snapshots.clear()
        log.info("weight publisher closed", endpoint=self._endpoint)

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- server thread -------------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        last_housekeeping = time.monotonic()
        try:
            while True:
                events = dict(poller.poll(int(_HOUSEKEEPING_S * 1000)))
                if self._wake_rx in events:
                    return
                for _ in range(_BURST):
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
                now = time.monotonic()
                if now - last_housekeeping >= _HOUSEKEEPING_S:
                    last_housekeeping = now
                    self._give_up_stalled(now)
        finally:
            self._router.close()
            self._wake_rx.close()

    def _handle(self, frames: list[Any]) -> None:
        identity = frames[0].bytes
        body = frames[1:]
        fetch_id = 0
        try:
            request = decode(
                body,
                expect=PUBLISHER_ACCEPTS,
                max_header_bytes=MAX_REQUEST_BYTES,
                max_frames=2,
                max_total_bytes=MAX_REQUEST_BYTES,
            )
            fetch_id = request.fetch_id  # type: ignore[attr-defined]
            if isinstance(request, WeightChunkRequest):
                # Look up, send and track under the lock, so `publish` never rewrites a buffer that a
                # send is about to point into.
                with self._lock:
                    reply, snapshot = self._answer_chunk(request)
                    if snapshot is not None:
                        tracker = self._send(identity, reply, track=True)
                        if tracker is not None:
                            snapshot.trackers.append(tracker)
                            if len(snapshot.trackers) > _PRUNE_TRACKERS:  # bound the list on busy versions
                                snapshot.sending()
                if snapshot is not None:
                    self._track_chunk(identity, frames[-1], request)
                    return
                self._log_refusal(frames[-1], reply)  # before the reply, as for malformed requests
            else:
                if isinstance(request, WeightFetchDone):
                    self._fetches.pop((identity, fetch_id), None)
                    self._release_ipc_reader((identity, fetch_id))
                if isinstance(request, WeightIpcFetch):
                    reply = self._answer_ipc(identity, request)
                else:
                    reply = self._answer(request)
                if isinstance(reply, (WeightManifest, WeightIpcManifest)):
                    self._start_tracking((identity, fetch_id), reply.version, peer_of(frames[-1]), time.monotonic())
        except ProtocolError as exc:
            log.warning("bad weight request", peer=peer_of(frames[-1]), identity=identity.hex(), code=exc.code,
                        detail=exc.detail[:200])  # fmt: skip
            reply = WeightError(code=exc.code, detail=exc.detail[:1000], latest_version=self._latest)
        except Exception as exc:  # a bug here must not take the channel down with it
            log.exception("weight request failed", peer=identity.hex())
            reply = WeightError(
                code=ERROR_INTERNAL, detail=f"{type(exc).__name__}: {exc}"[:1000], fetch_id=fetch_id
            )
        self._send(identity, reply)

    def _track_chunk(self, identity: bytes, frame: Any, request: WeightChunkRequest) -> None:
        """Note a served chunk (server thread). Only for stall reports: nothing waits on it."""
        now = time.monotonic()
        key = (identity, request.fetch_id)
        fetch = self._fetches.get(key)
        if fetch is None:  # e.g. forgotten as stalled, and the fetcher came back to life
            fetch = self._start_tracking(key, request.version, peer_of(frame), now)
        fetch.last_seen = now
        fetch.chunks += 1

    @staticmethod
    def _log_refusal(frame: Any, reply: Message) -> None:
        """Log a well-formed request refused as impossible; superseded versions are routine (debug)."""
        if not isinstance(reply, WeightError):
            return
        level = log.debug if reply.code == ERROR_SUPERSEDED else log.warning
        level("weight request refused", peer=peer_of(frame), code=reply.code, detail=reply.detail[:200])

    def _start_tracking(self, key: tuple[bytes, int], version: int, peer: str, now: float) -> _Fetch:
        # A fetcher runs one fetch at a time: a new one (e.g. a restart on a newer version) ends its others.
        for old in [k for k in self._fetches if k[0] == key[0] and k != key]:
            del self._fetches[old]
        while len(self._fetches) >= _MAX_TRACKED_FETCHES:
            self._fetches.pop(next(iter(self._fetches)))  # the oldest record
        fetch = self._fetches[key] = _Fetch(version=version, peer=peer, started=now, last_seen=now)
        return fetch

    def _give_up_stalled(self, now: float) -> None:
        """Forget fetches that sent nothing for `stall_timeout_s`, with an error line naming each."""
        stalled = [(k, f) for k, f in self._fetches.items() if now - f.last_seen > self._stall_timeout_s]
        for key, fetch in stalled:
            del self._fetches[key]
            self._release_ipc_reader(key)
            self.stalled_fetches += 1
            log.error(
                "weight fetch stalled",
                version=fetch.version,
                peer=fetch.peer,
                fetch_id=key[1],
                chunks_served=fetch.chunks,
                idle_s=round(now - fetch.last_seen, 1),
                detail=f"the fetcher at {fetch.peer} sent no request for version {fetch.version} for "
                f"{self._stall_timeout_s:g} s; giving up on it (the trainer is not affected)",
            )

    def _answer_chunk(self, request: WeightChunkRequest) -> tuple[Message, _Snapshot | None]:
        """The reply to a chunk request, and the snapshot its data points into (None for errors).

        Called with `_lock` held.
        """
        latest = self._latest
        snapshot = self._snapshots.get(request.version)
        if snapshot is None:
            superseded = latest is not None and request.version < latest
            error = WeightError(
                code=ERROR_SUPERSEDED if superseded else ERROR_UNKNOWN_VERSION,
                detail=f"version {request.version} is not held here (latest {latest})",
                fetch_id=request.fetch_id,
                latest_version=latest,
            )
            return error, None
        n_chunks = len(snapshot.chunk_checksums)
        if request.index >= n_chunks:
            error = WeightError(
                code=ERROR_BAD_REQUEST,
                detail=f"chunk {request.index} of version {request.version}, which has {n_chunks}",
                fetch_id=request.fetch_id,
                latest_version=latest,
            )
            return error, None
        data = snapshot.chunk(request.index)
        if self._chunk_filter is not None:
            data = self._chunk_filter(request.version, request.index, data)
        chunk = WeightChunk(fetch_id=request.fetch_id, version=request.version, index=request.index, data=data)
        return chunk, snapshot

    def _answer_ipc(self, identity: bytes, request: WeightIpcFetch) -> Message:
        """Share the latest version's GPU copy with a fetcher on that GPU; else "not_local" (it then
        fetches chunks) or "not_ready". The fetcher is a reader until it reports done (or stalls)."""
        with self._lock:
            latest = self._latest
            snapshot = self._snapshots.get(latest) if latest is not None else None
            if latest is None or snapshot is None or latest < request.min_version:
                return _not_ready(latest, request.min_version, request.fetch_id)
            if snapshot.gpu_handle is None or snapshot.gpu_handle.gpu_uuid != request.gpu_uuid:
                held = "no GPU copy" if snapshot.gpu_handle is None else f"a copy on GPU {snapshot.gpu_handle.gpu_uuid}"
                return WeightError(code=ERROR_NOT_LOCAL, detail=f"version {latest}: this publisher holds {held}",
                                   fetch_id=request.fetch_id, latest_version=latest)  # fmt: skip
            snapshot.ipc_readers.add((identity, request.fetch_id))
            return snapshot.ipc_manifest(request.fetch_id)

    def _release_ipc_reader(self, key: tuple[bytes, int]) -> None:
        with self._lock:
            for snapshot in self._snapshots.values():
                snapshot.ipc_readers.discard(key)

    def _answer(self, request: Message) -> Message:
        """The reply to a manifest request or a done report."""
        with self._lock:
            latest = self._latest
            snapshot = self._snapshots.get(latest) if latest is not None else None
        if isinstance(request, WeightFetch):
            # snapshot is None only while a keep=1 publisher is building its next version.
            if latest is None or snapshot is None or latest < request.min_version:
                return _not_ready(latest, request.min_version, request.fetch_id)
            return snapshot.manifest(request.fetch_id)
        if isinstance(request, WeightFetchDone):
            self._completed[request.version] = self._completed.get(request.version, 0) + 1
            log.info(
                "weight fetch done",
                version=request.version,
                nbytes=request.nbytes,
                seconds=round(request.seconds, 4),
                fetch_id=request.fetch_id,
            )
            return WeightFetchAck(fetch_id=request.fetch_id, version=request.version)
        # decode() only returns PUBLISHER_ACCEPTS types; keep a reply for safety if that list grows.
        return WeightError(code=ERROR_BAD_REQUEST, detail=f"unexpected {type(request).__name__}")

    def _send(self, identity: bytes, reply: Message, *, track: bool = False) -> zmq.MessageTracker | None:
        """Send without blocking; returns the tracker of the last frame (the chunk data) if `track`."""
        try:
            # Chunk data frames are views of the snapshot: zero-copy, and pyzmq keeps the buffer
            # alive until libzmq has sent them, even if the version is dropped meanwhile.
            tracker = self._router.send_multipart(
                [identity, *encode(reply)], flags=zmq.NOBLOCK, copy=False, track=track
            )
            return tracker if track else None
        except zmq.Again:
            log.warning("weight reply dropped: fetcher is not reading", peer=identity.hex())
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                log.debug("weight reply dropped: fetcher is gone", peer=identity.hex())
            else:  # log and keep serving: one peer's trouble must not stop the others
                log.warning("weight reply failed", peer=identity.hex(), error=str(exc))
        return None

