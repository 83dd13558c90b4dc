"""Does vime's asynchronous pipeline silently bias training toward short responses? (issue 8)

A discrete-event simulation in simulated time that drives the *real* broker logic
(`vime.broker.state.BrokerState` with `BrokerSettings` and a `PromptCursor`, fed and read through the
protocol's `Group`/`Sample` messages) with simulated rollout workers, a reward worker and a trainer.
No sockets, no models: only the broker is production code; everything around it mimics what
`vime/workers/rollout.py`, `vime/rollout/vllm_engine.py` and `vime/workers/trainer.py` do, in simulated seconds.

Model:
- Response lengths are heavy tailed: log(length) = log(median) + prompt effect + sample noise (both
  normal), clipped to [1, max_len] (clipped samples finish with "length", like max_tokens). The
  prompt effect is fixed per prompt, so a dropped group loses a "long" prompt, not only long samples.
  Lengths depend only on (seed, epoch, prompt), so every setting sees the same prompt stream.
- A rollout worker takes `concurrency` groups (its credits, one more after each result, like
  `RolloutWorker`); a group is one request of n samples decoding in lock step at `tokens_per_s` per
  sequence; it returns when its longest sample ends. A group waits until the engine holds its
  `min_weight_version` and the engine accepts new requests.
- Weight updates (`VllmRolloutEngine.update_weights`): on an announcement the worker fetches the newest
  published version in the background (`fetch_s`, generation continues), then closes submission and
  pauses vLLM: with partial rollout (`mode="keep"`) in-flight requests freeze for `load_s` and then
  continue, their later tokens carrying the new version (per-token `token_versions`, built with the
  engine's own `versions_from_spans`); without it (`mode="wait"`) the update waits until every
  in-flight request has finished (new requests wait too), then loads. Updates are coalesced to the
  newest version, as in the worker's update loop.
- The reward worker scores a group in `score_s` (unbounded concurrency). The trainer asks for
  `batch` groups at its current version, trains `train_s`, reports the step, publishes the next
  version (`publish_s`) every step and asks again. Messages take `latency_s`.

Measured per setting {partial rollout on/off} x {max_staleness 0, 1, 2, no gate (10**6)}: length
statistics (per sample) of generated vs trained samples and of dropped groups, the fraction of
generated groups dropped stale (overall, longest 10% and shortest 50% of groups), staleness of trained
groups (overall, longest 10% / shortest 50% of samples), rollout slot idle fraction and trained steps
per simulated second. Rows with fill "broker" run vime's broker as it is (earliest-deadline batches
that wait rather than strand a due group); rows with fill "eager (before fix)" run `EagerFillState`
(defined here only: the broker's batch rule before that fix, earliest-dispatched buffered groups, never
waiting) for max_staleness 1 and 2 (`--eager-fill`), to show the bias the fix removed. Every run checks
that each generated group was trained or counted as dropped. Results: docs/length-bias.md.

    .venv/bin/python bench/length_bias.py                 # the tables (12 settings x 3 seeds, ~80 s on 2 busy cores)
    .venv/bin/python bench/length_bias.py --json          # one JSON object on stdout
    .venv/bin/python bench/length_bias.py --seeds 1 --steps 60 --staleness 1 --partial on
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vime.broker.batches import BatchPlanner  # noqa: E402
from vime.broker.settings import BrokerSettings  # noqa: E402
from vime.broker.state import BrokerState  # noqa: E402
from vime.data.prompts import Prompt, PromptCursor  # noqa: E402
from vime.protocol.messages import (  # noqa: E402
    DispatchGroups,
    Group,
    GroupScores,
    GroupsGenerated,
    GroupsScored,
    Message,
    ScoreGroups,
    Shutdown,
    TrainBatch,
    WeightVersionAnnounce,
)
from vime.rollout.base import GeneratedSample, versions_from_spans  # noqa: E402
from vime.workers.rollout import to_sample  # noqa: E402

NO_GATE = 10**6  # "no gate": a max_staleness no run reaches (admission is then bounded by num_rollout only)
TRAINER, REWARD = b"trainer-0", b"reward-0"
WEIGHT_ENDPOINT = "sim://trainer"


# --- configuration ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    partial_rollout: bool = True
    max_staleness: int = 1
    seed: int = 0
    steps: int = 100  # num_rollout
    batch: int = 16  # rollout_batch_size (groups per step)
    n_samples: int = 8  # n_samples_per_prompt
    workers: int = 4
    concurrency: int = 8  # groups in flight per rollout worker (its credits)
    tokens_per_s: float = 40.0  # decode speed of one sequence
    median_len: float = 1200.0
    prompt_sigma: float = 0.6  # spread of log length between prompts
    sample_sigma: float = 0.6  # spread of log length between samples of one prompt
    max_len: int = 8192  # rollout_max_response_len
    train_s: float = 40.0  # one trainer step
    publish_s: float = 2.0  # export + publish a version
    fetch_s: float = 1.0  # a rollout worker fetching it (generation continues)
    load_s: float = 0.5  # loading it into the engine (paused)
    score_s: float = 0.5  # reward for one group
    latency_s: float = 0.005  # one message
    num_prompts: int = 20_000
    # "broker": vime's BrokerState as it is (earliest-deadline batches that wait rather than strand a group).
    # "eager": EagerFillState, the broker's batch rule before that fix (bench-only, for comparison).
    fill: Literal["broker", "eager"] = "broker"

    @property
    def gate_label(self) -> str:
        return "none" if self.max_staleness >= NO_GATE else str(self.max_staleness)


class LengthModel:
    """Response lengths: lognormal with a per-prompt and a per-sample term, clipped to [1, max_len]."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg

    def draw(self, epoch: int, prompt_index: int, n: int) -> np.ndarray:
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, epoch, prompt_index])
        prompt_effect = rng.normal(0.0, cfg.prompt_sigma)
        raw = np.exp(math.log(cfg.median_len) + prompt_effect + rng.normal(0.0, cfg.sample_sigma, size=n))
        return np.clip(np.rint(raw), 1, cfg.max_len).astype(np.int64)


