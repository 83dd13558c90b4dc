"""Messages of the weight channel: the trainer's `WeightPublisher` and the rollout side's `WeightFetcher`.

The channel moves one weight version at a time as a contiguous byte snapshot cut into fixed-size
chunks. Conversation (fetcher DEALER -> publisher ROUTER, every request gets exactly one reply):

    WeightFetch(min_version)          -> WeightManifest (latest version)  | WeightError("not_ready")
    WeightChunkRequest(version, i)    -> WeightChunk(version, i, data)    | WeightError("superseded", ...)
    WeightFetchDone(version)          -> WeightFetchAck
    WeightIpcFetch(min_version, gpu)  -> WeightIpcManifest (latest, shared in GPU memory) | WeightError("not_local")
    anything malformed or unexpected  -> WeightError(<codec code> | "bad_request")

Every request carries a `fetch_id` chosen by the fetcher and echoed in the reply, so a fetcher can
drop replies that belong to an earlier, abandoned attempt. The manifest carries one checksum per chunk
and names their algorithm (`CHECKSUM_ALGORITHM`, XXH3-64: ~10x faster than zlib's CRC-32, so it costs
little next to the transfer itself); the fetcher refuses a manifest whose algorithm it does not know
(a peer from another vime version gets a clear `invalid` error, never a wave of checksum mismatches),
checks every chunk and re-requests a chunk that does not match. The checksum guards against corruption
(a random change slips through with probability ~2^-64), not against a malicious publisher.

`WeightIpcFetch` is the fast path on one GPU: a fetcher whose model lives on the very GPU where the
publisher keeps a GPU copy of the snapshot gets a CUDA IPC handle to that copy instead of chunks (no
bytes cross the host), and reports `WeightFetchDone` once it has copied out, which frees the copy for
reuse. Anyone else is answered "not_local" and fetches chunks as usual.

Tensors are described by their torch dtype name (bfloat16 has no numpy dtype, so the bytes travel as
uint8 and are reinterpreted on arrival), shape, and byte range in the snapshot. Offsets are aligned
to `TENSOR_ALIGN` so each tensor can be a zero-copy view of the received buffer.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import xxhash

from vime.protocol.codec import Message, require

# Chunk sizes the publisher accepts. 1-16 MiB is the useful range for bulk transfers (ZeroMQ copies
# frames under 64 KiB, and one huge frame is slower than several MiB-sized ones); smaller chunks down
# to 64 KiB are allowed so tests and tiny models can cross many chunk boundaries cheaply.
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 16 << 20
DEFAULT_CHUNK_BYTES = 4 << 20
# Each tensor starts at a multiple of this, so `uint8 -> dtype` views are always aligned.
TENSOR_ALIGN = 64
# Sanity bounds a receiver enforces on a manifest before allocating anything.
MAX_TOTAL_BYTES = 1 << 40
MAX_TENSOR_DIMS = 8
MAX_NAME_CHARS = 1024
MAX_ADAPTER_CONFIG_BYTES = 64 << 10
# fetch_id is chosen by the fetcher; 63 bits keep it a positive int64 for every msgpack reader.
MAX_FETCH_ID = (1 << 63) - 1

# Torch dtypes that may cross the channel, with their item sizes. Names are `str(dtype)` without
# the "torch." prefix. Complex and quantized types are left out on purpose: no model loader needs them.
WEIGHT_DTYPES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# The per-chunk checksum: XXH3-64 (seed 0) as an unsigned 64-bit int, named in every manifest.
CHECKSUM_ALGORITHM = "xxh3_64"


def chunk_checksum(data: np.ndarray | bytes | memoryview) -> int:
    """The `CHECKSUM_ALGORITHM` checksum of one chunk's bytes (any C-contiguous buffer; no copy)."""
    return xxhash.xxh3_64_intdigest(data)


# WeightError codes specific to this channel (decode failures use the codec's ERROR_* codes).
ERROR_NOT_READY = "not_ready"  # no version >= min_version yet; ask again later
ERROR_SUPERSEDED = "superseded"  # the requested version was dropped for a newer one; restart
ERROR_UNKNOWN_VERSION = "unknown_version"  # never published here (e.g. the publisher restarted)
ERROR_BAD_REQUEST = "bad_request"  # well-formed but impossible (chunk index out of range, ...)
ERROR_INTERNAL = "internal"  # a bug in the publisher; it logged the traceback and kept running
ERROR_NOT_LOCAL = "not_local"  # no GPU copy on the fetcher's GPU: fetch chunks instead


def chunk_count(total_bytes: int, chunk_bytes: int) -> int:
    """How many chunks a snapshot of `total_bytes` is cut into (the last one may be short)."""
    return math.ceil(total_bytes / chunk_bytes) if total_bytes else 0


def chunk_span(index: int, total_bytes: int, chunk_bytes: int) -> tuple[int, int]:
    """The [start, end) byte range of chunk `index`."""
    start = index * chunk_bytes
    return start, min(start + chunk_bytes, total_bytes)


