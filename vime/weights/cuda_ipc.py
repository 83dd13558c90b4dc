"""CUDA IPC for the weight channel: share a GPU buffer with another process on the same GPU, map it there.

The producer (`share`) turns a CUDA tensor's storage into a `CudaIpcHandle` of bytes and ints that
travels in a msgpack message; the consumer (`open_shared`) maps it as a uint8 tensor on its own device.
Reading that tensor reads the producer's memory: nothing is copied until the consumer copies out.
Lifetime: torch's IPC reference counting keeps the producer's block allocated while a consumer still
maps it, even if the producer drops its tensor; the consumer unmaps when its tensor is freed. Writing
into a shared buffer while a consumer reads it is the caller's business to avoid (the publisher only
reuses a GPU copy once every reader has reported done).

Only the same physical GPU is supported (`gpu_uuid` must match): mapping another GPU's memory needs
peer access and a device-index translation that differs per process; those cases use the chunked path.
"""

from __future__ import annotations

import torch

from vime.protocol.weights import CudaIpcHandle


class CudaIpcUnavailable(RuntimeError):
    """This process cannot map the shared buffer here (no CUDA, or another GPU)."""


def gpu_uuid(device: torch.device | int | None = None) -> str | None:
    """The UUID of a CUDA device (the current one by default), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
    else:
        index = int(device)
    return str(torch.cuda.get_device_properties(index).uuid)


def share(buffer: torch.Tensor) -> CudaIpcHandle:
    """A handle to `buffer`'s whole storage (a contiguous CUDA uint8 tensor that starts it)."""
    if not buffer.is_cuda or buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.storage_offset() != 0:
        raise ValueError("share() needs a 1-d CUDA uint8 tensor that starts its own storage")
    torch.cuda.current_stream(buffer.device).synchronize()  # the copies into it are complete
    (device, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle, event_sync) = (
        buffer.untyped_storage()._share_cuda_()
    )
    uuid = gpu_uuid(buffer.device)
    assert uuid is not None
    return CudaIpcHandle(
        gpu_uuid=uuid, device=int(device), handle=bytes(handle), storage_bytes=int(storage_bytes),
        storage_offset=int(storage_offset), ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
        event_handle=None if event_handle is None else bytes(event_handle), event_sync_required=bool(event_sync),
    )  # fmt: skip


def open_shared(handle: CudaIpcHandle) -> torch.Tensor:
    """Map the buffer behind `handle` as a 1-d uint8 tensor on this process's GPU with that UUID.

    Raises CudaIpcUnavailable when no visible device has the producer's GPU UUID."""
    if not torch.cuda.is_available():
        raise CudaIpcUnavailable("CUDA IPC needs CUDA")
    local = _visible_index(handle.gpu_uuid)
    if local is None:
        raise CudaIpcUnavailable(f"GPU {handle.gpu_uuid} is not visible to this process")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    # Same arguments torch's own reduction would pickle, with the device index translated to ours
    # (the producer may see the same GPU under another index).
    return rebuild_cuda_tensor(
        torch.Tensor, (handle.storage_bytes,), (1,), 0, torch.storage.TypedStorage, torch.uint8, local,
        handle.handle, handle.storage_bytes, handle.storage_offset, False, handle.ref_counter_handle,
        handle.ref_counter_offset, handle.event_handle, handle.event_sync_required,
    )  # fmt: skip


def _visible_index(uuid: str) -> int | None:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None
