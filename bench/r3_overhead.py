"""R3 wire overhead: bytes per sample and broker throughput with routing traces, vs without.

Traces are shaped like Qwen3-30B-A3B rollouts (48 MoE layers, top-8 of 128 experts, uint8 ids) on
4096-token samples (512 prompt + 3584 response tokens, trace [4095, 48, 8]); groups of 8 samples, one
group per `GroupsGenerated` message, as a rollout worker sends them.

Measured:
- encoded bytes per sample (all frames of `vime.protocol.codec.encode`);
- per-message CPU costs in this process: encode, decode + validate (what the broker does on receipt,
  including `validate_trace` for every sample), and `validate_trace` alone;
- broker-path throughput (samples/s): a DEALER thread sends pre-encoded `GroupsGenerated` over tcp
  loopback to a ROUTER (main thread) that decodes and validates each message exactly as
  `BrokerServer._handle` does, re-encodes the groups as a `TrainBatch` (as the broker does when it
  forwards groups) and sends them to a second DEALER thread that drains them (both threads spend
  their time in libzmq with the GIL released). This is the broker's
  per-group work without its buffering logic;
- compression of one trace, only with codecs already installed (the stdlib's zlib and lzma always are;
  zstandard / lz4 are used if importable, never installed by this script), on uniform-random routes and
  on skewed ones (per-layer expert popularity, as trained routers have), to see whether it would pay.

    python bench/r3_overhead.py --json
"""

from __future__ import annotations

import argparse
import json
import threading
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vime.protocol.codec import decode, encode  # noqa: E402
from vime.protocol.messages import Group, GroupsGenerated, Sample, TrainBatch  # noqa: E402
from vime.r3.trace import validate_trace  # noqa: E402

LAYERS, TOP_K, EXPERTS = 48, 8, 128


def make_trace(rng: np.random.Generator, rows: int, skewed: bool) -> np.ndarray:
    """[rows, 48, 8] uint8 routes: top-8 of (per-layer expert bias + per-token noise), score order."""
    bias = rng.gumbel(size=(1, LAYERS, EXPERTS)) * (1.5 if skewed else 0.0)
    scores = bias + rng.gumbel(size=(rows, LAYERS, EXPERTS)).astype(np.float32)
    top = np.argpartition(-scores, TOP_K, axis=-1)[..., :TOP_K]
    order = np.argsort(-np.take_along_axis(scores, top, -1), axis=-1)
    return np.ascontiguousarray(np.take_along_axis(top, order, -1), dtype=np.uint8)


def make_group(i: int, traces: bool, prompt: int, response: int, n: int, trace: np.ndarray | None) -> Group:
    rng = np.random.default_rng(i)
    samples = [
        Sample(
            index=j, response_tokens=rng.integers(0, 150_000, response, dtype=np.int32),
            rollout_logprobs=-rng.random(response, dtype=np.float32), loss_mask=np.ones(response, np.uint8),
            token_versions=np.full(response, 3, np.int32), finish_reason="stop", response_text="x" * 4 * response,
            reward=1.0, routed_experts=trace if traces else None, num_experts=EXPERTS if traces else None,
        )  # fmt: skip
        for j in range(n)
    ]
    return Group(group_id=f"g{i}", prompt_index=i, epoch=0, prompt_tokens=np.ones(prompt, np.int32),
                 prompt_text="p" * 4 * prompt, n_samples=n, samples=samples)  # fmt: skip


