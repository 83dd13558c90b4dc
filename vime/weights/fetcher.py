"""The rollout side of the weight channel: pull the latest weight version from a `WeightPublisher`.

`WeightFetcher.fetch(min_version)` asks for the manifest of the publisher's latest version (waiting,
with backoff, until one >= min_version exists), then pulls its chunks with a credit window: `window`
chunk requests are in flight at any time and each arriving chunk frees a credit for the next request
(the ZeroMQ guide's file-transfer pattern), so the publisher's socket never queues more than `window`
chunks for us and the link stays busy. Every chunk is copied into one receive buffer and checked
against the manifest's XXH3-64 checksum (`chunk_checksum`; a manifest naming another algorithm is
refused); a chunk that fails is requested again (up to `MAX_CHUNK_RETRIES` times). The tensors
returned are views of that buffer, with their original names, dtypes and shapes.

Receive memory: by default every fetch allocates a fresh buffer, so the tensors of earlier fetches
stay valid for as long as the caller keeps them. With `reuse_buffer=True` the fetcher keeps its last
buffer and writes the next fetch of the same total size into it (no allocation, no page faults), but
only when nothing outside the fetcher references that buffer any more, i.e. every tensor of the
previous `FetchedWeights` (and every view, `.numpy()` or slice of them) has been dropped; while any is
alive, a fresh buffer is allocated as usual. So Python-level references can never see their bytes
change. The rule for callers: don't keep a raw address of a returned tensor (`data_ptr()`, ctypes,
a pinned-memory alias registered elsewhere) past dropping the tensor itself. The cost: the fetcher
holds one snapshot's worth of host memory between fetches until `close()`.

On one GPU: `fetch(min_version, gpu_uuid=...)` first asks the publisher to share its GPU copy of the
version over CUDA IPC (`vime.weights.cuda_ipc`). If the publisher holds one on that GPU, the returned
tensors are CUDA views of the publisher's memory (nothing crosses the host) and the caller must call
`FetchedWeights.release()` once it has copied them out: the publisher reuses that memory afterwards.
Otherwise ("not_local", or this process cannot map it) the fetch goes on with chunks as above.

It is built to run inside a vLLM worker process: it has its own ZeroMQ context, needs only pyzmq,
msgspec, numpy, xxhash and torch, and takes nothing but an endpoint string to construct.

Waits and failures (all raise `WeightFetchError`, whose message names the endpoint and the cause):
- no connection to the publisher within `timeout_s` (IMMEDIATE=1: requests are never queued for a peer
  that is not there, so a dead endpoint shows up as "could not connect");
- the connection drops while a reply is expected (the publisher died; noticed within half a second);
- no reply for `timeout_s` while one is expected (a transfer may take longer than `timeout_s` in total,
  as long as replies keep coming);
- no version >= min_version appeared within `timeout_s`;
- a chunk failed its checksum `MAX_CHUNK_RETRIES + 1` times, or the publisher refused a request in a
  way a retry cannot fix.
If the publisher drops the version being fetched (it published newer ones), the fetch restarts on the
latest version, at most `MAX_RESTARTS` times. A publisher that refuses the connection's handshake
(wrong or missing CURVE key) fails the fetch at once, with the reason, instead of after `timeout_s`.
After any failure the same fetcher can fetch again (replies of the abandoned attempt are dropped by
their fetch id).

Security: the socket is secured by a `vime.security.ClientGuard` as client "rollout": CURVE with
`KEYS_DIR/clients/rollout.key_secret` when keys are configured, else plaintext to loopback only.
`security=None` reads the settings from the environment (`VIME_CURVE_KEYS_DIR`,
`VIME_ALLOW_INSECURE`), because fetchers run inside vLLM's worker processes, which vime does not
start itself; the rollout worker exports them. The constructor raises `SecurityError` (not
`WeightFetchError`) for missing keys or plaintext to a network address.

Not thread-safe: one fetch at a time per fetcher. Create it after any fork.
"""

from __future__ import annotations

import secrets
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from vime.logging import get_logger
from vime.protocol.codec import DEFAULT_MAX_HEADER_BYTES, Message, ProtocolError, decode, encode
from vime.security import ClientGuard, Security
from vime.protocol.weights import (
    ERROR_NOT_LOCAL,
    ERROR_NOT_READY,
    ERROR_SUPERSEDED,
    ERROR_UNKNOWN_VERSION,
    FETCHER_ACCEPTS,
    MAX_CHUNK_BYTES,
    MAX_FETCH_ID,
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
    chunk_span,
)

