"""The broker process's socket loop around `BrokerState`.

One ROUTER socket serves every worker and status client. Each incoming message is decoded and
validated (`vime.protocol.codec`); anything malformed, oversized, unknown or unexpected for the
sender's role gets an `ErrorReply`, is counted, and changes no state; it is logged as `bad_message`
(rate-limited by `vime.broker.bad_messages`: a few lines per error code per interval, then one
`bad_message_suppressed` line with the count). After each event
the loop runs dispatch, scoring hand-off and batch filling, then sends what the state produced.
The loop also expires silent workers (their leased groups are re-queued), sends finished eval runs
to the trainer, warns when a dynamic sampling filter keeps dropping every group (training cannot
progress then), and writes a status snapshot to the run directory for `vime status` when the broker
is not reachable; the same snapshot is what Prometheus scrapes (`vime.broker.prometheus`).

`VIME_BROKER_PROFILE=PATH` runs the loop under cProfile and writes its stats to PATH when it stops
(`bench/broker_scale.py --profile-broker`): where a loaded broker's one thread spends its time.

With a journal (`vime.broker.journal`) the records a state change produced are written before any
message is sent (write-ahead), and the journal is compacted when it outgrows `compact_bytes`.
A message from a peer the broker does not know (it restarted since the peer said Hello) is answered
with ErrorReply `unknown_peer`, which makes the worker say Hello again and carry on.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from vime.broker.bad_messages import BadMessageLog
from vime.broker.journal import JournalWriter
from vime.broker.recovery import compacted
from vime.broker.outbox import Outbox
from vime.broker.state import BrokerState
from vime.logging import bind_progress, get_logger
from vime.prometheus import SnapshotCollector
from vime.protocol.codec import ERROR_INVALID, ERROR_UNKNOWN_PEER, ERROR_WRONG_JOB, ProtocolError, decode
from vime.protocol.group_views import GroupsGeneratedView
from vime.protocol.messages import (
    Ack,
    BatchRequest,
    Bye,
    CheckpointSaved,
    Credit,
    ErrorReply,
    EvalResult,
    GroupsScored,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Message,
    StatusReply,
    StatusRequest,
    StepDone,
    Welcome,
    WeightsPublished,
)
from vime.security import Security, ServerGuard, key_role, sender_key_name
from vime.transport import make_router

log = get_logger(__name__)

PROFILE_ENV = "VIME_BROKER_PROFILE"
# One burst of incoming messages between housekeeping passes: as many as arrive within the budget. A
# credit that arrives at the start of a burst waits for all of it, so the budget is most of the dispatch
# latency's tail: in bench/broker_scale.py 2 ms gave a half-load p99 of 5.4-7.6 ms, 1 ms 4.5-5.4 ms,
# 0.75 ms 3.2-4.5 ms at 24-28k messages/s at full load, 0.5 ms 3.8-4.5 ms but fewer messages/s (more
# passes that find little to do).
DRAIN_BUDGET_S = 0.00075
DRAIN_MAX_MESSAGES = 4096

# Which roles may send which messages; anything else is answered with an error. Generated groups are
# read as `GroupsGeneratedView` (arrays left in wire form: the broker forwards them, never reads them).
ALLOWED: dict[type[Any], frozenset[str]] = {
    Heartbeat: frozenset({"rollout", "reward", "trainer"}),
    Bye: frozenset({"rollout", "reward", "trainer"}),
    Credit: frozenset({"rollout", "reward"}),
    GroupsGeneratedView: frozenset({"rollout"}),
    GroupsScored: frozenset({"reward"}),
    BatchRequest: frozenset({"trainer"}),
    StepDone: frozenset({"trainer"}),
    CheckpointSaved: frozenset({"trainer"}),
    WeightsPublished: frozenset({"trainer"}),
}
ACCEPTED_TYPES = (Hello, StatusRequest, *ALLOWED)
# What logs, errors and metrics call each message: its wire name, whatever type the broker reads it as.
MESSAGE_NAMES: dict[type[Any], str] = {cls: cls.__name__ for cls in ACCEPTED_TYPES} | {GroupsGeneratedView: "GroupsGenerated"}

class BrokerServer:
    def __init__(
        self,
        state: BrokerState,
        bind: str,
        *,
        status_path: Path | None = None,
        max_message_bytes: int = 1 << 30,
        security: Security | None = None,
        journal: JournalWriter | None = None,
        compact_bytes: int = 256 << 20,
        metrics: SnapshotCollector[dict[str, Any]] | None = None,
        job_name: str = "",
    ) -> None:
        self.state = state
        self.job_name = job_name  # a Hello naming another job is refused (ERROR_WRONG_JOB)
        self.metrics = metrics
        self.journal = journal
        self.compact_bytes = compact_bytes
        state.journal = journal
        self.context = zmq.Context()
        # CURVE + ZAP allow-list, or plaintext on loopback only; SecurityError before anything binds.
        try:
            self.guard = ServerGuard(self.context, security, name="broker", endpoint=bind)
            self.socket = make_router(self.context, bind, max_message_bytes=max_message_bytes, guard=self.guard)
        except BaseException:
            if hasattr(self, "guard"):
                self.guard.close()
            self.context.term()
            raise
        self.outbox = Outbox(self.socket, before_send=self._flush_journal)
        self.status_path = status_path
        self.max_message_bytes = max_message_bytes
        self._stop = False
        self._unbound_keys_warned: set[str] = set()
        self.bad_message_log = BadMessageLog()
        self._last_status_write = 0.0
        self._last_expiry_check = 0.0
        self._streak_warn_at = self._first_streak_warning = 4 * max(
            state.settings.over_sampling_batch_size or 0, state.settings.rollout_batch_size
        )

    def stop(self, *_: Any) -> None:
        self._stop = True

    def serve(self, *, linger_after_finish_s: float = 5.0) -> None:
        """Run until `stop()` (the program wires SIGINT/SIGTERM to it) or until training finished."""
        profile_path = os.environ.get(PROFILE_ENV)
        if not profile_path:
            self._serve(linger_after_finish_s)
            return
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            self._serve(linger_after_finish_s)
        finally:
            profiler.disable()
            profiler.dump_stats(profile_path)
            log.info("broker_profile_written", path=profile_path)

    def _serve(self, linger_after_finish_s: float) -> None:
        finished_at: float | None = None
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        log.info("broker_started", admission_limit=self.state.admission_limit)
        while not self._stop:
            events = dict(poller.poll(timeout=0 if self.outbox.pending else 100))
            now = time.monotonic()
            if self.socket in events:
                self._drain(now)
            self._housekeeping(now)
            if self.state.finished:
                finished_at = finished_at or now
                if not self.state.workers or now - finished_at > linger_after_finish_s:
                    break
        self.outbox.flush()
        self._flush_journal()
        if self.journal is not None:
            self.journal.close()
        self._flush_log_limits()
        self._write_status(time.monotonic(), force=True)
        log.info("broker_stopped", **self.state.counters)
        self.socket.close(linger=500)
        self.guard.close()  # the ZAP thread's socket would keep term() waiting
        self.context.term()

    def _drain(self, now: float) -> None:
        """Handle what has arrived, up to DRAIN_MAX_MESSAGES or DRAIN_BUDGET_S, before housekeeping.

        Housekeeping (dispatch, scoring hand-off, batch filling, the journal flush) then runs once for
        the whole burst rather than once per message; the time budget bounds how long a credit that
        arrived at the start of a burst waits for its dispatch."""
        recv = self.socket.recv_multipart
        deadline = now + DRAIN_BUDGET_S
        for _ in range(DRAIN_MAX_MESSAGES):
            try:
                frames = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames, now)
            if time.monotonic() >= deadline:
                return

    def _housekeeping(self, now: float) -> None:
        if now - self._last_expiry_check > 1.0:
            self._last_expiry_check = now
            for worker in self.state.expire_workers(now):
                log.warning("worker_expired", worker=worker.worker_id, role=worker.role, requeued=worker.requeued)
        self.bad_message_log.roll(now)
        self.outbox.send_some()
        self.outbox.send(self.state.dispatch())
        self.outbox.send(self.state.dispatch_scoring())
        self.state.record_sent(time.monotonic())
        self.outbox.send(self.state.try_fill_batch(now))
        evals = self.state.poll_evals()
        for step, msg in {m.step: m for _, m in evals if isinstance(m, EvalResult)}.items():
            passes = {k: round(v, 4) for k, v in msg.metrics.items() if "/pass@" in k or k.endswith("/reward_mean")}
            seconds = round(msg.metrics.get("eval/time_s", 0.0), 3)
            log.info("eval_done", eval_step=step, eval_version=msg.weight_version, seconds=seconds, **passes)
        self.outbox.send(evals)
        self._warn_if_filter_starves()
        self._flush_journal()
        self._maybe_compact()
        self._write_status(now)

    def _warn_if_filter_starves(self) -> None:
        streak = self.state.dynamic.streak
        if streak < self._first_streak_warning:
            self._streak_warn_at = self._first_streak_warning
        elif streak >= self._streak_warn_at:
            self._streak_warn_at *= 2
            log.warning(
                "dynamic_filter_starving", dropped_in_a_row=streak, reasons=dict(self.state.dynamic.reasons.most_common(3)),
                hint="every recent group was filtered out; training waits until one is kept",
            )  # fmt: skip

    def _handle(self, frames: list[Any], now: float) -> None:
        identity, payload = frames[0].bytes, frames[1:]
        try:
            msg = decode(payload, ACCEPTED_TYPES, max_total_bytes=self.max_message_bytes)
            self.state.received[MESSAGE_NAMES[type(msg)]] += 1
            if isinstance(msg, Hello):
                self._check_job(msg)
                self._check_role_key(msg, payload[0] if payload else None)
            self._dispatch_message(identity, msg, now)
        except ProtocolError as exc:
            self.state.counters["bad_messages"] += 1
            if exc.code == ERROR_UNKNOWN_PEER:
                # Expected after a broker restart (the worker says Hello again on this reply): not a warning.
                self.state.counters["unknown_peer_messages"] += 1
                if self.bad_message_log.allow(exc.code, now):
                    log.info("bad_message", code=exc.code, detail=exc.detail[:200], peer=identity.hex())
            elif self.bad_message_log.allow(exc.code, now):
                log.warning("bad_message", code=exc.code, detail=exc.detail[:500], peer=identity.hex())
            self.outbox.send([(identity, ErrorReply(code=exc.code, detail=exc.detail))])

    def _check_job(self, hello: Hello) -> None:
        """Two jobs given one broker address would otherwise share workers: one job's rollout worker
        generating with its own model for the other, its reward worker scoring with the wrong function."""
        if self.job_name and hello.job and hello.job != self.job_name:
            raise ProtocolError(
                ERROR_WRONG_JOB,
                f"this broker serves job {self.job_name!r}; {hello.role} worker {hello.worker_id!r} belongs to job "
                f"{hello.job!r} (two jobs on one broker address? give each its own --broker-address)",
            )

    def _check_role_key(self, hello: Hello, frame: Any) -> None:
        """Under CURVE a client key named for a role ("rollout", "rollout-node7") may only say Hello
        in that role, so a leaked rollout key cannot pose as the trainer."""
        key_name = sender_key_name(frame)
        if key_name is None:
            return
        bound = key_role(key_name)
        if bound is None:
            if key_name not in self._unbound_keys_warned:
                self._unbound_keys_warned.add(key_name)
                log.warning("client_key_not_bound_to_a_role", key=key_name, role=hello.role,
                            hint="name client keys after their role (vime keys DIR --client rollout-NAME)")  # fmt: skip
            return
        if bound != hello.role:
            raise ProtocolError(ERROR_INVALID, f"the client key {key_name!r} is a {bound} key; it may not join as {hello.role}")

    def _dispatch_message(self, identity: bytes, msg: Message, now: float) -> None:
        state = self.state
        if isinstance(msg, Hello):
            old = state.workers.get(identity)  # a restarted worker's old registration: its leases are requeued
            job = state.register(identity, msg.worker_id, msg.role, now, msg.weight_version, msg.metrics_url)
            requeued = {"requeued": old.requeued} if old is not None and old.requeued else {}
            log.info("worker_joined", worker=msg.worker_id, role=msg.role, host=msg.host, pid=msg.pid, metrics=msg.metrics_url, **requeued)
            self.outbox.send([(identity, Welcome(worker_id=msg.worker_id, job=job))])
            return
        if isinstance(msg, StatusRequest):
            self.outbox.send([(identity, StatusReply(status=state.status(now)))])
            return
        worker = state.workers.get(identity)
        if worker is None:
            raise ProtocolError(ERROR_UNKNOWN_PEER, f"{MESSAGE_NAMES[type(msg)]} from an unknown peer: send Hello first")
        if worker.role not in ALLOWED[type(msg)]:
            raise ProtocolError(ERROR_INVALID, f"a {worker.role} worker may not send {MESSAGE_NAMES[type(msg)]}")
        state.touch(identity, now)
        if isinstance(msg, Heartbeat):
            state.touch(identity, now, msg.weight_version, {"in_flight": msg.in_flight, **msg.stats})
            self.outbox.send([(identity, HeartbeatAck(weight_version=state.published_version, weight_endpoint=state.weight_endpoint))])
        elif isinstance(msg, Bye):
            state.remove_worker(identity)
            log.info("worker_left", worker=worker.worker_id, reason=msg.reason, requeued=worker.requeued)
        elif isinstance(msg, Credit):
            state.add_credit(identity, msg.n, now)
        elif isinstance(msg, GroupsGeneratedView):
            accepted = state.on_generated(identity, msg.groups)
            self.outbox.send([(identity, Ack(ids=accepted))])
        elif isinstance(msg, GroupsScored):
            accepted = state.on_scored(identity, msg.scores, now)
            self.outbox.send([(identity, Ack(ids=accepted))])
        elif isinstance(msg, BatchRequest):
            self.outbox.send(state.request_batch(identity, msg.step, msg.n_groups, msg.policy_version, now))
        elif isinstance(msg, StepDone):
            self.outbox.send(state.on_step_done(msg.step, msg.group_ids))
            bind_progress(step=state.trained_steps)
            self.outbox.send([(identity, Ack(ids=[str(msg.step)]))])
        elif isinstance(msg, CheckpointSaved):
            state.on_checkpoint(msg.steps_done)
            log.info("trainer_checkpoint", steps_done=msg.steps_done, path=msg.path, replayable_steps=len(state.batches.step_batches))
            self.outbox.send([(identity, Ack(ids=[f"checkpoint-{msg.steps_done}"]))])
        elif isinstance(msg, WeightsPublished):
            # To every rollout worker: a few per loop turn, so credits arriving meanwhile are not held up.
            self.outbox.broadcast(state.on_weights_published(msg.version, msg.endpoint, None if msg.reannounce else msg.step, now))
            bind_progress(weight_version=state.published_version)
            log.info("weights_published", version=msg.version, nbytes=msg.nbytes, seconds=round(msg.seconds, 4))
            self.outbox.send([(identity, Ack(ids=[str(msg.version)]))])

    def _flush_log_limits(self) -> None:
        """At shutdown: report the bad-message lines left out in the last interval."""
        self.bad_message_log.roll(time.monotonic(), force=True)

    def _flush_journal(self) -> None:
        if self.journal is not None:
            self.journal.flush()

    def _maybe_compact(self) -> None:
        if self.journal is None or self.journal.size < self.compact_bytes:
            return
        before = self.journal.size
        started = time.perf_counter()
        self.journal.rewrite(compacted(self.state))
        log.info("journal_compacted", bytes_before=before, bytes_after=self.journal.size, seconds=round(time.perf_counter() - started, 3))
        if self.journal.size > self.compact_bytes // 2:
            # Mostly live data (a large buffer): compact again only after it has doubled.
            self.compact_bytes = 2 * self.journal.size

    def _write_status(self, now: float, force: bool = False) -> None:
        if (self.status_path is None and self.metrics is None) or (not force and now - self._last_status_write < 1.0):
            return
        self._last_status_write = now
        status = self.state.status(now)
        if self.metrics is not None:
            self.metrics.publish(status)  # a reference swap: scrapes read it in their thread, no lock here
        if self.status_path is None:
            return
        tmp = self.status_path.with_suffix(".tmp")
        # msgspec, not json.dumps(indent=...): the stdlib's pure-Python indenting encoder took 75 ms for
        # the status of 1,100 workers, once a second, on the broker's only thread.
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(status, enc_hook=_json_default), indent=1))
        tmp.replace(self.status_path)


def _json_default(obj: Any) -> Any:
    """numpy scalars (and anything else a status may hold) as JSON: their value, else their text."""
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)