def _valid_fetch_id(value: int) -> bool:
    return 0 <= value <= MAX_FETCH_ID


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of a snapshot: HF name, torch dtype name, shape, and its bytes [offset, offset+nbytes)."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class WeightFetch(Message, tag="weight_fetch"):
    """Fetcher -> publisher: send me the manifest of your latest version, if it is >= min_version."""

    fetch_id: int
    min_version: int = 0

    def validate(self) -> None:
        require(_valid_fetch_id(self.fetch_id), f"fetch_id {self.fetch_id} out of range")
        require(self.min_version >= 0, f"min_version must be >= 0, got {self.min_version}")


class WeightManifest(Message, tag="weight_manifest"):
    """Publisher -> fetcher: what version `version` contains and how it is cut into chunks."""

    fetch_id: int
    version: int
    total_bytes: int
    chunk_bytes: int
    tensors: list[TensorSpec]
    checksum: str  # the algorithm of chunk_checksums; must be CHECKSUM_ALGORITHM
    chunk_checksums: list[int]
    # A LoRA adapter version: its adapter_config.json (text); the tensors are the adapter's, in peft's
    # names. None: full weights.
    adapter_config: str | None = None

    def validate(self) -> None:
        require(_valid_fetch_id(self.fetch_id), f"fetch_id {self.fetch_id} out of range")
        require(self.version >= 0, f"version must be >= 0, got {self.version}")
        _validate_adapter_config(self.adapter_config)
        require(
            MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES,
            f"chunk_bytes {self.chunk_bytes} outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]",
        )
        require(0 <= self.total_bytes <= MAX_TOTAL_BYTES, f"total_bytes {self.total_bytes} out of range")
        require(
            self.checksum == CHECKSUM_ALGORITHM,
            f"chunk checksums are {self.checksum[:40]!r}, this build verifies only {CHECKSUM_ALGORITHM!r} "
            "(publisher and fetcher run different vime versions)",
        )
        expected_chunks = chunk_count(self.total_bytes, self.chunk_bytes)
        require(
            len(self.chunk_checksums) == expected_chunks,
            f"{len(self.chunk_checksums)} checksums for {expected_chunks} chunks",
        )
        require(all(0 <= c < (1 << 64) for c in self.chunk_checksums), "a chunk checksum is not a uint64")
        _validate_tensors(self.tensors, self.total_bytes)
        # Byte ranges must not overlap: every tensor gets its own bytes.
        ranges = sorted((s.offset, s.offset + s.nbytes, s.name) for s in self.tensors if s.nbytes)
        for (_, end, name), (start, _, next_name) in zip(ranges, ranges[1:]):
            require(start >= end, f"tensors {name!r} and {next_name!r} overlap")


def _validate_adapter_config(config: str | None) -> None:
    if config is None:
        return
    require(len(config) <= MAX_ADAPTER_CONFIG_BYTES, f"adapter_config of {len(config)} chars")
    try:
        parsed = msgspec.json.decode(config)
    except msgspec.DecodeError as exc:
        parsed = exc
    require(isinstance(parsed, dict), "adapter_config is not a JSON object")


def _validate_tensors(specs: list[TensorSpec], total_bytes: int) -> None:
    names: set[str] = set()
    for spec in specs:
        _validate_tensor(spec, total_bytes)
        require(spec.name not in names, f"tensor {spec.name!r} appears twice")
        names.add(spec.name)


def _validate_tensor(spec: TensorSpec, total_bytes: int) -> None:
    require(0 < len(spec.name) <= MAX_NAME_CHARS, f"tensor name of {len(spec.name)} chars")
    itemsize = WEIGHT_DTYPES.get(spec.dtype)
    require(itemsize is not None, f"tensor {spec.name!r} has unsupported dtype {spec.dtype!r}")
    assert itemsize is not None
    require(len(spec.shape) <= MAX_TENSOR_DIMS, f"tensor {spec.name!r} has {len(spec.shape)} dims")
    require(all(d >= 0 for d in spec.shape), f"tensor {spec.name!r} has a negative dim {spec.shape}")
    require(
        spec.nbytes == math.prod(spec.shape) * itemsize,
        f"tensor {spec.name!r}: {spec.dtype}{spec.shape} needs {math.prod(spec.shape) * itemsize} bytes, "
        f"manifest says {spec.nbytes}",
    )
    require(spec.offset >= 0 and spec.offset + spec.nbytes <= total_bytes, f"tensor {spec.name!r} out of bounds")
    require(spec.offset % itemsize == 0, f"tensor {spec.name!r} offset {spec.offset} is not aligned")