log = get_logger(__name__)

MAX_CHUNK_RETRIES = 3  # re-requests of one chunk after checksum failures before giving up
MAX_RESTARTS = 8  # restarts because the publisher dropped the version being fetched
MAX_WINDOW = 64
# Polling backoff while the publisher has no version >= min_version yet.
_NOT_READY_BACKOFF_S = (0.01, 0.25)
# How long to wait for the ack of WeightFetchDone; the weights are already verified, so a missing ack
# is only logged.
_ACK_WAIT_S = 1.0
# While waiting to connect, how often to look whether the publisher refused our handshake.
_CONNECT_SLICE_S = 0.1
# ZMTP heartbeats: a publisher that answers no PING for this long is disconnected (then IMMEDIATE=1
# makes requests fail fast instead of queueing for it).
_HEARTBEAT_IVL_MS = 5_000
_HEARTBEAT_TIMEOUT_MS = 30_000


class WeightFetchError(RuntimeError):
    """A fetch that failed in a way retrying within this call cannot fix."""


class _Restart(Exception):
    """The version being fetched is gone from the publisher; start over on the latest."""


@dataclass
class FetchedWeights:
    """One verified weight version. `tensors` are views of a single buffer of `nbytes` bytes: CPU
    memory of this process (transport "chunks"), or the publisher's GPU memory (transport "cuda_ipc").

    With `WeightFetcher(reuse_buffer=True)` a chunks buffer is recycled by a later fetch once none of
    these tensors (nor any view of them) is referenced any more; see the module docstring. A cuda_ipc
    fetch must be `release()`d once its tensors are copied out.
    """

    version: int
    tensors: list[tuple[str, torch.Tensor]]
    nbytes: int
    seconds: float
    transport: str = "chunks"
    _release: Callable[[], None] | None = field(default=None, repr=False)
    # A LoRA adapter version: its adapter_config.json as a dict (the tensors are the adapter's, in
    # peft's names); None for full weights.
    adapter_config: dict[str, Any] | None = None

    def release(self) -> None:
        """Drop the tensors; for cuda_ipc, tell the publisher its GPU copy may be reused. Idempotent."""
        self.tensors = []
        release, self._release = self._release, None
        if release is not None:
            release()


