"""The broker at scale: 1,000 simulated rollout workers, 100 reward workers and a trainer against the real
broker process, over loopback TCP (issue 18).

The broker is the real program (`python -m vime.workers.broker`, what `bin/vime-broker` runs) with a config
written into the run directory: the demo's character tokenizer (no model), a JSONL prompt set shaped
like the chosen group shape, the journal on (its default). The workers are simulated in a few client
processes (`--client-procs`), one zmq poller each, speaking the real conversation of `vime/workers/rollout.py`,
`vime/workers/reward.py` and `vime/workers/trainer.py`:

- rollout: Hello -> Welcome, Credit(`--rollout-credits`); on DispatchGroups it holds each group for its
  generation time (uniform in [0.5, 1.5] x the mean), then sends GroupsGenerated (one group, 8 samples
  whose token versions are the group's `min_weight_version`) and Credit(1); a Heartbeat every
  `--heartbeat-s` (jittered). Acks, HeartbeatAcks and WeightVersionAnnounces are received and counted.
- reward: Hello -> Welcome, Credit(`--reward-credits`); each ScoreGroups is answered after `--score-s`
  with one GroupsScored and Credit(n groups); heartbeats as above.
- trainer: WeightsPublished(v0), then per step BatchRequest(rollout_batch_size) -> TrainBatch ->
  StepDone -> Ack -> WeightsPublished(v+1) -> Ack, as rank 0 does (`--train-s` of "training" per step).

Clients must not be the bottleneck, so what can be is pre-encoded: Credits, Heartbeats, the samples of a
group (per weight version), and GroupsScored (a template with the group id spliced in); a received
DispatchGroups is read with a partial msgspec schema and each group's own msgpack bytes are sent back
with the samples appended. (With a prompt large enough to travel as its own frame, the 30b-a3b shape, the
client decodes and encodes with the real codec instead; those rates are low.) Replies are told apart by
their type tag, read from a fixed offset of the header.

Load: "full" load is a closed loop with no generation, scoring or training time: every credit comes back
as soon as its group does, so the broker (or admission) is the limit. "Half" load runs again with a mean
generation time chosen so the offered rate is half the full-load groups/s:
`rollout_workers * rollout_credits / (0.5 * full_groups_per_s)`.

Figures (over the measured window, after `--warmup-s`):
- messages/s: every message the broker received or sent (counted by the clients, both directions);
- groups/s: training groups the trainer received in TrainBatch messages;
- bytes/s: payload bytes the broker received plus sent (all frames);
- dispatch latency: for each credit a rollout worker returns (the Credit(1) after a GroupsGenerated, or
  the initial grant), from just before the client sends that Credit to when the client has received the
  DispatchGroups carrying the group for it (credits are matched to dispatched groups first-in first-out
  per worker). Measured client-side, so it includes the client's own queueing (it is an upper bound on
  the broker's part) and any time admission holds the credit back (at full load it does, by design);
- broker CPU%: (utime + stime) of the broker process from /proc over the window (100% = one core);
  client CPU% likewise, summed over the client processes, and the machine's busy share from /proc/stat,
  to say which side saturates;
- broker RSS: peak (VmHWM) and its bound, the sum of
  - the baseline: the RSS with every worker connected and nothing generated;
  - peers (rollout + reward workers + the trainer) x libzmq's steady-state memory per connected peer. A
    connection's memory in libzmq grows with the messages it has carried for the first few hundred, then
    stays flat (~62 KiB per peer with the demo's messages): a per-connection cost, not buffered data. It
    fits libzmq's pipes, which queue messages in chunks of 256 64-byte slots and keep an emptied chunk
    for reuse, touching two chunks per direction, and its per-connection batch buffers (8 KiB to send;
    8 KiB plus a 10 KiB table of message headers to receive), touched as far as the largest read or write
    has reached, so it also grows with the size of the messages. The baseline is taken before that cost
    is reached, so the bench measures it once per invocation and message size (`zmq_peer_steady_kib`): a
    ROUTER made as the broker makes its own, in a process of its own, echoes as many DEALERs as the bench
    has peers, one message in flight per peer: first one handshake-sized message (100 bytes: what the
    baseline has seen), then rounds of 100 messages per peer as large as the shape's group on the wire
    (capped at libzmq's 8 KiB batch) until two successive rounds each move its RSS by under 1 % of its
    growth so far; the growth over its RSS after the first message, divided by the peers;
  - the admission limit ((max_staleness + 1) x rollout_batch_size groups; every generated group the
    broker can hold at once) times the bytes of one decoded group.
  `--no-pipe-probe` skips the probe (~30 s per message size for 1,101 peers); the bound is then baseline +
  admission only, as `broker_rss_bound_buffer_only_mib` always is.

Correctness checked at the end of every run: the broker's `groups_lost` == 0 and `groups_trained_twice`
== 0, the trainer trained groups, no ErrorReply reached a worker, and every credit a worker granted is
accounted for (credits granted == groups dispatched to workers of that role + credits the broker still
holds).

    .venv/bin/python bench/broker_scale.py --json                       # 1,000 + 100 workers, demo and 30b-a3b shapes
    .venv/bin/python bench/broker_scale.py --quick --json               # 20 + 4 workers, demo shape, seconds
    .venv/bin/python bench/broker_scale.py --shapes demo --no-pipe-probe # without libzmq's per-peer cost in the bound
    .venv/bin/python bench/broker_scale.py --shapes demo --profile-broker runs/broker.prof
"""

from __future__ import annotations

import argparse
import collections
import functools
import heapq
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vime.broker.latency import percentile_ms  # noqa: E402
from vime.protocol.codec import INLINE_ARRAY_BYTES, PROTOCOL_VERSION, Message, decode, encode  # noqa: E402
from vime.protocol.messages import (  # noqa: E402
    BatchRequest, Credit, DispatchGroups, Group, GroupScores, GroupsGenerated, GroupsScored, Heartbeat, Hello, Sample,
    StepDone, WeightsPublished,
)

SAMPLES = 8
# As in bench/hop_bytes.py: the CPU demo's group, and a Qwen3-30B-A3B-like one with R3 routing traces.
# The demo shape's staleness bound admits (8 + 1) x 256 groups: more than the 1,000 workers' credits plus
# a batch buffered and one training, so admission (the staleness bound doing its job) does not hold
# credits back and the dispatch latency is the broker's own. With max_staleness 4 it does: see
# docs/benchmarks.md.
SHAPES: dict[str, dict[str, Any]] = {
    "demo": {"prompt": 8, "response": 4, "trace": None, "text": "579", "rollout_batch_size": 256, "max_staleness": 8},
    "30b-a3b": {"prompt": 512, "response": 3584, "trace": (48, 8), "text": "x" * 12_000, "rollout_batch_size": 32, "max_staleness": 1},
}
NUM_EXPERTS = 128
WEIGHT_ENDPOINT = "tcp://127.0.0.1:1"  # never fetched: the simulated rollout workers "load" instantly
QUIET_S = 0.3  # a client has drained when nothing arrived for this long