# --- event loop ------------------------------------------------------------------------------------


class EventLoop:
    """A heap of (time, sequence, callback): callbacks at equal times run in scheduling order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.stopped = False

    def at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), callback))

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        self.at(self.now + delay, callback)

    def run(self) -> None:
        while self._heap and not self.stopped:
            self.now, _, callback = heapq.heappop(self._heap)
            callback()


# --- the broker before the fix, modelled here only -----------------------------------------------


class EagerFillPlanner(BatchPlanner):
    """NOT vime's batch planner any more: `BatchPlanner` with its batch rule from before the fix, for comparison.

    Before the fix, a batch went to the trainer as soon as `rollout_batch_size` trainable groups were
    buffered, taking the earliest-dispatched *buffered* ones and never waiting for a group still
    generating or scoring. Admission admits no more groups than the next `max_staleness + 1` steps
    consume, so a long group still generating at its last admissible step was overtaken by later,
    shorter groups that took its slot, and the gate dropped it when it arrived. vime's broker now fills
    batches earliest-deadline-first and waits rather than strand such a group (`BatchPlanner._would_strand`
    in vime/broker/batches.py); this class switches both off.
    """

    def _would_strand(self, *args: object, **kwargs: object) -> bool:
        return False  # never wait for an unfinished group

    def fill(self, now: float, keep_rate: float) -> tuple[bytes, TrainBatch] | None:
        pending = self.pending
        if pending is None:
            return None
        self._drop_stale(pending.policy_version)  # the gate, as in BatchPlanner.fill
        order = sorted(self.buffer, key=self._ledger.order)  # earliest-dispatched first
        chosen, rest = order[: pending.n_groups], order[pending.n_groups :]
        others = OrderedDict((g, self.buffer[g]) for g in rest)
        self.buffer = OrderedDict((g, self.buffer[g]) for g in chosen)
        try:
            return super().fill(now, keep_rate)  # the planner's own batch, journal and stats
        finally:
            self.buffer.update(others)


class EagerFillState(BrokerState):
    """`BrokerState` with `EagerFillPlanner`: the broker before the fix."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches = EagerFillPlanner(self.settings, self.counters, ledger=self.admission, record=self._record)


# --- simulated processes ---------------------------------------------------------------------------