def _nbytes(frames: list[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def _timeit(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def _sender(ctx: zmq.Context, endpoint: str, frames: list[bytes], count: int) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(endpoint)
    for _ in range(count):
        sock.send_multipart(frames, copy=False)
    sock.recv()  # the broker says when it is done, so no message is dropped on close
    sock.close(linger=0)


def _sink(ctx: zmq.Context, endpoint: str, count: int) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 4)
    sock.connect(endpoint)
    sock.send(b"sink")
    for _ in range(count):
        sock.recv_multipart(copy=False)
    sock.send(b"done")
    sock.close(linger=0)


def broker_throughput(group: Group, count: int) -> dict[str, float]:
    """Samples/s through decode+validate -> re-encode -> send over tcp loopback (see docstring)."""
    frames = [bytes(memoryview(f)) for f in encode(GroupsGenerated(groups=[group]))]
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 4)
    router.setsockopt(zmq.RCVHWM, 4)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # block at the sink's HWM instead of dropping (as the broker)
    router.setsockopt(zmq.RCVTIMEO, 60_000)  # fail rather than hang
    port = router.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    sink = threading.Thread(target=_sink, args=(ctx, endpoint, count), daemon=True)
    sink.start()
    sink_id, _ = router.recv_multipart()
    sender = threading.Thread(target=_sender, args=(ctx, endpoint, frames, count), daemon=True)
    sender.start()
    start = None
    nbytes = 0
    for step in range(count):
        msg = router.recv_multipart(copy=False)
        if start is None:
            start = time.perf_counter()  # from the first arrival: process start-up is not counted
        sender_id, payload = msg[0].bytes, msg[1:]
        nbytes += sum(f.buffer.nbytes for f in payload)
        received = decode(payload, (GroupsGenerated,))
        router.send_multipart([sink_id, *encode(TrainBatch(step=step, groups=received.groups))], copy=False)
    router.recv_multipart()  # the sink got everything
    elapsed = time.perf_counter() - start  # type: ignore[operator]
    router.send_multipart([sender_id, b"done"])
    sender.join(10)
    sink.join(10)
    router.close(linger=0)
    ctx.term()
    # the first message is in flight before the clock starts: count the other count - 1
    samples = (count - 1) * group.n_samples
    return {"samples_per_s": samples / elapsed, "groups": count, "seconds": elapsed,
            "mb_per_s": nbytes * (count - 1) / count / elapsed / 1e6}  # fmt: skip


def compression(trace: np.ndarray) -> dict[str, Any]:
    import lzma
    import zlib

    codecs: dict[str, Any] = {
        "zlib-1": (lambda b: zlib.compress(b, 1), zlib.decompress),
        "lzma-0": (lambda b: lzma.compress(b, preset=0), lzma.decompress),
    }
    try:
        import zstandard  # type: ignore[import-not-found]

        codecs["zstd-3"] = (zstandard.ZstdCompressor(level=3).compress, zstandard.ZstdDecompressor().decompress)
    except ImportError:
        pass
    try:
        import lz4.frame  # type: ignore[import-not-found]

        codecs["lz4"] = (lz4.frame.compress, lz4.frame.decompress)
    except ImportError:
        pass
    raw = trace.tobytes()
    out = {}
    for name, (comp, decomp) in codecs.items():
        packed = comp(raw)
        t_c = _timeit(lambda: comp(raw), 2)
        t_d = _timeit(lambda: decomp(packed), 2)
        out[name] = {"ratio": round(len(packed) / len(raw), 3), "compress_mb_s": round(len(raw) / t_c / 1e6, 1),
                     "decompress_mb_s": round(len(raw) / t_d / 1e6, 1)}  # fmt: skip
    return out


def run(prompt: int, response: int, n: int, groups_traced: int, groups_plain: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    rows = prompt + response - 1
    uniform = make_trace(rng, rows, skewed=False)
    skewed = make_trace(rng, rows, skewed=True)
    result: dict[str, Any] = {
        "shape": {"tokens": prompt + response, "prompt": prompt, "response": response, "samples_per_group": n,
                  "trace": [rows, LAYERS, TOP_K], "num_experts": EXPERTS, "trace_dtype": str(skewed.dtype)},
    }  # fmt: skip
    for name, traces, count in (("no_traces", False, groups_plain), ("traces", True, groups_traced)):
        group = make_group(0, traces, prompt, response, n, skewed)
        msg = GroupsGenerated(groups=[group])
        frames = [bytes(memoryview(f)) for f in encode(msg)]
        per = {
            "bytes_per_sample": _nbytes(frames) / n,
            "encode_ms_per_group": 1e3 * _timeit(lambda: encode(msg), 5),
            "decode_validate_ms_per_group": 1e3 * _timeit(lambda: decode(frames, (GroupsGenerated,)), 5),
        }
        if traces:
            per["validate_trace_ms_per_sample"] = 1e3 * _timeit(lambda: validate_trace(skewed, rows + 1, EXPERTS), 5)
        per["broker"] = broker_throughput(group, count)
        result[name] = per
    a, b = result["no_traces"], result["traces"]
    result["bytes_ratio"] = b["bytes_per_sample"] / a["bytes_per_sample"]
    result["throughput_ratio"] = b["broker"]["samples_per_s"] / a["broker"]["samples_per_s"]
    result["compression"] = {"uniform": compression(uniform), "skewed": compression(skewed)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=3584)
    parser.add_argument("--samples-per-group", type=int, default=8)
    parser.add_argument("--groups-traced", type=int, default=40)
    parser.add_argument("--groups-plain", type=int, default=200)
    args = parser.parse_args()
    r = run(args.prompt, args.response, args.samples_per_group, args.groups_traced, args.groups_plain)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"sample: {r['shape']['tokens']} tokens, trace {r['shape']['trace']} {r['shape']['trace_dtype']}")
    for name in ("no_traces", "traces"):
        m = r[name]
        print(f"  {name:9s}  {m['bytes_per_sample'] / 1e6:7.3f} MB/sample  "
              f"encode {m['encode_ms_per_group']:6.2f} ms/group"
              f"  decode+validate {m['decode_validate_ms_per_group']:7.2f} ms/group  broker "
              f"{m['broker']['samples_per_s']:8.1f} samples/s ({m['broker']['mb_per_s']:.0f} MB/s in)")
    print(f"  traces: x{r['bytes_ratio']:.1f} bytes, x{r['throughput_ratio']:.3f} throughput; "
          f"validate_trace {r['traces']['validate_trace_ms_per_sample']:.2f} ms/sample")
    for kind, codecs in r["compression"].items():
        print(f"  compression ({kind} routes): " + ", ".join(
            f"{k} ratio {v['ratio']} ({v['compress_mb_s']} / {v['decompress_mb_s']} MB/s)" for k, v in codecs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