# --- the client side -------------------------------------------------------------------------------


class _GroupHead(msgspec.Struct):
    """The fields of a group a simulated worker needs; msgspec skips the rest (arrays included)."""

    group_id: str
    min_weight_version: int = 0


class _GroupsLite(msgspec.Struct):
    groups: list[msgspec.Raw]


class _TrainBatchLite(msgspec.Struct):
    step: int
    groups: list[_GroupHead]


_groups_lite = msgspec.msgpack.Decoder(tuple[int, _GroupsLite])
_group_head = msgspec.msgpack.Decoder(_GroupHead)
_train_batch_lite = msgspec.msgpack.Decoder(tuple[int, _TrainBatchLite])
_packb = msgspec.msgpack.encode


class _Samples(Message, tag="bench_samples"):
    """Only to have the codec encode a list of samples (its msgpack bytes are cut out of the header)."""

    samples: list[Sample]


def _array_header(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")


def message_tag(header: bytes) -> str:
    """The type tag of an encoded message, read where the codec puts it: [1, {"type": <tag>, ...}]."""
    if header[2] & 0xF0 == 0x80 and header[3:8] == b"\xa4type" and header[8] & 0xE0 == 0xA0:
        return header[9 : 9 + (header[8] & 0x1F)].decode()
    return type(decode([header])).__name__  # not the usual layout: decode it properly (slow, rare)


def make_samples(shape: dict[str, Any], version: int, seed: int = 0) -> list[Sample]:
    """A group's samples as a rollout engine returns them (R3 traces with distinct experts per row)."""
    rng = np.random.default_rng(seed)
    n = shape["response"]
    samples = []
    for i in range(SAMPLES):
        trace = None
        if shape["trace"] is not None:
            layers, top_k = shape["trace"]
            base = rng.integers(0, NUM_EXPERTS, size=(shape["prompt"] + n - 1, layers, 1), dtype=np.int64)
            trace = ((base + np.arange(top_k)) % NUM_EXPERTS).astype(np.uint8)
        samples.append(Sample(
            index=i, response_tokens=rng.integers(0, 60, n, dtype=np.int32),
            rollout_logprobs=rng.normal(-1, 0.5, n).astype(np.float32), loss_mask=np.ones(n, dtype=np.uint8),
            token_versions=np.full(n, version, dtype=np.int32), finish_reason="stop", response_text=shape["text"],
            routed_experts=trace, num_experts=NUM_EXPERTS if trace is not None else None,
        ))  # fmt: skip
    return samples


class Stats:
    """What one client process counts; only events inside the measured window count towards rates."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.groups_generated = 0
        self.groups_scored = 0
        self.groups_trained = 0
        self.steps = 0
        self.dispatch_latency_s: list[float] = []
        self.batch_wait_s: list[float] = []
        # Totals over the whole run (for the accounting checks, not rates).
        self.credits_granted = {"rollout": 0, "reward": 0}
        self.groups_received = {"rollout": 0, "reward": 0}
        self.error_replies = 0
        self.unmatched_dispatches = 0
        self.trained_total = 0


class Worker:
    def __init__(self, sock: Any, role: str, worker_id: str) -> None:
        self.sock = sock
        self.role = role
        self.worker_id = worker_id
        self.welcomed = False
        self.credit_sent_at: collections.deque[float] = collections.deque()


class Client:
    """One client process: many simulated workers, one poller, timers in a heap."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import zmq

        self.zmq = zmq
        self.spec = spec
        self.shape = SHAPES[spec["shape"]]
        self.rng = random.Random(spec["seed"])
        self.context = zmq.Context(io_threads=1)
        self.context.set(zmq.MAX_SOCKETS, 65_536)
        self.workers: dict[Any, Worker] = {}
        self.epoll = select.epoll()
        self.by_fd: dict[int, Worker] = {}
        self.to_check: set[Worker] = set()
        self.timers: list[tuple[float, int, Any, Worker, Any]] = []
        self._seq = 0
        self.stats = Stats()
        self.in_window = False
        self.originating = False
        # The slow path (real codec) when the prompt travels as its own frame.
        self.fast = self.shape["prompt"] * 4 < INLINE_ARRAY_BYTES
        self._samples_cache: dict[int, Any] = {}
        for role, key in (("rollout", "rollout_ids"), ("reward", "reward_ids"), ("trainer", "trainer_ids")):
            for worker_id in spec[key]:
                sock = self.context.socket(zmq.DEALER)
                sock.setsockopt(zmq.IDENTITY, worker_id.encode())
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.connect(spec["address"])
                worker = Worker(sock, role, worker_id)
                self.workers[sock] = worker
                fd = sock.getsockopt(zmq.FD)
                self.by_fd[fd] = worker
                self.epoll.register(fd, select.EPOLLIN)
                self.to_check.add(worker)
        self.trainer = next((w for w in self.workers.values() if w.role == "trainer"), None)
        self.trainer_state = "idle"
        self.trainer_step = 0
        self.trainer_version = 0
        self.trainer_batch_ids: list[str] = []
        self.batch_requested_at = 0.0
        # Pre-encoded messages.
        self.credit = {n: encode(Credit(n=n))[0] for n in range(1, 257)}
        rollout_stats = {k: 0.0 for k in ("busy_s", "update_s", "updates", "fetch_s", "load_s", "paused_s",
                                          "update_bytes", "tokens", "groups", "eval_groups", "groups_failed_in_rollout")}  # fmt: skip
        self.heartbeat = {
            "rollout": encode(Heartbeat(in_flight=1, stats=rollout_stats))[0],
            "reward": encode(Heartbeat(in_flight=1, stats={"groups": 0.0, "samples_failed": 0.0, "busy_s": 0.0}))[0],
            "trainer": encode(Heartbeat(weight_version=0))[0],
        }
        self.generated_prefix = (
            b"\x92\x01\x82" + _packb("type") + _packb("groups_generated") + _packb("groups") + _array_header(1)
        )
        marker = "\x00bench-group-id\x00"
        score = _packb(GroupScores(group_id=marker, rewards=[1.0] * SAMPLES, failed=[False] * SAMPLES, reasons=[None] * SAMPLES))
        self.score_pre, self.score_post = score.split(_packb(marker))
        self.scored_prefix = b"\x92\x01\x82" + _packb("type") + _packb("groups_scored") + _packb("scores")

    # -- sending ---------------------------------------------------------------------------------

    def send(self, worker: Worker, frames: Sequence[Any], copy: bool = True) -> None:
        worker.sock.send_multipart(frames, copy=copy)
        self.to_check.add(worker)
        if self.in_window:
            self.stats.sent += 1
            self.stats.bytes_sent += sum(memoryview(f).nbytes for f in frames)

    def grant(self, worker: Worker, n: int, now: float) -> None:
        self.send(worker, [self.credit[n]])
        self.stats.credits_granted[worker.role] += n
        if worker.role == "rollout":
            worker.credit_sent_at.extend([now] * n)

    def at(self, when: float, action: Any, worker: Worker, payload: Any = None) -> None:
        if not self.originating:
            return  # the run is over: what arrives while draining is counted, not worked on
        self._seq += 1
        heapq.heappush(self.timers, (when, self._seq, action, worker, payload))

    def samples_bytes(self, version: int) -> bytes:
        """The msgpack of a group's samples list whose tokens carry `version` (fast path)."""
        cached = self._samples_cache.get(version)
        if cached is None:
            header = encode(_Samples(samples=make_samples(self.shape, version)))[0]
            key = _packb("samples")
            cached = _packb("samples") + header[header.rindex(key) + len(key) :]
            self._samples_cache = {version: cached, **dict(list(self._samples_cache.items())[-4:])}
        return cached

    def samples_objects(self, version: int) -> list[Sample]:
        cached = self._samples_cache.get(version)
        if cached is None:
            cached = make_samples(self.shape, version)
            self._samples_cache = {version: cached, **dict(list(self._samples_cache.items())[-2:])}
        return cached  # type: ignore[no-any-return]

    # -- receiving -------------------------------------------------------------------------------

    def on_message(self, worker: Worker, frames: list[Any], now: float) -> None:
        header = frames[0] if isinstance(frames[0], bytes) else frames[0].bytes
        if self.in_window:
            self.stats.received += 1
            self.stats.bytes_received += sum(len(f) if isinstance(f, bytes) else f.buffer.nbytes for f in frames)
        tag = message_tag(header)
        if tag == "dispatch_groups":
            self.on_dispatch(worker, header, frames, now)
        elif tag == "score_groups":
            self.on_score_groups(worker, header, now)
        elif tag == "train_batch":
            self.on_train_batch(worker, header, now)
        elif tag == "ack":
            if worker.role == "trainer":
                self.on_trainer_ack(worker, now)
        elif tag == "welcome":
            worker.welcomed = True
        elif tag == "error":
            self.stats.error_replies += 1
            print(json.dumps({"event": "error_reply", "worker": worker.worker_id, "reply": str(decode([header]))}), file=sys.stderr)
        # heartbeat_ack, weight_version: nothing to do (the simulated engine "loads" instantly)

    def on_dispatch(self, worker: Worker, header: bytes, frames: list[Any], now: float) -> None:
        if self.fast:
            raws = _groups_lite.decode(header)[1].groups
            groups: list[Any] = [(raw, _group_head.decode(raw)) for raw in raws]
        else:
            msg = decode(frames, (DispatchGroups,))
            groups = [(g, g) for g in msg.groups]  # type: ignore[attr-defined]
        self.stats.groups_received["rollout"] += len(groups)
        for payload, head in groups:
            if worker.credit_sent_at:
                sent_at = worker.credit_sent_at.popleft()
                if self.in_window and sent_at >= self.window[0]:
                    self.stats.dispatch_latency_s.append(now - sent_at)
            else:
                self.stats.unmatched_dispatches += 1
            mean = self.spec["gen_mean_s"]
            done = now + (self.rng.uniform(0.5, 1.5) * mean if mean > 0 else 0.0)
            self.at(done, self.generated, worker, (payload, head))

    def generated(self, worker: Worker, payload: Any, now: float) -> None:
        raw_or_group, head = payload
        if self.fast:
            raw = bytes(raw_or_group)
            # The group's own map with one more key: its samples.
            body = bytes([raw[0] + 1]) + raw[1:] + self.samples_bytes(head.min_weight_version)
            self.send(worker, [self.generated_prefix + body])
        else:
            group: Group = raw_or_group
            group.samples = self.samples_objects(group.min_weight_version)
            self.send(worker, encode(GroupsGenerated(groups=[group])), copy=False)
        if self.in_window:
            self.stats.groups_generated += 1
        self.grant(worker, 1, now)

    def on_score_groups(self, worker: Worker, header: bytes, now: float) -> None:
        ids = [_group_head.decode(raw).group_id for raw in _groups_lite.decode(header)[1].groups]
        self.stats.groups_received["reward"] += len(ids)
        self.at(now + self.spec["score_s"], self.scored, worker, ids)

    def scored(self, worker: Worker, ids: list[str], now: float) -> None:
        body = b"".join(self.score_pre + _packb(g) + self.score_post for g in ids)
        self.send(worker, [self.scored_prefix + _array_header(len(ids)) + body])
        if self.in_window:
            self.stats.groups_scored += len(ids)
        self.grant(worker, len(ids), now)

    # -- the trainer ---------------------------------------------------------------------------------

    def publish(self, worker: Worker, step: int) -> None:
        self.trainer_state = "publishing"
        msg = WeightsPublished(version=self.trainer_version, endpoint=WEIGHT_ENDPOINT, step=step)
        self.send(worker, encode(msg))

    def request_batch(self, worker: Worker, now: float) -> None:
        if not self.originating:
            self.trainer_state = "stopped"
            return
        self.trainer_state = "waiting_batch"
        self.batch_requested_at = now
        msg = BatchRequest(step=self.trainer_step, n_groups=self.spec["rollout_batch_size"], policy_version=self.trainer_version)
        self.send(worker, encode(msg))

    def on_train_batch(self, worker: Worker, header: bytes, now: float) -> None:
        batch = _train_batch_lite.decode(header)[1]
        self.trainer_batch_ids = [g.group_id for g in batch.groups]
        self.stats.trained_total += len(batch.groups)
        if self.in_window:
            self.stats.groups_trained += len(batch.groups)
            self.stats.steps += 1
            self.stats.batch_wait_s.append(now - self.batch_requested_at)
        self.trainer_state = "training"
        self.at(now + self.spec["train_s"], self.step_done, worker)

    def step_done(self, worker: Worker, _: Any, now: float) -> None:
        self.trainer_state = "stepping"
        self.send(worker, encode(StepDone(step=self.trainer_step, group_ids=self.trainer_batch_ids)))

    def on_trainer_ack(self, worker: Worker, now: float) -> None:
        if self.trainer_state == "stepping":
            self.trainer_step += 1
            self.trainer_version += 1
            self.publish(worker, self.trainer_step - 1)
        elif self.trainer_state == "publishing":
            self.request_batch(worker, now)

    # -- the loop ------------------------------------------------------------------------------------

    def heartbeat_tick(self, worker: Worker, _: Any, now: float) -> None:
        if not self.originating:
            return
        self.send(worker, [self.heartbeat[worker.role]])
        self.at(now + self.spec["heartbeat_s"] * self.rng.uniform(0.9, 1.1), self.heartbeat_tick, worker)

    def pump(self, until: float | None, *, quiet_s: float | None = None) -> None:
        """Serve sockets and timers until `until` (monotonic), or until nothing arrived for `quiet_s`.

        epoll on the sockets' ZMQ_FDs rather than zmq_poll: zmq_poll looks at every one of a process's
        hundreds of sockets on every call, epoll returns the ready ones. ZMQ_FD is edge-like: a socket is
        drained until EAGAIN and ZMQ_EVENTS says nothing more, and a socket that sent is looked at again
        (sending may consume the notification of a message that arrived meanwhile)."""
        zmq = self.zmq
        last_heard = time.monotonic()
        while True:
            now = time.monotonic()
            if until is not None:
                self.in_window = self.window[0] <= now < self.window[1]
                if now >= until:
                    return
            if quiet_s is not None and now - last_heard >= quiet_s and not self.to_check:
                return
            wait = 0.0 if self.to_check else 0.05
            if self.timers and wait:
                wait = min(wait, max(0.0, self.timers[0][0] - now))
            for fd, _ in self.epoll.poll(wait):
                self.to_check.add(self.by_fd[fd])
            now = time.monotonic()
            check, self.to_check = self.to_check, set()
            for worker in check:
                sock = worker.sock
                copy = worker.role != "trainer" and self.fast
                for _ in range(64):  # a burst per socket, then the next one: fairness among workers
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
                    except zmq.Again:
                        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            continue
                        break
                    last_heard = now
                    self.on_message(worker, frames, now)
                else:
                    self.to_check.add(worker)
            while self.timers and self.timers[0][0] <= now:
                _, _, action, worker, payload = heapq.heappop(self.timers)
                action(worker, payload, now)

    def run(self) -> None:
        hello_frames = {
            w.sock: encode(Hello(role=w.role, worker_id=w.worker_id, host="bench", pid=os.getpid()))  # type: ignore[arg-type]
            for w in self.workers.values()
        }
        self.window = (float("inf"), float("inf"))
        for sock, frames in hello_frames.items():
            sock.send_multipart(frames)
        deadline = time.monotonic() + 120
        while not all(w.welcomed for w in self.workers.values()):
            if time.monotonic() > deadline:
                raise SystemExit(f"no Welcome for {sum(not w.welcomed for w in self.workers.values())} workers")
            self.pump(time.monotonic() + 0.1)
        _say({"event": "ready", "workers": len(self.workers)})
        start = float(sys.stdin.readline().split()[1])
        warmup, duration = self.spec["warmup_s"], self.spec["duration_s"]
        self.window = (start + warmup, start + warmup + duration)
        while time.monotonic() < start:
            time.sleep(0.001)
        self.originating = True
        now = time.monotonic()
        for worker in self.workers.values():
            if worker.role == "rollout":
                self.grant(worker, self.spec["rollout_credits"], now)
            elif worker.role == "reward":
                self.grant(worker, self.spec["reward_credits"], now)
            else:
                self.trainer_version = 0
                self.publish(worker, -1)
            self.at(now + self.spec["heartbeat_s"] * self.rng.uniform(0.1, 1.0), self.heartbeat_tick, worker)
        self.pump(self.window[1])
        # Stop originating work; keep receiving until the broker has nothing more to say.
        self.originating = False
        self.in_window = False
        self.timers = []
        self.window = (float("inf"), float("inf"))
        self.pump(None, quiet_s=QUIET_S)
        _say({"event": "drained"})
        sys.stdin.readline()  # "finish": the driver has the broker's status
        self.pump(None, quiet_s=QUIET_S)
        s = self.stats
        _say({"event": "result", **{k: v for k, v in vars(s).items()}})
        for sock in self.workers:
            sock.close(linger=0)
        self.epoll.close()
        self.context.term()


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# --- the driver ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_job(run_dir: Path, shape_name: str, args: argparse.Namespace, port: int) -> Path:
    """The broker's config, tokenizer and prompt set in `run_dir`; returns the config path."""
    from vime.demo.tokenizer import save_tokenizer

    shape = SHAPES[shape_name]
    save_tokenizer(run_dir / "tokenizer")
    rng = random.Random(0)
    with (run_dir / "prompts.jsonl").open("w") as f:
        for _ in range(args.prompts):
            text = "".join(rng.choice("0123456789+") for _ in range(shape["prompt"]))
            f.write(json.dumps({"prompt": text, "label": "0"}) + "\n")
    config = {
        "run_dir": str(run_dir), "hf_checkpoint": str(run_dir / "tokenizer"), "prompt_data": str(run_dir / "prompts.jsonl"),
        "num_rollout": 1_000_000, "rollout_batch_size": args.rollout_batch_size or shape["rollout_batch_size"],
        "n_samples_per_prompt": SAMPLES, "max_staleness": shape["max_staleness"] if args.max_staleness is None else args.max_staleness,
        "update_weights_interval": 1, "rollout_shuffle": False, "worker_timeout_s": 120.0,
        "broker_address": f"tcp://127.0.0.1:{port}", "journal": not args.no_journal,
    }  # fmt: skip
    path = run_dir / "broker_scale.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return float(sum(values) - idle), float(sum(values))


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


# --- libzmq's cost per connected peer ---------------------------------------------------------------

# The first message each way is the size of the handshake the bench's baseline has seen (Hello is 61 bytes,
# Welcome a few hundred); the rounds after it carry messages as large as a group on the wire, up to libzmq's
# 8 KiB receive and send batches (a larger message bypasses them). Each connection's batch buffers (8 KiB
# to send; 8 KiB plus a 10 KiB table of message headers to receive) are touched only as far as the largest
# read or write has reached, so 100-byte rounds leave part of them out: 56.5 KiB per peer at 1,101 peers,
# against 61.2-62.6 KiB (4 runs) with 1,891-byte rounds after a 100-byte first message (the demo's group).
PROBE_HANDSHAKE_BYTES = 100
PROBE_BATCH_BYTES = 8192  # libzmq's ZMQ_IN_BATCH_SIZE / ZMQ_OUT_BATCH_SIZE defaults
PROBE_ROUND_MESSAGES = 100  # messages per peer each way between two RSS readings
PROBE_MAX_MESSAGES = 2_000
PROBE_TOLERANCE = 0.01


def probe_router(address: str) -> None:
    """The probe's ROUTER, made as the broker makes its own (`make_router`): echoes every message to its
    sender until stdin closes."""
    import zmq

    from vime.transport import make_router

    context = zmq.Context()
    router = make_router(context, address)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    _say({"event": "bound"})
    while True:
        events = dict(poller.poll())
        if sys.stdin.fileno() in events:
            break  # stdin closed: the probe is over
        while True:
            try:
                router.send_multipart(router.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
    router.close(linger=0)
    context.term()


def probe_dealers(address: str, peers: int, message_bytes: int, first_bytes: int = PROBE_HANDSHAKE_BYTES) -> None:
    """The probe's peers, DEALERs as the simulated workers make them. On "round K" each sends K messages
    (the first of all `first_bytes` long, the rest `message_bytes`) and waits for their echoes, one in
    flight per peer at a time: a pipe never holds more than one message, so what the ROUTER's RSS gains is
    what a connection costs, not queued data."""
    import zmq

    context = zmq.Context(io_threads=1)
    context.set(zmq.MAX_SOCKETS, 65_536)
    sockets = []
    for i in range(peers):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"probe-{i}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 60_000)  # a stuck ROUTER ends the probe (zmq.Again) instead of hanging it
        sock.connect(address)
        sockets.append(sock)
    payload, first = b"x" * message_bytes, b"x" * first_bytes
    sent = 0
    _say({"event": "connected"})
    for line in sys.stdin:
        for _ in range(int(line.split()[1])):
            for sock in sockets:
                sock.send(first if sent == 0 else payload)
            sent += 1
            for sock in sockets:
                sock.recv()
        _say({"event": "round_done"})
    for sock in sockets:
        sock.close(linger=0)
    context.term()


def probe_message_bytes(shape_name: str) -> int:
    """The size of the probe's messages after the first for a shape: its group on the wire, up to libzmq's
    batch size (`PROBE_BATCH_BYTES`)."""
    return min(group_bytes(shape_name), PROBE_BATCH_BYTES)


def zmq_peer_steady_kib(peers: int, message_bytes: int, first_bytes: int = PROBE_HANDSHAKE_BYTES) -> dict[str, Any]:
    """libzmq's memory per connected peer once its pipes and batch buffers have reached steady state, in
    a ROUTER process of its own with `peers` DEALERs: the ROUTER's RSS after one handshake-sized message
    per peer each way (what the bench's baseline sees), then after rounds of `PROBE_ROUND_MESSAGES` more
    of `message_bytes` until two successive rounds each change it by under `PROBE_TOLERANCE` of its
    growth so far; that growth divided by `peers`."""
    started = time.monotonic()
    address = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))

    def spawn(*argv: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, __file__, *argv], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip

    router = spawn("--probe-router", address)
    procs = [router]
    try:
        _expect(router, "bound", timeout_s=60)
        spec = {"address": address, "peers": peers, "message_bytes": message_bytes, "first_bytes": first_bytes}
        dealers = spawn("--probe-dealers", json.dumps(spec))
        procs.append(dealers)
        _expect(dealers, "connected", timeout_s=120)

        def exchange(messages_per_peer: int) -> int:
            dealers.stdin.write(f"round {messages_per_peer}\n")  # type: ignore[union-attr]
            dealers.stdin.flush()  # type: ignore[union-attr]
            _expect(dealers, "round_done", timeout_s=300)
            return proc_status_kib(router.pid, "VmRSS")

        readings = [(1, exchange(1))]
        plateaued = False
        while readings[-1][0] < PROBE_MAX_MESSAGES and not plateaued:
            readings.append((readings[-1][0] + PROBE_ROUND_MESSAGES, exchange(PROBE_ROUND_MESSAGES)))
            # Flat: the last two rounds each moved it by under 1 % of its growth so far. (1 % of the whole
            # RSS would stop too early with few peers: their growth is a small share of the process.)
            last = [rss for _, rss in readings[-3:]]
            grown = readings[-1][1] - readings[0][1]
            plateaued = len(last) == 3 and all(abs(b - a) < PROBE_TOLERANCE * grown for a, b in zip(last, last[1:]))
    finally:
        for proc in procs:  # the ROUTER first: its peers leaving would only make it log disconnects
            proc.stdin.close()  # type: ignore[union-attr]
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    baseline_kib, steady_kib = readings[0][1], max(rss for _, rss in readings)
    return {
        "peers": peers,
        "message_bytes": message_bytes,
        "first_message_bytes": first_bytes,
        "zmq_peer_steady_kib": round(max(0, steady_kib - baseline_kib) / peers, 1),
        "router_baseline_rss_mib": round(baseline_kib / 1024, 1),
        "router_steady_rss_mib": round(steady_kib / 1024, 1),
        "messages_per_peer": readings[-1][0],
        "rss_mib_by_messages_per_peer": {n: round(rss / 1024, 1) for n, rss in readings},
        "plateaued": plateaued,
        "seconds": round(time.monotonic() - started, 1),
    }