@dataclass
class Generation:
    """One group generating on a rollout engine: its samples decode in lock step."""

    group: Group
    lengths: np.ndarray
    progress: float = 0.0  # tokens generated per (unfinished) sample
    # (first token index, weight version) from the start: the vLLM engine's weight_versions spans.
    spans: list[tuple[int, int]] = field(default_factory=list)
    max_len: int = 0  # the sampling's max_tokens: a sample this long finished with "length"

    @property
    def total(self) -> int:
        return int(self.lengths.max())

    def samples(self) -> list[GeneratedSample]:
        out = []
        for length in self.lengths:
            bounds = [start for start, _ in self.spans[1:]] + [int(length)]
            spans = [(version, start, end) for (start, version), end in zip(self.spans, bounds)]
            finish = "length" if length >= self.max_len else "stop"
            out.append(GeneratedSample(
                response_tokens=np.zeros(length, dtype=np.int32),
                rollout_logprobs=np.zeros(length, dtype=np.float32),
                loss_mask=np.ones(length, dtype=np.uint8),
                token_versions=versions_from_spans(spans, int(length), self.spans[0][1]),
                finish_reason=finish,  # type: ignore[arg-type]
            ))  # fmt: skip
        return out


class SimRolloutWorker:
    """`RolloutWorker` + `VllmRolloutEngine`, in simulated time (see the module docstring)."""

    def __init__(self, sim: Simulation, identity: bytes) -> None:
        self.sim = sim
        self.cfg = sim.cfg
        self.identity = identity
        self.engine_version = 0
        self.target_version = 0
        self.waiting: list[Group] = []  # dispatched, not yet submitted (version or paused submission)
        self.running: list[Generation] = []
        self.updating = False
        self.draining = False
        self.submit_open = True
        self.paused = False
        self.fetched_version = 0
        self._clock = 0.0
        self._timer = 0  # invalidates a scheduled completion when the schedule changes
        self.generating_slot_s = 0.0  # integral of generating (not paused) groups over time
        self.tokens = 0

    # messages from the broker
    def on_message(self, msg: Message) -> None:
        if isinstance(msg, DispatchGroups):
            for group in msg.groups:
                self.waiting.append(group)
                if group.min_weight_version > self.engine_version:
                    self._note_version(group.min_weight_version)
            self._submit_ready()
        elif isinstance(msg, WeightVersionAnnounce):
            self._note_version(msg.version)

    def _note_version(self, version: int) -> None:
        if version > self.target_version:
            self.target_version = version
            if not self.updating:
                self._start_update()

    # generation
    def _advance(self) -> None:
        now = self.sim.loop.now
        dt = now - self._clock
        self._clock = now
        if dt <= 0 or self.paused:
            return
        self.generating_slot_s += dt * len(self.running)
        for gen in self.running:
            gen.progress = min(float(gen.total), gen.progress + dt * self.cfg.tokens_per_s)

    def _submit_ready(self) -> None:
        if not self.submit_open:
            return
        self._advance()
        ready = [g for g in self.waiting if g.min_weight_version <= self.engine_version]
        if not ready:
            return
        self.waiting = [g for g in self.waiting if g.min_weight_version > self.engine_version]
        for group in ready:
            lengths = self.sim.lengths.draw(group.epoch, group.prompt_index, group.n_samples)
            gen = Generation(group, lengths, spans=[(0, self.engine_version)], max_len=self.cfg.max_len)
            self.running.append(gen)
        self._schedule_completion()

    def _schedule_completion(self) -> None:
        self._timer += 1
        if self.paused or not self.running:
            return
        timer = self._timer
        delay = min(gen.total - gen.progress for gen in self.running) / self.cfg.tokens_per_s
        self.sim.loop.after(delay, lambda: self._on_timer(timer))

    def _on_timer(self, timer: int) -> None:
        if timer != self._timer:
            return
        self._advance()
        done = [gen for gen in self.running if gen.progress >= gen.total - 1e-6]
        self.running = [gen for gen in self.running if gen.progress < gen.total - 1e-6]
        for gen in done:
            gen.group.samples = [to_sample(i, s) for i, s in enumerate(gen.samples())]
            self.tokens += int(gen.lengths.sum())
            self.sim.from_rollout(self.identity, gen.group)
        if self.draining and not self.running:
            self._load()
        self._schedule_completion()

    # weight updates
    def _start_update(self) -> None:
        self.updating = True
        # The fetcher gets the newest version the trainer has published when it connects.
        self.fetched_version = max(self.target_version, self.sim.trainer.published_version)
        self.sim.loop.after(self.cfg.fetch_s, self._apply)

    def _apply(self) -> None:
        self._advance()
        self.submit_open = False
        if self.cfg.partial_rollout or not self.running:
            self._load()  # mode="keep": freeze what is in flight
        else:
            self.draining = True  # mode="wait": in-flight requests finish first

    def _load(self) -> None:
        self._advance()
        self.draining = False
        self.paused = True
        self._schedule_completion()  # cancels the pending completion while paused
        self.sim.loop.after(self.cfg.load_s, self._resume)

    def _resume(self) -> None:
        self._advance()  # paused: no progress
        self.engine_version = max(self.engine_version, self.fetched_version)
        for gen in self.running:  # partial rollout: later tokens carry the new version
            gen.spans.append((int(math.floor(gen.progress)), self.engine_version))
        self.paused = False
        self.submit_open = True
        self.updating = False
        self._submit_ready()
        self._schedule_completion()
        if self.target_version > self.engine_version:
            self._start_update()