class WeightChunkRequest(Message, tag="weight_chunk_request"):
    """Fetcher -> publisher: send chunk `index` of `version`. Each request is one credit."""

    fetch_id: int
    version: int
    index: int

    def validate(self) -> None:
        require(_valid_fetch_id(self.fetch_id), f"fetch_id {self.fetch_id} out of range")
        require(self.version >= 0, f"version must be >= 0, got {self.version}")
        require(self.index >= 0, f"chunk index must be >= 0, got {self.index}")


class WeightChunk(Message, tag="weight_chunk"):
    """Publisher -> fetcher: the bytes of one chunk, as a uint8 array (a zero-copy frame)."""

    fetch_id: int
    version: int
    index: int
    data: np.ndarray

    def validate(self) -> None:
        require(_valid_fetch_id(self.fetch_id), f"fetch_id {self.fetch_id} out of range")
        require(self.version >= 0 and self.index >= 0, "version and index must be >= 0")
        require(
            self.data.dtype == np.uint8 and self.data.ndim == 1,
            f"chunk data must be 1-d uint8, got {self.data.dtype}{list(self.data.shape)}",
        )
        require(0 < self.data.size <= MAX_CHUNK_BYTES, f"chunk of {self.data.size} bytes")


class WeightFetchDone(Message, tag="weight_fetch_done"):
    """Fetcher -> publisher: I hold `version`, verified. The publisher logs it and acks."""

    fetch_id: int
    version: int
    nbytes: int
    seconds: float

    def validate(self) -> None:
        require(_valid_fetch_id(self.fetch_id), f"fetch_id {self.fetch_id} out of range")
        require(self.version >= 0 and self.nbytes >= 0, "version and nbytes must be >= 0")
        require(math.isfinite(self.seconds) and self.seconds >= 0, f"seconds {self.seconds} invalid")


class WeightFetchAck(Message, tag="weight_fetch_ack"):
    """Publisher -> fetcher: your WeightFetchDone arrived."""

    fetch_id: int
    version: int


class CudaIpcHandle(msgspec.Struct, frozen=True):
    """What a process on the same GPU needs to map a CUDA allocation of another process (the fields of
    torch's `UntypedStorage._share_cuda_()`), plus the GPU's UUID. Plain bytes and ints: no pickle."""

    gpu_uuid: str
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    def validate(self) -> None:
        require(0 < len(self.gpu_uuid) <= 64, "gpu_uuid must be 1-64 chars")
        require(0 < len(self.handle) <= 256 and len(self.ref_counter_handle) <= 256, "IPC handles of absurd size")
        require(self.device >= 0 and self.storage_bytes >= 0 and self.storage_offset >= 0, "negative IPC field")


class WeightIpcFetch(Message, tag="weight_ipc_fetch"):
    """Fetcher -> publisher: share your latest version (>= min_version) if you hold it on GPU `gpu_uuid`."""

    fetch_id: int
    gpu_uuid: str
    min_version: int = 0

    def validate(self) -> None:
        require(_valid_fetch_id(self.fetch_id), f"fetch_id {self.fetch_id} out of range")
        require(self.min_version >= 0, f"min_version must be >= 0, got {self.min_version}")
        require(0 < len(self.gpu_uuid) <= 64, "gpu_uuid must be 1-64 chars")


class WeightIpcManifest(Message, tag="weight_ipc_manifest"):
    """Publisher -> fetcher: version `version` lies in the GPU buffer behind `buffer`, laid out as `tensors`."""

    fetch_id: int
    version: int
    total_bytes: int
    tensors: list[TensorSpec]
    buffer: CudaIpcHandle
    adapter_config: str | None = None  # as in WeightManifest

    def validate(self) -> None:
        require(_valid_fetch_id(self.fetch_id), f"fetch_id {self.fetch_id} out of range")
        require(self.version >= 0, f"version must be >= 0, got {self.version}")
        _validate_adapter_config(self.adapter_config)
        require(0 <= self.total_bytes <= MAX_TOTAL_BYTES, f"total_bytes {self.total_bytes} out of range")
        require(self.buffer.storage_bytes >= self.total_bytes, "the shared buffer is smaller than the snapshot")
        self.buffer.validate()
        _validate_tensors(self.tensors, self.total_bytes)


class WeightError(Message, tag="weight_error"):
    """Publisher -> fetcher: the request was refused. `fetch_id` is 0 when the request was unreadable."""

    code: str
    detail: str
    fetch_id: int = 0
    latest_version: int | None = None


# What each side accepts; anything else is answered (publisher) or dropped (fetcher) as unexpected.
PUBLISHER_ACCEPTS: tuple[type[Message], ...] = (WeightFetch, WeightChunkRequest, WeightFetchDone, WeightIpcFetch)
FETCHER_ACCEPTS: tuple[type[Message], ...] = (
    WeightManifest, WeightChunk, WeightFetchAck, WeightError, WeightIpcManifest,
)  # fmt: skip
# Requests are tiny; the publisher refuses anything bigger before decoding it.
MAX_REQUEST_BYTES = 64 << 10
