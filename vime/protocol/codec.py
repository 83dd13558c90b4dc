"""The wire format: a msgpack header frame plus zero-copy binary frames for arrays.

A message is a `msgspec.Struct` subclass of `Message`, tagged with its type name. On the wire it is a
ZeroMQ multipart message:

    frame 0:   msgpack [PROTOCOL_VERSION, {"type": <tag>, ...fields}]
    frame 1..: raw array bytes, referenced from the header by index

Numpy arrays of `INLINE_ARRAY_BYTES` or more travel as their own frames, sent without copying
(`send_multipart(frames, copy=False)`); smaller ones are inlined in the header, because a frame costs
more than copying a few bytes (vLLM frames its tensors the same way). An array in the header is the
list `[dtype, shape, frame_index]` or `[dtype, shape, raw_bytes]`.

Decoding validates everything before any state changes: the protocol version, the message type, every
field's type (msgspec), each array's dtype against an allow-list and its byte length against its shape,
and the sizes of frames. Every failure raises `ProtocolError` with a code and a message that names the
problem, so a receiver can log it, reply with an error and keep running. Nothing here unpickles.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Sequence
from typing import Any, Literal, get_args

import msgspec
import numpy as np

PROTOCOL_VERSION = 1

# Arrays smaller than this are inlined in the header: a separate frame costs more than the copy.
INLINE_ARRAY_BYTES = 256
# Defaults a receiver enforces unless it passes its own limits.
DEFAULT_MAX_HEADER_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_FRAMES = 65_536
DEFAULT_MAX_TOTAL_BYTES = 1 << 31

# Only plain numeric dtypes cross the wire; object/structured dtypes could smuggle arbitrary data.
DtypeName = Literal[
    "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64", "bool"
]
ALLOWED_DTYPES = frozenset(get_args(DtypeName))


class ProtocolError(Exception):
    """A message that cannot be accepted. `code` is one of the ERROR_* constants below."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


ERROR_MALFORMED = "malformed"
ERROR_OVERSIZED = "oversized"
ERROR_UNKNOWN_TYPE = "unknown_type"
ERROR_BAD_VERSION = "bad_version"
ERROR_INVALID = "invalid"
# The sender is not registered (the broker restarted and lost its session): say Hello again.
ERROR_UNKNOWN_PEER = "unknown_peer"
# The trainer asked for a step the broker can no longer serve (see BrokerState.request_batch).
ERROR_CANNOT_RESUME = "cannot_resume"
# A worker of another job said Hello (two jobs sharing one broker address).
ERROR_WRONG_JOB = "wrong_job"