class SimRewardWorker:
    """Scores a group in `score_s`; the rewards do not matter here (no dynamic-sampling filter)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def on_message(self, msg: Message) -> None:
        if isinstance(msg, ScoreGroups):
            groups = list(msg.groups)
            self.sim.loop.after(self.sim.cfg.score_s, lambda: self._done(groups))

    def _done(self, groups: list[Group]) -> None:
        scores = [
            GroupScores(group_id=g.group_id, rewards=[float(i % 2) for i in range(len(g.samples))],
                        failed=[False] * len(g.samples), reasons=[None] * len(g.samples))
            for g in groups
        ]  # fmt: skip
        self.sim.from_reward(scores)


class SimTrainer:
    """`LeaderLoop`: request a batch at the current version, train, StepDone, publish, repeat."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.version = 0
        self.published_version = 0
        self.step = 0
        self.finished_at: float | None = None

    def start(self) -> None:
        self.sim.to_broker(lambda: self.sim.state.on_weights_published(0, WEIGHT_ENDPOINT, step=-1, now=self.sim.loop.now))
        self._request()

    def _request(self) -> None:
        step, version = self.step, self.version
        self.sim.to_broker(lambda: self.sim.state.request_batch(TRAINER, step, self.sim.cfg.batch, version, self.sim.loop.now))

    def on_message(self, msg: Message) -> None:
        if isinstance(msg, TrainBatch):
            self.sim.record_batch(msg, self.version)
            ids = [g.group_id for g in msg.groups]
            self.sim.loop.after(self.sim.cfg.train_s, lambda: self._trained(msg.step, ids))

    def _trained(self, step: int, ids: list[str]) -> None:
        self.sim.to_broker(lambda: self.sim.state.on_step_done(step, ids))
        if step + 1 >= self.sim.cfg.steps:
            self.finished_at = self.sim.loop.now
            self.sim.loop.after(2 * self.sim.cfg.latency_s, self.sim.stop)
            return
        self.version += 1  # update_weights_interval = 1
        self.sim.loop.after(self.sim.cfg.publish_s, self._published)

    def _published(self) -> None:
        version, step = self.version, self.step
        self.published_version = version
        self.sim.to_broker(lambda: self.sim.state.on_weights_published(version, WEIGHT_ENDPOINT, step, self.sim.loop.now))
        self.step += 1
        self._request()


# --- the simulation --------------------------------------------------------------------------------


@dataclass
class Records:
    """What happened to every training group, by id (sample lengths per group)."""

    generated: dict[str, np.ndarray] = field(default_factory=dict)
    trained: dict[str, np.ndarray] = field(default_factory=dict)
    dropped: dict[str, np.ndarray] = field(default_factory=dict)
    # per trained sample: staleness of its oldest token (policy version - sample's min version)
    sample_staleness: list[int] = field(default_factory=list)
    sample_length: list[int] = field(default_factory=list)
    group_staleness: list[int] = field(default_factory=list)
    multi_version_samples: int = 0


