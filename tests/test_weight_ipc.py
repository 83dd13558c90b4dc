"""The weight channel's CUDA IPC path: wire messages, the publisher's answers, the fetcher's fallback.

On a machine without CUDA the publisher holds no GPU copy, so a fetcher that offers its GPU gets
"not_local" and fetches chunks; on a CUDA machine the shared copy is mapped and must match bit for bit.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from vime.protocol.codec import ProtocolError, decode, encode
from vime.protocol.weights import (
    ERROR_NOT_LOCAL,
    PUBLISHER_ACCEPTS,
    CudaIpcHandle,
    TensorSpec,
    WeightError,
    WeightIpcFetch,
    WeightIpcManifest,
)
from vime.weights import WeightFetcher, WeightPublisher
from vime.weights.cuda_ipc import CudaIpcUnavailable, gpu_uuid, open_shared

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA GPU")


def _handle(**changes: object) -> CudaIpcHandle:
    fields = dict(gpu_uuid="GPU-0000", device=0, handle=b"h" * 64, storage_bytes=1024, storage_offset=0,
                  ref_counter_handle=b"r" * 16, ref_counter_offset=0, event_handle=None, event_sync_required=False)  # fmt: skip
    fields.update(changes)
    return CudaIpcHandle(**fields)  # type: ignore[arg-type]


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(33, 17, generator=g).to(torch.bfloat16)), ("b.bias", torch.randn(5, generator=g))]


def test_ipc_messages_round_trip_and_refuse_a_manifest_bigger_than_its_buffer() -> None:
    spec = TensorSpec(name="w", dtype="float32", shape=[4, 4], offset=0, nbytes=64)
    manifest = WeightIpcManifest(fetch_id=3, version=2, total_bytes=64, tensors=[spec], buffer=_handle())
    back = decode(encode(manifest), expect=(WeightIpcManifest,))
    assert back == manifest
    too_small = msgspec.structs.replace(manifest, buffer=_handle(storage_bytes=32))
    with pytest.raises(ProtocolError, match="smaller than the snapshot"):
        decode(encode(too_small), expect=(WeightIpcManifest,))
    assert WeightIpcFetch in PUBLISHER_ACCEPTS
    with pytest.raises(ProtocolError, match="gpu_uuid"):
        decode(encode(WeightIpcFetch(fetch_id=1, gpu_uuid="")), expect=(WeightIpcFetch,))


def test_a_publisher_without_a_gpu_copy_answers_not_local_and_the_fetcher_falls_back_to_chunks() -> None:
    """CPU tensors (or cuda_ipc off) leave no GPU copy: the offer of a GPU is refused by name, and
    fetch(gpu_uuid=...) still returns the exact bytes, over chunks."""
    import zmq

    weights = _weights(0)
    with WeightPublisher(cuda_ipc=True) as pub:
        pub.publish(1, weights)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(pub.endpoint)
        sock.send_multipart(encode(WeightIpcFetch(fetch_id=9, gpu_uuid="GPU-elsewhere", min_version=1)))
        assert sock.poll(5000)
        reply = decode(sock.recv_multipart(), expect=(WeightError, WeightIpcManifest))
        sock.close(linger=0)
        ctx.term()
        assert isinstance(reply, WeightError) and reply.code == ERROR_NOT_LOCAL and "no GPU copy" in reply.detail
        with WeightFetcher(pub.endpoint, timeout_s=10) as fetcher:
            fetched = fetcher.fetch(min_version=1, gpu_uuid="GPU-elsewhere")
        assert fetched.transport == "chunks"
        for (name, got), (want_name, want) in zip(fetched.tensors, weights):
            assert name == want_name and torch.equal(got, want)


def test_opening_a_handle_needs_the_gpu_it_names() -> None:
    """Also on CPU: no CUDA at all is the same refusal, by the same exception class."""
    with pytest.raises(CudaIpcUnavailable):
        open_shared(_handle(gpu_uuid="GPU-not-here"))


_CONSUMER = """
import hashlib, json, sys
import torch
from vime.weights import WeightFetcher
from vime.weights.cuda_ipc import gpu_uuid
with WeightFetcher(sys.argv[1], timeout_s=30) as fetcher:
    fetched = fetcher.fetch(min_version=int(sys.argv[2]), gpu_uuid=gpu_uuid(0))
    digest = hashlib.sha256()
    for name, tensor in fetched.tensors:
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    print(json.dumps({"transport": fetched.transport, "version": fetched.version, "digest": digest.hexdigest()}))
    if sys.argv[3] == "release":
        fetched.release()
"""


def _digest(weights: list[tuple[str, torch.Tensor]]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in weights:
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _consume(endpoint: str, version: int, release: bool) -> dict[str, object]:
    import json
    import subprocess
    import sys

    from conftest import run_env

    done = subprocess.run([sys.executable, "-c", _CONSUMER, endpoint, str(version), "release" if release else "keep"],
                          capture_output=True, text=True, timeout=120, env=run_env(), check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@cuda
def test_another_process_on_the_publishers_gpu_maps_its_copy_and_a_release_frees_it_for_reuse() -> None:
    """The consumer process reads the exact bytes through CUDA IPC. A reader that never releases keeps
    its version's copy from being rewritten (the next version goes to fresh memory); after a release
    the next version reuses the copy."""
    import time

    device = torch.device("cuda", 0)
    with WeightPublisher(cuda_ipc=True, keep=1) as pub:
        first = [(n, t.to(device)) for n, t in _weights(1)]
        pub.publish(1, first)
        got = _consume(pub.endpoint, 1, release=False)
        assert got == {"transport": "cuda_ipc", "version": 1, "digest": _digest(first)}
        held = pub._snapshots[1].gpu.data_ptr()
        second = [(n, t.to(device)) for n, t in _weights(2)]
        pub.publish(2, second)  # version 1's reader never said done: its copy is not rewritten
        assert pub._snapshots[2].gpu.data_ptr() != held
        assert _consume(pub.endpoint, 2, release=True)["digest"] == _digest(second)
        for _ in range(250):  # the release is a message the server thread handles shortly
            if not pub._snapshots[2].ipc_readers:
                break
            time.sleep(0.02)
        assert not pub._snapshots[2].ipc_readers
        reused = pub._snapshots[2].gpu.data_ptr()
        third = [(n, t.to(device)) for n, t in _weights(3)]
        pub.publish(3, third)
        assert pub._snapshots[3].gpu.data_ptr() == reused
        assert _consume(pub.endpoint, 3, release=True)["digest"] == _digest(third)