class Message(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """Base of every wire message. Subclasses set `tag=` and may override `validate()`."""

    def validate(self) -> None:
        """Semantic checks beyond field types (lengths agree, values in range). Raise ProtocolError."""


def message_types() -> dict[str, type[Message]]:
    """Every concrete message type defined so far, by tag (subclasses register by being defined)."""
    found: dict[str, type[Message]] = {}
    pending = list(Message.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        tag = cls.__struct_config__.tag
        if tag is None:
            continue
        if tag in found and found[tag] is not cls:
            raise TypeError(f"two message types share the tag {tag!r}: {found[tag]} and {cls}")
        found[tag] = cls  # type: ignore[assignment]
    return found


def message_tag(cls: type[Message]) -> str:
    return cls.__struct_config__.tag  # type: ignore[return-value]


_frames_out: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("vime_frames_out")
_frames_in: contextvars.ContextVar[Sequence[Any]] = contextvars.ContextVar("vime_frames_in")


# numpy's `dtype.name` is computed in Python on every access; a message of many small arrays (a group's
# samples) spent more time naming dtypes than encoding. Lookups by dtype (hashed in C) instead.
_DTYPE_NAMES: dict[np.dtype[Any], str] = {np.dtype(name): name for name in ALLOWED_DTYPES}
_DTYPES: dict[str, np.dtype[Any]] = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        name = _DTYPE_NAMES.get(obj.dtype)
        if name is None:
            raise TypeError(f"dtype {obj.dtype.name} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}")
        arr = np.ascontiguousarray(obj)
        if arr.nbytes < INLINE_ARRAY_BYTES:
            return [name, list(arr.shape), arr.tobytes()]
        frames = _frames_out.get()
        frames.append(arr.data if arr.ndim else memoryview(arr.tobytes()))
        return [name, list(arr.shape), len(frames) - 1]
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode object of type {type(obj).__name__}")


def _frame_buffer(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    return frame.buffer  # zmq.Frame: a read-only view of the received bytes, no copy


def _dec_hook(expected: type, obj: Any) -> Any:
    if expected is not np.ndarray:
        raise msgspec.ValidationError(f"unsupported type {expected!r}")
    if not (isinstance(obj, list) and len(obj) == 3):
        raise msgspec.ValidationError("an array must be [dtype, shape, frame_index | bytes]")
    return _array_from(*obj)


def _array_from(dtype_name: Any, shape: Any, ref: Any) -> np.ndarray:
    """The array `[dtype_name, shape, ref]` of the message being decoded, a read-only view of its bytes;
    msgspec.ValidationError naming the problem unless dtype, shape and bytes agree."""
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise msgspec.ValidationError(f"array dtype {dtype_name!r} is not allowed")
    # 1-D arrays (tokens, logprobs, masks, versions: most arrays of a group) take the short way: this
    # runs for every array of every message, 300 k times in a 10 s run of bench/broker_scale.py.
    one_dim = type(shape) is list and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0
    if one_dim:
        expected_bytes = shape[0] * dtype.itemsize
    elif not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape) or len(shape) > 8:
        raise msgspec.ValidationError(f"array shape {shape!r} is not a list of non-negative ints")
    else:
        expected_bytes = math.prod(shape) * dtype.itemsize
    if type(ref) is bytes:
        if len(ref) != expected_bytes:
            raise msgspec.ValidationError(
                f"array of dtype {dtype_name} shape {shape} needs {expected_bytes} bytes, got {len(ref)}"
            )
        # frombuffer is already 1-D: a reshape would add a second array object to every small array.
        return np.frombuffer(ref, dtype=dtype) if one_dim else np.frombuffer(ref, dtype=dtype).reshape(shape)
    if isinstance(ref, bytes):
        buf: memoryview = memoryview(ref)
    elif isinstance(ref, int):
        frames = _frames_in.get()
        if not 1 <= ref < len(frames):
            raise msgspec.ValidationError(f"array refers to frame {ref}, message has {len(frames)} frames")
        buf = _frame_buffer(frames[ref])
    else:
        raise msgspec.ValidationError("array data must be a frame index or bytes")
    if buf.nbytes != expected_bytes:
        raise msgspec.ValidationError(
            f"array of dtype {dtype_name} shape {shape} needs {expected_bytes} bytes, got {buf.nbytes}"
        )
    return np.frombuffer(buf, dtype=dtype) if one_dim else np.frombuffer(buf, dtype=dtype).reshape(shape)


class WireArray(msgspec.Struct, array_like=True, gc=False):
    """An array as it travels, `[dtype, shape, bytes | frame_index]`, for a receiver that forwards arrays
    rather than reading them: msgspec decodes and re-encodes it in C, with no hook and no numpy object.

    A message type that declares a field as `WireArray` gets it undecoded; `wire_array_value` (or
    `np.asarray`, once its message is decoded) turns one into a numpy array. A frame index is only valid
    while its own message is being decoded, so a receiver follows those in its `validate`.

    Untracked by the garbage collector (nothing in it can hold a reference cycle; the shape is a tuple for
    the same reason): a broker holds tens of thousands, and tracked ones made every collection walk them.
    """

    dtype: DtypeName
    shape: tuple[int, ...]
    data: int | bytes

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = wire_array_value(self)
        return arr if dtype is None else arr.astype(dtype)


def wire_array_value(wire: WireArray) -> np.ndarray:
    """`wire` as a read-only numpy array; call it while its message is being decoded (in `validate`), where
    a frame index still means something. Raises ProtocolError (`invalid`) if dtype, shape and bytes disagree."""
    try:
        return _array_from(wire.dtype, list(wire.shape), wire.data)
    except msgspec.ValidationError as exc:
        raise ProtocolError(ERROR_INVALID, str(exc)) from None


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder_cache: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def _decoder_for(types: tuple[type[Message], ...] | None) -> msgspec.msgpack.Decoder[Any]:
    # Receivers that name their types (the broker, the workers) skip the registry walk entirely.
    key = types or tuple(message_types().values())
    decoder = _decoder_cache.get(key)
    if decoder is None:
        target = key[0] if len(key) == 1 else _union(key)
        decoder = msgspec.msgpack.Decoder(tuple[int, target], dec_hook=_dec_hook)  # type: ignore[valid-type]
        _decoder_cache[key] = decoder
    return decoder


def _union(members: tuple[type[Message], ...]) -> Any:
    from typing import Union

    return Union[members]  # noqa: UP007 - built dynamically from the registry


def encode(msg: Message) -> list[Any]:
    """Encode a message into frames for `socket.send_multipart(frames, copy=False)`.

    Array frames are views of the caller's arrays: keep them unchanged until the send completes
    (or send with `track=True` and wait on the tracker).
    """
    frames: list[Any] = [b""]
    token = _frames_out.set(frames)
    try:
        frames[0] = _encoder.encode((PROTOCOL_VERSION, msg))
    finally:
        _frames_out.reset(token)
    return frames


def decode(
    frames: Sequence[Any],
    expect: tuple[type[Message], ...] | None = None,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_frames: int = DEFAULT_MAX_FRAMES,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
) -> Message:
    """Decode and validate frames into a message; raises ProtocolError naming the problem.

    `expect` limits which message types this receiver accepts (others are `unknown_type`).
    Arrays in the result are read-only views of the received frames (no copy).
    """
    if not frames:
        raise ProtocolError(ERROR_MALFORMED, "empty message")
    if len(frames) > max_frames:
        raise ProtocolError(ERROR_OVERSIZED, f"{len(frames)} frames, limit {max_frames}")
    header = _frame_buffer(frames[0])
    if header.nbytes > max_header_bytes:
        raise ProtocolError(ERROR_OVERSIZED, f"header of {header.nbytes} bytes, limit {max_header_bytes}")
    total = sum(_frame_buffer(f).nbytes for f in frames)
    if total > max_total_bytes:
        raise ProtocolError(ERROR_OVERSIZED, f"message of {total} bytes, limit {max_total_bytes}")
    token = _frames_in.set(frames)
    try:
        version, msg = _decode_header(header, expect)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(ERROR_BAD_VERSION, f"protocol version {version}, this build speaks {PROTOCOL_VERSION}")
        # still inside the frames' context: a message holding `WireArray`s follows their frame indices here
        msg.validate()
    finally:
        _frames_in.reset(token)
    return msg  # type: ignore[no-any-return]


def _decode_header(header: memoryview, expect: tuple[type[Message], ...] | None) -> tuple[int, Message]:
    try:
        return _decoder_for(expect).decode(header)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        # Only on failure is the header read a second time, generically, so a wrong version or an
        # unknown type is reported as such rather than as whatever field error the typed decode hit.
        tag = _check_envelope(header)
        if expect is not None and tag not in {message_tag(cls) for cls in expect}:
            accepted = sorted(message_tag(cls) for cls in expect)
            raise ProtocolError(ERROR_UNKNOWN_TYPE, f"message type {tag!r} is not accepted here; accepted: {accepted}") from None
        raise ProtocolError(ERROR_INVALID, str(exc)) from None
    except msgspec.DecodeError as exc:
        _check_envelope(header)
        raise ProtocolError(ERROR_MALFORMED, str(exc)) from None


_envelope_decoder = msgspec.msgpack.Decoder(tuple[int, dict[str, Any]])


def _check_envelope(header: memoryview) -> str:
    """Check version and tag first, so those errors say what is wrong rather than a field error; returns
    the message's tag, one of the known message types."""
    try:
        version, body = _envelope_decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(ERROR_MALFORMED, f"header is not [version, {{...}}]: {exc}") from None
    if version != PROTOCOL_VERSION:
        raise ProtocolError(ERROR_BAD_VERSION, f"protocol version {version}, this build speaks {PROTOCOL_VERSION}")
    tag = body.get("type")
    if tag not in message_types():
        raise ProtocolError(ERROR_UNKNOWN_TYPE, f"unknown message type {tag!r}")
    return tag  # type: ignore[no-any-return]


def require(condition: bool, detail: str) -> None:
    """Raise an `invalid` ProtocolError unless condition holds; for use in `Message.validate`."""
    if not condition:
        raise ProtocolError(ERROR_INVALID, detail)