class Simulation:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.loop = EventLoop()
        self.lengths = LengthModel(cfg)
        tokens = np.array([1, 2, 3], dtype=np.int32)
        prompts = [Prompt(i, "", tokens, None) for i in range(cfg.num_prompts)]
        settings = BrokerSettings(
            rollout_batch_size=cfg.batch, n_samples_per_prompt=cfg.n_samples, max_staleness=cfg.max_staleness,
            update_weights_interval=1, num_rollout=cfg.steps, worker_timeout_s=1e12,
            sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": cfg.max_len},
        )  # fmt: skip
        state_class = {"broker": BrokerState, "eager": EagerFillState}[cfg.fill]
        self.state = state_class(settings, PromptCursor(prompts, shuffle=True, seed=cfg.seed))
        self.rollouts = {f"rollout-{i}".encode(): SimRolloutWorker(self, f"rollout-{i}".encode()) for i in range(cfg.workers)}
        self.reward = SimRewardWorker(self)
        self.trainer = SimTrainer(self)
        self.records = Records()

    # actor -> broker (after one message latency; the broker loop then dispatches, like the server)
    def to_broker(self, action: Callable[[], Any]) -> None:
        def deliver() -> None:
            out = action()
            if isinstance(out, list):
                self._send(out)
            self._pump()

        self.loop.after(self.cfg.latency_s, deliver)

    def from_rollout(self, identity: bytes, group: Group) -> None:
        msg = GroupsGenerated(groups=[group])  # GroupsGenerated.validate() passes: see the test

        def deliver() -> None:
            accepted = self.state.on_generated(identity, msg.groups)
            for g in msg.groups:
                if g.group_id in accepted:
                    self.records.generated[g.group_id] = _lengths(g)
            self.state.add_credit(identity, 1)

        self.to_broker(deliver)

    def from_reward(self, scores: list[GroupScores]) -> None:
        msg = GroupsScored(scores=scores)

        def deliver() -> None:
            self.state.on_scored(REWARD, msg.scores, self.loop.now)
            self.state.add_credit(REWARD, len(msg.scores))

        self.to_broker(deliver)

    def _pump(self) -> None:
        state = self.state
        self._send(state.dispatch())
        self._send(state.dispatch_scoring())
        buffered = dict(state.batches.buffer)
        out = state.try_fill_batch(self.loop.now)
        sent = {g.group_id for _, m in out if isinstance(m, TrainBatch) for g in m.groups}
        dropped = set(buffered) - set(state.batches.buffer) - sent  # left the buffer untrained: the gate
        for group_id in dropped:
            self.records.dropped[group_id] = _lengths(buffered[group_id])
        self._send(out)
        if dropped:
            # A drop frees admission slots; the server's loop dispatches them on its next pass (it polls
            # every 100 ms even when no message comes).
            self.loop.after(0.1, self._pump)

    def _send(self, out: list[tuple[bytes, Message]]) -> None:
        for identity, msg in out:
            if isinstance(msg, Shutdown):
                continue
            target = self.rollouts.get(identity)
            actor: SimRolloutWorker | SimRewardWorker | SimTrainer
            actor = target if target is not None else (self.reward if identity == REWARD else self.trainer)
            self.loop.after(self.cfg.latency_s, lambda a=actor, m=msg: a.on_message(m))

    def record_batch(self, batch: TrainBatch, policy_version: int) -> None:
        rec = self.records
        for group in batch.groups:
            rec.trained[group.group_id] = _lengths(group)
            rec.group_staleness.append(policy_version - group.oldest_version)
            for sample in group.samples:
                rec.sample_staleness.append(policy_version - sample.min_version)
                rec.sample_length.append(len(sample.response_tokens))
                rec.multi_version_samples += int(len(np.unique(sample.token_versions)) > 1)

    def stop(self) -> None:
        self.loop.stopped = True

    def run(self) -> Simulation:
        now = self.loop.now
        self.state.register(TRAINER, "trainer-0", "trainer", now=now)
        self.state.register(REWARD, "reward-0", "reward", now=now)
        self.state.add_credit(REWARD, 4096)
        for identity in self.rollouts:
            self.state.register(identity, identity.decode(), "rollout", now=now)
            self.state.add_credit(identity, self.cfg.concurrency)
        self.trainer.start()
        self.loop.run()
        if self.trainer.finished_at is None:
            raise RuntimeError(f"simulation stalled at step {self.trainer.step} (t={self.loop.now:.0f} s)")
        return self