def run_point(args: argparse.Namespace, shape_name: str, load: str, gen_mean_s: float) -> dict[str, Any]:
    """One broker, one set of clients, one load; returns the figures and the checks."""
    from vime.broker.client import query_status

    shape = SHAPES[shape_name]
    root = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="vime-broker-scale-"))
    run_dir = root / f"{shape_name}-{load}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    port = free_port()
    config = write_job(run_dir, shape_name, args, port)
    address = f"tcp://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    env.setdefault("VIME_LOG_LEVEL", "INFO")
    if args.profile_broker:
        env["VIME_BROKER_PROFILE"] = str(Path(args.profile_broker).resolve().with_suffix(f".{shape_name}-{load}.prof"))
    broker_log = (run_dir / "broker.log").open("wb")
    broker = subprocess.Popen([sys.executable, "-m", "vime.workers.broker", "--config", str(config)], cwd=REPO, env=env,
                              stdout=broker_log, stderr=subprocess.STDOUT)  # fmt: skip
    clients: list[subprocess.Popen[str]] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                query_status(address, timeout_s=1.0)
                break
            except TimeoutError:
                if broker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the broker did not start:\n{(run_dir / 'broker.log').read_text()[-3000:]}") from None
        rollout_ids = [f"rollout-{i}" for i in range(args.rollout_workers)]
        reward_ids = [f"reward-{i}" for i in range(args.reward_workers)]
        procs = max(1, args.client_procs)
        rbs = args.rollout_batch_size or shape["rollout_batch_size"]
        for p in range(procs):
            spec = {
                "address": address, "shape": shape_name, "seed": p, "rollout_ids": rollout_ids[p::procs],
                "reward_ids": reward_ids[p::procs], "trainer_ids": ["trainer-0"] if p == 0 else [],
                "rollout_credits": args.rollout_credits, "reward_credits": args.reward_credits, "gen_mean_s": gen_mean_s,
                "score_s": args.score_s if load == "half" else 0.0, "train_s": args.train_s if load == "half" else 0.0,
                "rollout_batch_size": rbs, "heartbeat_s": args.heartbeat_s, "warmup_s": args.warmup_s,
                "duration_s": args.duration_s,
            }  # fmt: skip
            clients.append(subprocess.Popen([sys.executable, __file__, "--client", json.dumps(spec)], cwd=REPO, env=env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))  # fmt: skip
        for c in clients:
            _expect(c, "ready")
        baseline_rss_kib = proc_status_kib(broker.pid, "VmRSS")
        start = time.monotonic() + 0.2
        for c in clients:
            c.stdin.write(f"go {start}\n")  # type: ignore[union-attr]
            c.stdin.flush()  # type: ignore[union-attr]
        window = (start + args.warmup_s, start + args.warmup_s + args.duration_s)
        time.sleep(max(0.0, window[0] - time.monotonic()))
        cpu0 = proc_cpu_s(broker.pid)
        ccpu0 = sum(proc_cpu_s(c.pid) for c in clients)
        busy0 = machine_busy()
        latency0 = query_status(address, timeout_s=60.0)["dispatch_latency"]["counts"]
        time.sleep(max(0.0, (window[0] + window[1]) / 2 - time.monotonic()))
        mid_rss_kib = proc_status_kib(broker.pid, "VmRSS")
        time.sleep(max(0.0, window[1] - time.monotonic()))
        cpu1 = proc_cpu_s(broker.pid)
        ccpu1 = sum(proc_cpu_s(c.pid) for c in clients)
        busy1 = machine_busy()
        latency1 = query_status(address, timeout_s=60.0)["dispatch_latency"]["counts"]
        end_rss_kib = proc_status_kib(broker.pid, "VmRSS")
        for c in clients:
            _expect(c, "drained", timeout_s=120)
        status = settled_status(address)
        for c in clients:
            c.stdin.write("finish\n")  # type: ignore[union-attr]
            c.stdin.flush()  # type: ignore[union-attr]
        results = [_expect(c, "result", timeout_s=60) for c in clients]
        peak_rss_kib = proc_status_kib(broker.pid, "VmHWM")
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
            c.wait()
        if broker.poll() is None:
            broker.send_signal(signal.SIGTERM)
            try:
                broker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                broker.kill()
                broker.wait()
        broker_log.close()
    return summarize(args, shape_name, load, gen_mean_s, results, status, {
        "broker_cpu_pct": 100.0 * (cpu1 - cpu0) / args.duration_s,
        "clients_cpu_pct": 100.0 * (ccpu1 - ccpu0) / args.duration_s,
        "machine_busy_pct": 100.0 * (busy1[0] - busy0[0]) / max(1.0, busy1[1] - busy0[1]),
        "baseline_rss_kib": baseline_rss_kib, "peak_rss_kib": peak_rss_kib, "mid_rss_kib": mid_rss_kib,
        "end_rss_kib": end_rss_kib, "latency_counts": (latency0, latency1), "run_dir": str(run_dir),
    })  # fmt: skip


