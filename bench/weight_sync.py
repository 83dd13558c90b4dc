"""Benchmark the weight channel against raw ZeroMQ moving the same bytes.

A child process plays the trainer (a `WeightPublisher` serving a bf16 model-like state dict); this
process plays a rollout worker (a `WeightFetcher`). For each total size it measures `publish` (copy into
the snapshot + per-chunk checksums), `fetch` (manifest, chunks with a credit window, checksum check,
copy into the receive buffer, done/ack), and then raw ZeroMQ over the same socket types (ROUTER server,
DEALER client), the same chunk frames (zero-copy sends of the same buffer) and the same credit window,
but with no msgpack header, no checksum and no copy on receipt: the ceiling the channel is measured
against. It also times, locally over the same bytes, the channel's per-chunk checksum
(`vime.protocol.weights.chunk_checksum`, the algorithm named by `CHECKSUM_ALGORITHM`, chunk by chunk as
publish and fetch compute it) and a memcpy into already-faulted memory: the per-byte work the fetcher
adds on top of raw ZeroMQ. `--reuse-buffer` runs the fetcher with `reuse_buffer=True` (each round drops
the previous result, so from the second round on the receive buffer is recycled, not allocated).

    python bench/weight_sync.py                 # 100 MB and 4 MB (demo-model size), human readable
    python bench/weight_sync.py --json          # one JSON object on stdout
    python bench/weight_sync.py --sizes-mb 100 --chunk-mb 1 --window 8 --repeats 5 --reuse-buffer
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import zmq

# Runnable as a script from anywhere: the repo root holds the `vime` package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Per-fetch info lines would drown the report; set before vime configures logging on import.
os.environ.setdefault("VIME_LOG_LEVEL", "WARNING")

MB = 1_000_000
_HIDDEN = 1024


def model_like_state(total_bytes: int, seed: int) -> list[tuple[str, Any]]:
    """bf16 tensors of about 8 MB each plus odd-sized small ones, summing to about `total_bytes`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tensors: list[tuple[str, Any]] = []
    remaining = total_bytes // 2  # bf16 elements
    layer = 0
    while remaining > 0:
        rows = min(4099, max(1, remaining // _HIDDEN))
        prefix = f"model.layers.{layer}"
        tensors.append((f"{prefix}.mlp.up_proj.weight", torch.randn(rows, _HIDDEN, generator=g).bfloat16()))
        tensors.append((f"{prefix}.input_layernorm.weight", torch.randn(_HIDDEN + 3, generator=g).bfloat16()))
        remaining -= rows * _HIDDEN + _HIDDEN + 3
        layer += 1
    return tensors


# --- child process: the trainer side ---------------------------------------------------------------


def _raw_server(router: zmq.Socket, buffer: np.ndarray, chunk: int, stop: threading.Event) -> None:
    """Answer each 8-byte chunk index with [8-byte header, zero-copy chunk frame]; nothing else."""
    while not stop.is_set():
        if not router.poll(100):
            continue
        identity, request = router.recv_multipart()
        (index,) = struct.unpack("<q", request)
        frame = buffer[index * chunk : (index + 1) * chunk]
        router.send_multipart([identity, request, frame], copy=False)


def _child(conn: Connection, chunk_bytes: int) -> None:
    import torch  # noqa: F401  (import cost stays out of the timings)

    from vime.weights import WeightPublisher

    publisher = WeightPublisher(chunk_bytes=chunk_bytes)
    states: dict[int, list[tuple[str, Any]]] = {}
    raw: tuple[zmq.Context, zmq.Socket, threading.Thread, threading.Event] | None = None
    conn.send(publisher.endpoint)
    while True:
        cmd, *args = conn.recv()
        if cmd == "publish":
            version, size = args
            state = states.setdefault(size, model_like_state(size, seed=size))
            stats = publisher.publish(version, state)
            conn.send(stats.__dict__)
        elif cmd == "raw_start":
            (size,) = args
            ctx = zmq.Context()
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.SNDHWM, 1024)
            port = router.bind_to_random_port("tcp://127.0.0.1")
            buffer = np.frombuffer(np.random.default_rng(0).bytes(size), dtype=np.uint8)
            stop = threading.Event()
            thread = threading.Thread(target=_raw_server, args=(router, buffer, chunk_bytes, stop), daemon=True)
            thread.start()
            raw = (ctx, router, thread, stop)
            conn.send(f"tcp://127.0.0.1:{port}")
        elif cmd == "raw_stop":
            assert raw is not None
            ctx, router, thread, stop = raw
            stop.set()
            thread.join()
            router.close()
            ctx.term()
            raw = None
            conn.send("ok")
        else:  # "exit"
            publisher.close()
            conn.send("bye")
            return


# --- this process: the rollout side ----------------------------------------------------------------


def raw_fetch(sock: zmq.Socket, total: int, chunk: int, window: int) -> float:
    """Pull `total` bytes as chunks with `window` requests in flight; return seconds."""
    n = -(-total // chunk)
    start = time.perf_counter()
    sent = received = 0
    while received < n:
        while sent < n and sent - received < window:
            sock.send(struct.pack("<q", sent))
            sent += 1
        sock.recv_multipart(copy=False)
        received += 1
    return time.perf_counter() - start


def local_rates(total: int, chunk: int) -> dict[str, float]:
    """Checksum and memcpy speed here, over the same number of bytes (what the fetcher adds per byte).

    The checksum is the channel's own (`chunk_checksum`), computed per `chunk` bytes as publish and fetch do.
    """
    from vime.protocol.weights import chunk_checksum

    src = np.frombuffer(np.random.default_rng(1).bytes(total), dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = src  # fault the pages in first
    t = time.perf_counter()
    dst[:] = src
    copy_s = time.perf_counter() - t
    t = time.perf_counter()
    for start in range(0, total, chunk):
        chunk_checksum(src[start : start + chunk])
    checksum_s = time.perf_counter() - t
    return {"memcpy_gbps": total / copy_s / 1e9, "checksum_gbps": total / checksum_s / 1e9}


def run(
    sizes_mb: list[float], chunk_mb: float, window: int, repeats: int, reuse_buffer: bool = False
) -> dict[str, Any]:
    from vime.protocol.weights import CHECKSUM_ALGORITHM
    from vime.weights import WeightFetcher

    chunk_bytes = int(chunk_mb * (1 << 20))
    ctx_mp = mp.get_context("spawn")
    parent, child_conn = ctx_mp.Pipe()
    child = ctx_mp.Process(target=_child, args=(child_conn, chunk_bytes), daemon=True)
    child.start()
    results: list[dict[str, Any]] = []
    try:
        endpoint = parent.recv()
        fetcher = WeightFetcher(endpoint, timeout_s=30.0, window=window, reuse_buffer=reuse_buffer)
        version = 0
        for size_mb in sizes_mb:
            size = int(size_mb * MB)
            publishes, fetches = [], []
            nbytes = 0
            for _ in range(repeats):
                version += 1
                parent.send(("publish", version, size))
                publishes.append(parent.recv())
                got = fetcher.fetch(min_version=version)
                assert got.version == version
                nbytes = got.nbytes
                fetches.append(got.seconds)
                del got
            parent.send(("raw_start", nbytes))
            raw_endpoint = parent.recv()
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 30_000)
            sock.connect(raw_endpoint)
            raw_fetch(sock, min(nbytes, chunk_bytes), chunk_bytes, window)  # connect before timing
            raws = [raw_fetch(sock, nbytes, chunk_bytes, window) for _ in range(repeats)]
            sock.close()
            ctx.term()
            parent.send(("raw_stop",))
            parent.recv()
            fetch_s = statistics.median(fetches)
            raw_s = statistics.median(raws)
            publish_s = statistics.median(p["seconds"] for p in publishes)
            results.append(
                {
                    "size_mb": size_mb,
                    "bytes": nbytes,
                    "tensors": publishes[0]["num_tensors"],
                    "chunks": publishes[0]["num_chunks"],
                    "publish_s": round(publish_s, 4),
                    "publish_copy_s": round(statistics.median(p["copy_seconds"] for p in publishes), 4),
                    "publish_checksum_s": round(statistics.median(p["checksum_seconds"] for p in publishes), 4),
                    "publish_gbps": round(nbytes / publish_s / 1e9, 3),
                    "fetch_s": round(fetch_s, 4),
                    "fetch_s_min": round(min(fetches), 4),
                    "fetch_gbps": round(nbytes / fetch_s / 1e9, 3),
                    "raw_zmq_s": round(raw_s, 4),
                    "raw_zmq_s_min": round(min(raws), 4),
                    "raw_zmq_gbps": round(nbytes / raw_s / 1e9, 3),
                    "channel_over_raw": round(raw_s / fetch_s, 3),
                    **{k: round(v, 3) for k, v in local_rates(nbytes, chunk_bytes).items()},
                }
            )
        fetcher.close()
        parent.send(("exit",))
        parent.recv()
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.terminate()
    return {
        "chunk_bytes": chunk_bytes,
        "window": window,
        "repeats": repeats,
        "reuse_buffer": reuse_buffer,
        "checksum": CHECKSUM_ALGORITHM,
        "transport": "tcp loopback, publisher in a child process",
        "cpus": os.cpu_count(),
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="100,4", help="comma-separated total sizes in MB (1e6 bytes)")
    parser.add_argument("--chunk-mb", type=float, default=4.0, help="chunk size in MiB (publisher's chunk_bytes)")
    parser.add_argument("--window", type=int, default=4, help="chunk requests in flight (fetcher's window)")
    parser.add_argument("--repeats", type=int, default=5, help="publish+fetch rounds per size; medians reported")
    parser.add_argument(
        "--reuse-buffer", action="store_true", help="fetcher recycles its receive buffer (reuse_buffer=True)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    report = run(
        [float(s) for s in args.sizes_mb.split(",")], args.chunk_mb, args.window, args.repeats, args.reuse_buffer
    )
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"chunk {report['chunk_bytes'] >> 10} KiB, window {report['window']}, {report['transport']}, "
        f"checksum {report['checksum']}, reuse_buffer {report['reuse_buffer']}"
    )
    for r in report["results"]:
        print(
            f"{r['bytes'] / MB:8.1f} MB  publish {r['publish_s']:.3f} s ({r['publish_gbps']:.2f} GB/s)  "
            f"fetch {r['fetch_s']:.3f} s ({r['fetch_gbps']:.2f} GB/s)  raw zmq {r['raw_zmq_s']:.3f} s "
            f"({r['raw_zmq_gbps']:.2f} GB/s)  channel/raw {r['channel_over_raw']:.2f}  "
            f"[local {report['checksum']} {r['checksum_gbps']:.2f} GB/s, memcpy {r['memcpy_gbps']:.2f} GB/s]"
        )


if __name__ == "__main__":
    main()