def _lengths(group: Group) -> np.ndarray:
    return np.array([len(s.response_tokens) for s in group.samples], dtype=np.int64)


# --- statistics ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthStats:
    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    frac_at_max: float


def length_stats(lengths: Sequence[int] | np.ndarray, max_len: int) -> LengthStats:
    """Per-sample length statistics (percentiles with numpy's default linear interpolation)."""
    arr = np.asarray(lengths, dtype=np.float64)
    if arr.size == 0:
        nan = float("nan")
        return LengthStats(0, nan, nan, nan, nan, nan)
    p50, p90, p99 = (float(x) for x in np.percentile(arr, [50, 90, 99]))
    return LengthStats(int(arr.size), float(arr.mean()), p50, p90, p99, float(np.mean(arr >= max_len)))


def check_accounting(sim: Simulation) -> None:
    """Every generated group was trained or dropped by the gate, exactly once, and the broker agrees."""
    rec, counters, state = sim.records, sim.state.counters, sim.state
    trained, dropped, generated = set(rec.trained), set(rec.dropped), set(rec.generated)
    expected = sim.cfg.steps * sim.cfg.batch
    problems = []
    if trained & dropped:
        problems.append(f"{len(trained & dropped)} groups both trained and dropped")
    if generated != trained | dropped:
        problems.append(f"generated {len(generated)} != trained {len(trained)} + dropped {len(dropped)}")
    if len(trained) != expected or counters["groups_trained"] != len(trained):
        problems.append(f"trained {len(trained)} (broker: {counters['groups_trained']}), expected {expected}")
    if counters["groups_dropped_stale"] != len(dropped) or counters["groups_generated"] != len(generated):
        problems.append(f"broker counters {counters} disagree with the records")
    if counters["groups_admitted"] != len(generated):
        problems.append(f"admitted {counters['groups_admitted']} != generated {len(generated)}")
    if state.in_flight.generating or state.batches.buffer or state.in_flight.to_score or state.in_flight.scoring or state.batches.training or state.in_flight.retry:
        problems.append("groups left in the broker after the last step")
    if problems:
        raise AssertionError("; ".join(problems))


@dataclass
class RunSummary:
    """One simulation (one setting, one seed), reduced to arrays (cheap to send between processes)."""

    generated: np.ndarray  # sample lengths
    trained: np.ndarray
    dropped: np.ndarray
    group_staleness: np.ndarray  # trained groups: policy version - oldest token version
    sample_staleness: np.ndarray  # trained samples, same order as sample_length
    sample_length: np.ndarray
    group_mean_length: np.ndarray  # every generated group, in order of generation
    group_dropped: np.ndarray  # bool, same order
    multi_version_samples: int
    slot_idle_fraction: float
    sim_seconds: float