def settled_status(address: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """The broker's status once it has worked off its backlog: a StatusRequest comes on its own connection,
    which the ROUTER may serve before messages still queued from the workers, so ask until four answers
    half a second apart agree on the counters, queues and credits."""
    from vime.broker.client import query_status

    def key(status: dict[str, Any]) -> Any:
        credits = sorted((w["worker_id"], w["credits"], w["leased"]) for w in status["workers"])
        return status["counters"], status["queues"], credits

    deadline = time.monotonic() + timeout_s
    status = query_status(address, timeout_s=60.0)
    same = 0
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = query_status(address, timeout_s=60.0)
        same = same + 1 if key(again) == key(status) else 0
        status = again
        if same >= 3:  # a broker stalled in a journal compaction answers late, not differently: ask thrice
            return status
    raise RuntimeError("the broker's status did not settle")


def _expect(client: subprocess.Popen[str], event: str, timeout_s: float = 180.0) -> dict[str, Any]:
    """The client's next line, which must be `event` (a client that died or said otherwise: RuntimeError)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([client.stdout], [], [], 0.5)
        if ready:
            line = client.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            obj = json.loads(line)
            if obj.get("event") == event:
                return obj  # type: ignore[no-any-return]
            raise RuntimeError(f"client said {obj}, expected {event}")
        if client.poll() is not None:
            break
    raise RuntimeError(f"client {client.pid} did not say {event} (exit code {client.poll()})")


def _generated_frames(shape_name: str, group_id: str = "e0-p0") -> list[Any]:
    shape = SHAPES[shape_name]
    prompt = np.zeros(shape["prompt"], dtype=np.int32)
    group = Group(group_id=group_id, prompt_index=0, epoch=0, prompt_tokens=prompt, prompt_text="0" * shape["prompt"],
                  n_samples=SAMPLES, label="0", samples=make_samples(shape, 0))  # fmt: skip
    return encode(GroupsGenerated(groups=[group]))


def group_bytes(shape_name: str) -> int:
    """Bytes of one generated group as the broker receives it (GroupsGenerated)."""
    return sum(memoryview(f).nbytes for f in _generated_frames(shape_name))


@functools.cache
def group_decoded_bytes(shape_name: str, copies: int = 200) -> int:
    """Bytes one generated group holds once the broker has decoded it (its Python objects and the
    received frames its arrays view), measured with tracemalloc over `copies` groups."""
    import tracemalloc

    received = [[bytes(memoryview(f)) for f in _generated_frames(shape_name, f"e0-p{i}")] for i in range(copies)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        decoded = [decode(frames, (GroupsGenerated,)) for frames in received]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del decoded
    wire = sum(len(f) for f in received[0])
    return held // copies + wire  # the frames stay alive while the arrays view them


def summarize(
    args: argparse.Namespace, shape_name: str, load: str, gen_mean_s: float, results: list[dict[str, Any]],
    status: dict[str, Any], measured: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    d = args.duration_s
    total = lambda key: sum(r[key] for r in results)  # noqa: E731
    latencies = [x for r in results for x in r["dispatch_latency_s"]]
    waits = [x for r in results for x in r["batch_wait_s"]]
    held_credits = {"rollout": 0, "reward": 0}
    for w in status["workers"]:
        if w["role"] in held_credits:
            held_credits[w["role"]] += w["credits"]
    granted = {role: sum(r["credits_granted"][role] for r in results) for role in held_credits}
    received = {role: sum(r["groups_received"][role] for r in results) for role in held_credits}
    shape = SHAPES[shape_name]
    rbs = args.rollout_batch_size or shape["rollout_batch_size"]
    staleness = shape["max_staleness"] if args.max_staleness is None else args.max_staleness
    gbytes = group_bytes(shape_name)
    decoded_bytes = group_decoded_bytes(shape_name)
    buffer_only_bound_kib = measured["baseline_rss_kib"] + (staleness + 1) * rbs * decoded_bytes // 1024
    peers = args.rollout_workers + args.reward_workers + 1  # and the trainer
    peer_kib = args.zmq_peer_steady_kib.get(shape_name)
    rss_bound_kib = buffer_only_bound_kib + (0 if peer_kib is None else peers * peer_kib)
    broker_latency = [b - a for a, b in zip(measured["latency_counts"][0], measured["latency_counts"][1])]
    checks = {
        "groups_lost_zero": status["groups_lost"] == 0,
        "trained_twice_zero": status["groups_trained_twice"] == 0,
        "groups_trained": status["counters"]["groups_trained"] > 0,
        "no_error_replies": total("error_replies") == 0,
        "credits_accounted": all(granted[r] == received[r] + held_credits[r] for r in held_credits),
        "dispatches_matched_credits": total("unmatched_dispatches") == 0,
    }
    return {
        "shape": shape_name,
        "load": load,
        "rollout_workers": args.rollout_workers,
        "reward_workers": args.reward_workers,
        "gen_mean_s": round(gen_mean_s, 4),
        "messages_per_s": round((total("sent") + total("received")) / d, 1),
        "groups_per_s": round(total("groups_trained") / d, 1),
        "groups_generated_per_s": round(total("groups_generated") / d, 1),
        "bytes_per_s": round((total("bytes_sent") + total("bytes_received")) / d, 1),
        "steps_per_s": round(total("steps") / d, 3),
        "dispatch_p50_ms": _ms(percentile(latencies, 50)),
        "dispatch_p99_ms": _ms(percentile(latencies, 99)),
        "dispatch_samples": len(latencies),
        "broker_dispatch_p50_ms": percentile_ms(broker_latency, 0.50),
        "broker_dispatch_p99_ms": percentile_ms(broker_latency, 0.99),
        "broker_dispatch_samples": sum(broker_latency),
        "batch_wait_p50_ms": _ms(percentile(waits, 50)),
        "broker_cpu_pct": round(measured["broker_cpu_pct"], 1),
        "clients_cpu_pct": round(measured["clients_cpu_pct"], 1),
        "machine_busy_pct": round(measured["machine_busy_pct"], 1),
        "broker_peak_rss_mib": round(measured["peak_rss_kib"] / 1024, 1),
        "broker_baseline_rss_mib": round(measured["baseline_rss_kib"] / 1024, 1),
        "broker_rss_bound_mib": round(rss_bound_kib / 1024, 1),
        "broker_rss_bound_buffer_only_mib": round(buffer_only_bound_kib / 1024, 1),
        "zmq_peer_steady_kib": peer_kib,
        "zmq_peers": peers,
        "rss_within_bound": measured["peak_rss_kib"] <= rss_bound_kib,
        "broker_rss_growth_second_half_mib": round((measured["end_rss_kib"] - measured["mid_rss_kib"]) / 1024, 1),
        "group_bytes": gbytes,
        "group_decoded_bytes": decoded_bytes,
        "admission_groups": (staleness + 1) * rbs,
        "rollout_batch_size": rbs,
        "groups_lost": status["groups_lost"],
        "groups_trained_total": status["counters"]["groups_trained"],
        "credits": {r: {"granted": granted[r], "dispatched": received[r], "held_by_broker": held_credits[r]} for r in held_credits},
        "counters": {k: status["counters"][k] for k in ("groups_admitted", "groups_trained", "groups_dropped_stale",
                                                         "late_results_dropped", "bad_messages", "groups_requeued")},  # fmt: skip
        "checks": checks,
        "ok": all(checks.values()),
        "run_dir": measured["run_dir"],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def run_shape(args: argparse.Namespace, shape_name: str) -> list[dict[str, Any]]:
    full = run_point(args, shape_name, "full", 0.0)
    _print_row(full)
    rate = max(full["groups_per_s"] or full["groups_generated_per_s"], 1.0)
    gen_mean = args.rollout_workers * args.rollout_credits / (0.5 * rate)
    half = run_point(args, shape_name, "half", gen_mean)
    _print_row(half)
    return [full, half]


HEADER = (f"{'shape':8} {'load':5} {'msgs/s':>9} {'groups/s':>9} {'MB/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'client p99':>10} {'broker%':>8} {'clients%':>9} {'busy%':>6} {'RSS MiB':>8} {'bound':>8} {'+2nd half':>9} ok")  # fmt: skip


def _print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['shape']:8} {r['load']:5} {r['messages_per_s']:>9,.0f} {r['groups_per_s']:>9,.1f} {r['bytes_per_s'] / 1e6:>8,.1f} "
        f"{r['broker_dispatch_p50_ms'] or 0:>8.2f} {r['broker_dispatch_p99_ms'] or 0:>8.2f} {r['dispatch_p99_ms'] or 0:>10.2f} "
        f"{r['broker_cpu_pct']:>8.1f} {r['clients_cpu_pct']:>9.1f} {r['machine_busy_pct']:>6.1f} {r['broker_peak_rss_mib']:>8.1f} "
        f"{r['broker_rss_bound_mib']:>8.1f} {r['broker_rss_growth_second_half_mib']:>9.1f} {'yes' if r['ok'] else 'NO ' + str([k for k, v in r['checks'].items() if not v])}",
        flush=True,
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))  # fmt: skip
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--quick", action="store_true", help="20 rollout + 4 reward workers, demo shape, ~1 s windows")
    p.add_argument("--shapes", default="demo,30b-a3b", help="comma-separated: demo, 30b-a3b")
    p.add_argument("--rollout-workers", type=int, default=1000)
    p.add_argument("--reward-workers", type=int, default=100)
    p.add_argument("--rollout-credits", type=int, default=1, help="credits per rollout worker (rollout_concurrency)")
    p.add_argument("--reward-credits", type=int, default=8, help="credits per reward worker (reward_concurrency)")
    p.add_argument("--score-s", type=float, default=0.005, help="scoring time per ScoreGroups at half load")
    p.add_argument("--train-s", type=float, default=0.0, help="training time per step at half load (the trainer is not what is measured)")
    p.add_argument("--heartbeat-s", type=float, default=2.0)
    p.add_argument("--rollout-batch-size", type=int, default=None, help="default per shape (demo 256, 30b-a3b 32)")
    p.add_argument("--max-staleness", type=int, default=None, help="default per shape (demo 4, 30b-a3b 1)")
    p.add_argument("--prompts", type=int, default=4096)
    p.add_argument("--client-procs", type=int, default=2, help="client processes the workers are spread over")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--duration-s", type=float, default=10.0, help="measured window per load point")
    p.add_argument("--no-journal", action="store_true", help="run the broker without its journal (for comparison)")
    p.add_argument("--run-dir", default=None, help="default: a temporary directory")
    p.add_argument("--profile-broker", default=None, help="cProfile the broker's loop into PATH.<shape>-<load>.prof")
    p.add_argument("--no-pipe-probe", action="store_true",
                   help="skip measuring libzmq's per-peer cost: the RSS bound then counts buffered groups only")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)
    p.add_argument("--probe-router", default=None, help=argparse.SUPPRESS)
    p.add_argument("--probe-dealers", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.client is not None:
        Client(json.loads(args.client)).run()
        return {}
    if args.probe_router is not None:
        probe_router(args.probe_router)
        return {}
    if args.probe_dealers is not None:
        probe_dealers(**json.loads(args.probe_dealers))
        return {}
    if args.quick:
        args.rollout_workers, args.reward_workers = min(args.rollout_workers, 20), min(args.reward_workers, 4)
        args.shapes, args.warmup_s, args.duration_s = "demo", 0.5, 1.0
        args.rollout_batch_size = args.rollout_batch_size or 16
        args.client_procs = 1
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")  # fmt: skip
    print(f"broker scale: {args.rollout_workers} rollout + {args.reward_workers} reward workers, {args.client_procs} client "
          f"processes, {os.cpu_count()} CPUs ({cpu}), window {args.duration_s} s after {args.warmup_s} s")  # fmt: skip
    peers = args.rollout_workers + args.reward_workers + 1
    shapes = [name.strip() for name in args.shapes.split(",")]
    # One probe per message size the shapes need (the demo's 1,891 bytes; 30b-a3b's groups fill the 8 KiB batch).
    by_size: dict[int, dict[str, Any]] = {}
    probes: dict[str, dict[str, Any]] = {}
    if args.no_pipe_probe:
        print("zmq pipe probe skipped (--no-pipe-probe): the RSS bound is baseline + admission limit x decoded group "
              "only, without libzmq's steady-state cost per peer")  # fmt: skip
    for name in [] if args.no_pipe_probe else shapes:
        size = probe_message_bytes(name)
        if size not in by_size:
            probe = by_size[size] = zmq_peer_steady_kib(peers, size)
            print(f"zmq pipe probe: {probe['zmq_peer_steady_kib']} KiB per peer at steady state ({peers} peers, "
                  f"{probe['first_message_bytes']}-byte then {size}-byte messages: ROUTER RSS {probe['router_baseline_rss_mib']} -> "
                  f"{probe['router_steady_rss_mib']} MiB over {probe['messages_per_peer']} messages per peer each way, "
                  f"{'flat' if probe['plateaued'] else 'NOT flat'}; {probe['seconds']} s)")  # fmt: skip
        probes[name] = by_size[size]
    args.zmq_peer_steady_kib = {name: probe["zmq_peer_steady_kib"] for name, probe in probes.items()}
    print(HEADER)
    points = [p for name in shapes for p in run_shape(args, name)]
    demo = [p for p in points if p["shape"] == points[0]["shape"]]
    by_load = {p["load"]: p for p in demo}
    summary = {
        "rollout_workers": args.rollout_workers,
        "reward_workers": args.reward_workers,
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "messages_per_s": by_load["full"]["messages_per_s"],
        "groups_per_s": by_load["full"]["groups_per_s"],
        # The broker's own figure (credit received -> group sent, measured in the broker), and the
        # simulated workers' (credit sent -> group received: adds the clients' queueing and loopback).
        "p50_dispatch_ms_half_load": by_load["half"]["broker_dispatch_p50_ms"],
        "p99_dispatch_ms_half_load": by_load["half"]["broker_dispatch_p99_ms"],
        "p50_dispatch_ms_full_load": by_load["full"]["broker_dispatch_p50_ms"],
        "p99_dispatch_ms_full_load": by_load["full"]["broker_dispatch_p99_ms"],
        "client_p50_dispatch_ms_half_load": by_load["half"]["dispatch_p50_ms"],
        "client_p99_dispatch_ms_half_load": by_load["half"]["dispatch_p99_ms"],
        "client_p99_dispatch_ms_full_load": by_load["full"]["dispatch_p99_ms"],
        "broker_cpu_pct_full_load": by_load["full"]["broker_cpu_pct"],
        "broker_peak_rss_mib": max(p["broker_peak_rss_mib"] for p in points),
        "rss_within_bound": all(p["rss_within_bound"] for p in points),
        "broker_rss_growth_second_half_mib": max(p["broker_rss_growth_second_half_mib"] for p in points),
        "zmq_peer_steady_kib": args.zmq_peer_steady_kib.get(shapes[0]),
        "zmq_pipe_probe": probes.get(shapes[0]),
        "zmq_pipe_probes": probes,
        "groups_lost": sum(p["groups_lost"] for p in points),
        "groups_trained": sum(p["groups_trained_total"] for p in points),
        "ok": all(p["ok"] for p in points),
        "points": points,
    }
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