class WeightFetcher:
    """Pulls versioned weights from the `WeightPublisher` at `endpoint`. Also a context manager.

    `reuse_buffer=True` lets a fetch write into the previous fetch's receive buffer when that buffer
    has the right size and is no longer referenced (module docstring: "Receive memory").
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 60.0,
        window: int = 4,
        reuse_buffer: bool = False,
        security: Security | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not 1 <= window <= MAX_WINDOW:
            raise ValueError(f"window must be in [1, {MAX_WINDOW}], got {window}")
        self._endpoint = endpoint
        self._timeout_s = float(timeout_s)
        self._window = window
        self._reuse_buffer = bool(reuse_buffer)
        self._kept: np.ndarray | None = None  # the last receive buffer, held only when reuse_buffer
        self._kept_free_refs = 0  # refcount of `_kept` when nothing but the fetcher holds it
        # Test hook: called with the chunk index after each verified chunk (e.g. to publish mid-fetch).
        self._after_chunk: Callable[[int], None] | None = None
        self._guard = ClientGuard(
            Security.from_env() if security is None else security, role="rollout", name="weight fetcher", endpoint=endpoint
        )  # fmt: skip
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)  # close() must not block on unsent requests
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for a publisher that isn't there
        self._sock.setsockopt(zmq.SNDHWM, 4 * MAX_WINDOW)
        self._sock.setsockopt(zmq.RCVHWM, 4 * MAX_WINDOW)
        # Guards against a peer that sends absurd frames: the largest legal frame is a chunk or a header.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(MAX_CHUNK_BYTES, DEFAULT_MAX_HEADER_BYTES) + (64 << 10))
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        self._guard.secure(self._sock)
        self._sock.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._closed = False
        self._disconnects_at_start = 0

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def fetch(self, min_version: int = 0, gpu_uuid: str | None = None) -> FetchedWeights:
        """Block until the publisher's latest version (>= min_version) is here, verified; return it.
        With `gpu_uuid` (this process's GPU) try the CUDA IPC path first (module docstring)."""
        if self._closed:
            raise WeightFetchError("fetch on a closed WeightFetcher")
        if min_version < 0:
            raise ValueError(f"min_version must be >= 0, got {min_version}")
        start = time.perf_counter()
        self._disconnects_at_start = self._guard.disconnects
        if gpu_uuid is not None:
            shared = self._fetch_shared(min_version, gpu_uuid, start)
            if shared is not None:
                return shared
        for attempt in range(MAX_RESTARTS + 1):
            fetch_id = secrets.randbelow(MAX_FETCH_ID) + 1
            manifest = self._manifest(fetch_id, min_version)
            try:
                tensors = self._pull(manifest)
            except _Restart as why:
                # The next manifest is the publisher's latest, whatever that is now.
                log.info("weight fetch restarting", endpoint=self._endpoint, reason=str(why), attempt=attempt)
                continue
            seconds = time.perf_counter() - start
            self._report_done(manifest, seconds)
            log.info(
                "weights fetched",
                version=manifest.version,
                nbytes=manifest.total_bytes,
                seconds=round(seconds, 4),
                endpoint=self._endpoint,
            )
            return FetchedWeights(
                manifest.version, tensors, manifest.total_bytes, seconds, adapter_config=_adapter_config(manifest.adapter_config),
            )  # fmt: skip
        raise WeightFetchError(
            f"publisher at {self._endpoint} replaced versions {MAX_RESTARTS + 1} times during one fetch; "
            "it publishes faster than this fetcher can pull (raise the publisher's `keep`)"
        )

    def close(self) -> None:
        """Close the socket and context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._kept = None
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> WeightFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- steps of a fetch ----------------------------------------------------------------------

    def _fetch_shared(self, min_version: int, gpu_uuid: str, start: float) -> FetchedWeights | None:
        """The CUDA IPC path: the version as views of the publisher's GPU copy, or None to fetch chunks."""
        from vime.weights.cuda_ipc import CudaIpcUnavailable, open_shared

        fetch_id = secrets.randbelow(MAX_FETCH_ID) + 1
        deadline = time.monotonic() + self._timeout_s
        self._send(WeightIpcFetch(fetch_id=fetch_id, gpu_uuid=gpu_uuid, min_version=min_version), deadline)
        reply = self._recv(fetch_id, deadline, waiting_for="a shared-memory manifest")
        if isinstance(reply, WeightError) and reply.code in (ERROR_NOT_LOCAL, ERROR_NOT_READY):
            log.debug("weights not shared on this GPU; fetching chunks", endpoint=self._endpoint, reason=reply.detail)
            return None  # not_ready: the chunk path waits for the version with its own backoff
        if not isinstance(reply, WeightIpcManifest):
            raise self._refused(reply, "a shared-memory manifest")
        manifest = reply
        done = WeightFetchDone(fetch_id=fetch_id, version=manifest.version, nbytes=manifest.total_bytes, seconds=0.0)

        def release() -> None:
            try:
                self._send(done, time.monotonic() + min(_ACK_WAIT_S, self._timeout_s))
            except WeightFetchError as exc:  # the publisher forgets stalled readers on its own
                log.warning("shared weights not released", version=manifest.version, error=str(exc))

        try:
            buffer = open_shared(manifest.buffer)
        except CudaIpcUnavailable as exc:
            release()
            log.info("cannot map the publisher's GPU copy; fetching chunks", endpoint=self._endpoint, reason=str(exc))
            return None
        seconds = time.perf_counter() - start
        log.info("weights mapped", version=manifest.version, nbytes=manifest.total_bytes, seconds=round(seconds, 4),
                 endpoint=self._endpoint)  # fmt: skip
        tensors = _tensors_from(buffer, manifest.tensors)
        return FetchedWeights(
            manifest.version, tensors, manifest.total_bytes, seconds, "cuda_ipc", release, _adapter_config(manifest.adapter_config),
        )  # fmt: skip

    def _manifest(self, fetch_id: int, min_version: int) -> WeightManifest:
        """Ask for the latest manifest until one >= min_version exists or timeout_s has passed."""
        version_deadline = time.monotonic() + self._timeout_s
        backoff = _NOT_READY_BACKOFF_S[0]
        while True:
            # Each request may wait timeout_s for its reply; polling for the version is bounded separately.
            reply_deadline = time.monotonic() + self._timeout_s
            self._send(WeightFetch(fetch_id=fetch_id, min_version=min_version), reply_deadline)
            reply = self._recv(fetch_id, reply_deadline, waiting_for="a manifest")
            if isinstance(reply, WeightManifest):
                if reply.version < min_version:  # a publisher that ignores min_version is broken
                    raise WeightFetchError(f"publisher sent version {reply.version}, asked for >= {min_version}")
                return reply
            if isinstance(reply, WeightError) and reply.code == ERROR_NOT_READY:
                remaining = version_deadline - time.monotonic()
                if remaining <= 0:
                    raise WeightFetchError(
                        f"publisher at {self._endpoint} has version {reply.latest_version}; no version "
                        f">= {min_version} appeared within {self._timeout_s:g} s"
                    )
                time.sleep(min(backoff, remaining))
                backoff = min(backoff * 2, _NOT_READY_BACKOFF_S[1])
                continue
            raise self._refused(reply, "a manifest")

    def _pull(self, manifest: WeightManifest) -> list[tuple[str, torch.Tensor]]:
        """Pull every chunk of `manifest` into one buffer with `window` requests in flight; verify each."""
        total, size, checksums = manifest.total_bytes, manifest.chunk_bytes, manifest.chunk_checksums
        buffer = self._receive_buffer(total)
        todo: deque[int] = deque(range(len(checksums)))  # chunks not yet requested (or to re-request)
        in_flight: set[int] = set()
        failures: dict[int, int] = {}
        done = 0
        while done < len(checksums):
            while todo and len(in_flight) < self._window:
                index = todo.popleft()
                request = WeightChunkRequest(fetch_id=manifest.fetch_id, version=manifest.version, index=index)
                self._send(request, time.monotonic() + self._timeout_s)
                in_flight.add(index)
            deadline = time.monotonic() + self._timeout_s
            reply = self._recv(manifest.fetch_id, deadline, waiting_for=f"chunks of version {manifest.version}")
            if isinstance(reply, WeightError):
                if reply.code in (ERROR_SUPERSEDED, ERROR_UNKNOWN_VERSION):
                    raise _Restart(f"{reply.code}: {reply.detail}")
                raise self._refused(reply, f"a chunk of version {manifest.version}")
            if not isinstance(reply, WeightChunk) or reply.version != manifest.version:
                continue  # an ack or manifest repeated by a confused peer; nothing to do with it
            index = reply.index
            if index not in in_flight:
                continue  # a duplicate of a chunk we already hold
            in_flight.discard(index)
            start, end = chunk_span(index, total, size)
            target = buffer[start:end]
            if reply.data.size == target.size:
                target[:] = reply.data  # the one copy: frame -> final place
                intact = chunk_checksum(target) == checksums[index]  # check the bytes we will return
            else:
                intact = False
            if not intact:
                failures[index] = failures.get(index, 0) + 1
                log.warning(
                    "weight chunk failed its checksum",
                    version=manifest.version,
                    index=index,
                    failures=failures[index],
                    endpoint=self._endpoint,
                )
                if failures[index] > MAX_CHUNK_RETRIES:
                    raise WeightFetchError(
                        f"chunk {index} of version {manifest.version} from {self._endpoint} failed its "
                        f"checksum {failures[index]} times"
                    )
                todo.appendleft(index)
                continue
            done += 1
            if self._after_chunk is not None:
                self._after_chunk(index)
        return _tensors_from(torch.from_numpy(buffer), manifest.tensors)

    def _receive_buffer(self, total: int) -> np.ndarray:
        """A buffer of `total` bytes for the next fetch: the kept one if reuse is on and it is free."""
        if self._kept is not None and self._kept.size == total and self._kept_refcount() <= self._kept_free_refs:
            log.debug("weight receive buffer reused", nbytes=total)
            return self._kept
        self._kept = None  # a kept buffer still referenced lives on with its referents, then is freed
        buffer = np.empty(total, dtype=np.uint8)
        if not self._reuse_buffer:
            return buffer
        self._kept = buffer
        del buffer
        # The count with the fetcher as the only holder, measured through the same call the check uses,
        # so it does not depend on how this interpreter counts temporaries. Anything above it later is a
        # tensor, view or array of an earlier fetch that is still alive: that buffer is not overwritten.
        self._kept_free_refs = self._kept_refcount()
        return self._kept

    def _kept_refcount(self) -> int:
        return sys.getrefcount(self._kept)

    def _report_done(self, manifest: WeightManifest, seconds: float) -> None:
        """Tell the publisher we hold this version and wait briefly for its ack (logged if missing)."""
        done = WeightFetchDone(
            fetch_id=manifest.fetch_id, version=manifest.version, nbytes=manifest.total_bytes, seconds=seconds
        )
        deadline = time.monotonic() + min(_ACK_WAIT_S, self._timeout_s)
        try:
            self._send(done, deadline)
            while True:
                reply = self._recv(manifest.fetch_id, deadline, waiting_for="the fetch ack")
                if isinstance(reply, WeightFetchAck):
                    return
        except WeightFetchError as exc:
            log.warning("weight fetch not acknowledged", version=manifest.version, error=str(exc))

    # --- socket helpers --------------------------------------------------------------------------

    def _send(self, msg: Message, deadline: float) -> None:
        """Send once the publisher is connected; raise if it is not connected by `deadline`, or at once
        if it refused our handshake."""
        while True:
            try:
                self._sock.send_multipart(encode(msg), flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass  # IMMEDIATE: no live connection yet (or the queue is full); wait for POLLOUT
            rejection = self._guard.rejection
            if rejection is not None:
                raise WeightFetchError(f"the weight publisher at {self._endpoint} refused the connection: {rejection}")
            self._raise_if_dropped("was sending a request")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WeightFetchError(
                    f"could not connect to the weight publisher at {self._endpoint} within "
                    f"{self._timeout_s:g} s (is it running?)"
                )
            self._sock.poll(int(min(remaining, _CONNECT_SLICE_S) * 1000) + 1, zmq.POLLOUT)

    def _raise_if_dropped(self, doing: str) -> None:
        """Fail the fetch if the connection was lost since it began: the publisher's process died, so
        its replies will never come (and a restarted trainer publishes at another address)."""
        if self._guard.disconnects != self._disconnects_at_start:
            raise WeightFetchError(
                f"the weight publisher at {self._endpoint} closed the connection while this fetcher {doing} "
                "(publisher gone?)"
            )

    def _recv(self, fetch_id: int, deadline: float, *, waiting_for: str) -> Message:
        """The next reply of this fetch; replies of earlier fetches are dropped. Raise at `deadline`, or
        soon after the connection drops (`_raise_if_dropped`)."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WeightFetchError(
                    f"no reply from the weight publisher at {self._endpoint} within {self._timeout_s:g} s "
                    f"while waiting for {waiting_for}"
                )
            if not self._poller.poll(int(min(remaining, _CONNECT_SLICE_S * 5) * 1000) + 1):
                self._raise_if_dropped(f"waited for {waiting_for}")
                continue
            frames = self._sock.recv_multipart(copy=False)
            try:
                reply = decode(frames, expect=FETCHER_ACCEPTS)
            except ProtocolError as exc:
                # The publisher speaks our protocol or it is not a publisher; retrying cannot help.
                raise WeightFetchError(f"unreadable reply from {self._endpoint}: {exc}") from None
            reply_id = getattr(reply, "fetch_id", 0)
            if reply_id == fetch_id or (isinstance(reply, WeightError) and reply_id == 0):
                return reply
            log.debug("stale weight reply dropped", reply_type=type(reply).__name__, fetch_id=reply_id)

    def _refused(self, reply: Message, what: str) -> WeightFetchError:
        if isinstance(reply, WeightError):
            return WeightFetchError(
                f"publisher at {self._endpoint} refused {what}: {reply.code}: {reply.detail}"
            )
        return WeightFetchError(f"publisher at {self._endpoint} answered {type(reply).__name__} to {what}")


def _adapter_config(text: str | None) -> dict[str, Any] | None:
    """The manifest's adapter config (validated as a JSON object when the manifest was decoded)."""
    return None if text is None else msgspec.json.decode(text)


def _tensors_from(base: torch.Tensor, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Views of the uint8 `base` as the manifest's tensors (offsets are aligned: `.view(dtype)` is legal)."""
    out: list[tuple[str, torch.Tensor]] = []
    for spec in specs:
        raw = base[spec.offset : spec.offset + spec.nbytes]
        tensor = raw.view(getattr(torch, spec.dtype)).reshape(spec.shape)
        out.append((spec.name, tensor))
    return out