def simulate(cfg: SimConfig) -> RunSummary:
    sim = Simulation(cfg).run()
    check_accounting(sim)
    rec = sim.records

    def cat(groups: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate(list(groups.values())) if groups else np.zeros(0, dtype=np.int64)

    t_end = float(sim.trainer.finished_at or sim.loop.now)
    busy = sum(w.generating_slot_s for w in sim.rollouts.values())
    return RunSummary(
        generated=cat(rec.generated), trained=cat(rec.trained), dropped=cat(rec.dropped),
        group_staleness=np.asarray(rec.group_staleness), sample_staleness=np.asarray(rec.sample_staleness),
        sample_length=np.asarray(rec.sample_length),
        group_mean_length=np.array([lengths.mean() for lengths in rec.generated.values()]),
        group_dropped=np.array([g in rec.dropped for g in rec.generated], dtype=bool),
        multi_version_samples=rec.multi_version_samples,
        slot_idle_fraction=1.0 - busy / (cfg.workers * cfg.concurrency * t_end), sim_seconds=t_end,
    )  # fmt: skip


@dataclass
class SettingResult:
    partial_rollout: bool
    max_staleness: str
    fill: str
    seeds: list[int]
    generated: LengthStats
    trained: LengthStats
    dropped: LengthStats
    groups_generated: int
    groups_dropped_stale: int
    dropped_fraction: float  # of generated groups
    dropped_fraction_longest10: float  # of the generated groups with the longest 10% mean lengths
    dropped_fraction_shortest50: float  # ... with the shortest 50%
    trained_over_generated_mean: float
    staleness_mean: float  # trained groups (oldest token)
    staleness_longest10: float  # mean over trained samples in the longest 10%
    staleness_shortest50: float  # ... and in the shortest 50%
    multi_version_fraction: float  # trained samples whose tokens came from more than one version
    slot_idle_fraction: float  # rollout slots (workers x concurrency) not generating
    steps_per_s: float  # trained steps per simulated second
    sim_seconds: float


def summarize(cfg: SimConfig, seeds: Sequence[int], runs: Sequence[RunSummary]) -> SettingResult:
    """Pool the samples of one setting's seeds."""
    gen = length_stats(np.concatenate([r.generated for r in runs]), cfg.max_len)
    trained = length_stats(np.concatenate([r.trained for r in runs]), cfg.max_len)
    dropped = length_stats(np.concatenate([r.dropped for r in runs]), cfg.max_len)
    lens = np.concatenate([r.sample_length for r in runs])
    stale = np.concatenate([r.sample_staleness for r in runs]).astype(np.float64)
    group_len = np.concatenate([r.group_mean_length for r in runs])
    group_dropped = np.concatenate([r.group_dropped for r in runs])
    n_generated, n_dropped = len(group_len), int(group_dropped.sum())
    return SettingResult(
        partial_rollout=cfg.partial_rollout, max_staleness=cfg.gate_label, fill=cfg.fill, seeds=list(seeds),
        generated=gen, trained=trained, dropped=dropped,
        groups_generated=n_generated, groups_dropped_stale=n_dropped,
        dropped_fraction=n_dropped / max(1, n_generated),
        dropped_fraction_longest10=float(group_dropped[group_len >= np.percentile(group_len, 90)].mean()),
        dropped_fraction_shortest50=float(group_dropped[group_len <= np.percentile(group_len, 50)].mean()),
        trained_over_generated_mean=trained.mean / gen.mean,
        staleness_mean=float(np.mean(np.concatenate([r.group_staleness for r in runs]))),
        staleness_longest10=float(stale[lens >= np.percentile(lens, 90)].mean()),
        staleness_shortest50=float(stale[lens <= np.percentile(lens, 50)].mean()),
        multi_version_fraction=sum(r.multi_version_samples for r in runs) / max(1, len(lens)),
        slot_idle_fraction=float(np.mean([r.slot_idle_fraction for r in runs])),
        steps_per_s=float(np.mean([cfg.steps / r.sim_seconds for r in runs])),
        sim_seconds=float(sum(r.sim_seconds for r in runs)),
    )  # fmt: skip


def run_settings(configs: Sequence[SimConfig], seeds: Sequence[int], jobs: int) -> list[SettingResult]:
    """Every (setting, seed) simulation, over `jobs` processes; one pooled result per setting."""
    tasks = [replace(cfg, seed=seed) for cfg in configs for seed in seeds]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            runs = list(pool.map(simulate, tasks))
    else:
        runs = [simulate(task) for task in tasks]
    k = len(seeds)
    return [summarize(cfg, seeds, runs[i * k : (i + 1) * k]) for i, cfg in enumerate(configs)]


# --- output ----------------------------------------------------------------------------------------


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    return "\n".join([line(head), line(["---"] * len(head)), *(line(r) for r in rows)])


FILL_LABELS = {"broker": "broker", "eager": "eager (before fix)"}


def _setting(r: SettingResult) -> list[str]:
    return ["on" if r.partial_rollout else "off", r.max_staleness, FILL_LABELS.get(r.fill, r.fill)]


def format_tables(results: Sequence[SettingResult]) -> str:
    """Two markdown tables: lengths (generated / trained), then drops, staleness and throughput."""
    def pair(a: float, b: float, fmt: str = ".0f") -> str:
        return f"{a:{fmt}} / {b:{fmt}}"

    lengths = _table(
        ["partial", "gate", "fill", "mean g / t", "t / g", "p50 g / t", "p90 g / t", "p99 g / t", "at max % g / t"],
        [_setting(r) + [
            pair(r.generated.mean, r.trained.mean), f"{r.trained_over_generated_mean:.3f}",
            pair(r.generated.p50, r.trained.p50), pair(r.generated.p90, r.trained.p90),
            pair(r.generated.p99, r.trained.p99),
            pair(100 * r.generated.frac_at_max, 100 * r.trained.frac_at_max, ".1f"),
        ] for r in results],
    )  # fmt: skip
    pipeline = _table(
        ["partial", "gate", "fill", "dropped %", "dropped % long10 / short50", "dropped mean / at max %", "stale",
         "stale long10 / short50", "multi-version %", "idle %", "steps/ks"],
        [_setting(r) + [
            f"{100 * r.dropped_fraction:.1f}",
            pair(100 * r.dropped_fraction_longest10, 100 * r.dropped_fraction_shortest50, ".1f"),
            "-" if r.dropped.n == 0 else f"{r.dropped.mean:.0f} / {100 * r.dropped.frac_at_max:.1f}",
            f"{r.staleness_mean:.2f}", pair(r.staleness_longest10, r.staleness_shortest50, ".2f"),
            f"{100 * r.multi_version_fraction:.1f}", f"{100 * r.slot_idle_fraction:.1f}",
            f"{1000 * r.steps_per_s:.1f}",
        ] for r in results],
    )  # fmt: skip
    return lengths + "\n\n" + pipeline


# --- command line ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d = SimConfig()
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=3, help="seeds per setting (their samples are pooled)")
    p.add_argument("--partial", choices=["on", "off", "both"], default="both", help="partial rollout")
    p.add_argument("--staleness", default="0,1,2,none", help="max_staleness values, comma-separated; none = no gate")
    p.add_argument("--eager-fill", default="1,2",
                   help="also run these max_staleness values with EagerFillState (the batch rule before the fix); "
                        "'' = none")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="processes")
    for name in ("steps", "batch", "n_samples", "workers", "concurrency", "max_len", "num_prompts"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("tokens_per_s", "median_len", "prompt_sigma", "sample_sigma", "train_s", "publish_s",
                 "fetch_s", "load_s", "score_s", "latency_s"):  # fmt: skip
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    return p.parse_args(argv)


def _gates(spec: str) -> list[int]:
    return [NO_GATE if s.strip() == "none" else int(s) for s in spec.split(",") if s.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Quiet for this program and its worker processes only (never at import: a test importing this
    # module must not change the log level of the processes other tests start).
    os.environ.setdefault("VIME_LOG_LEVEL", "WARNING")
    base = SimConfig(**{k: v for k, v in vars(args).items() if k in SimConfig.__dataclass_fields__})
    partials = {"on": [True], "off": [False], "both": [True, False]}[args.partial]
    configs = [
        replace(base, partial_rollout=partial, max_staleness=gate, fill=fill)
        for partial in partials
        for fill, gates in (("broker", _gates(args.staleness)), ("eager", _gates(args.eager_fill)))
        for gate in gates
    ]
    seeds = list(range(args.seed, args.seed + args.seeds))
    started = time.perf_counter()
    results = run_settings(configs, seeds, args.jobs)
    wall = time.perf_counter() - started
    config = {k: v for k, v in asdict(base).items() if k not in ("partial_rollout", "max_staleness", "seed", "fill")}
    if args.json:
        print(json.dumps({"config": config, "seeds": seeds, "wall_s": round(wall, 2),
                          "results": [asdict(r) for r in results]}))  # fmt: skip
        return 0
    print(f"config: {config}; seeds {seeds}")
    print("lengths per sample; g / t = generated / trained; stale = policy version - oldest token version;")
    print("fill 'broker' is vime's BrokerState; 'eager (before fix)' is the bench-only EagerFillState\n")
    print(format_tables(results))
    print(f"\n{len(results)} settings x {len(seeds)} seeds in {wall:.1f} s wall ({args.jobs} processes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
