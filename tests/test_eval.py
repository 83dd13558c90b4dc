"""Evaluation: pass@k by hand, the eval tracker, eval groups in the broker (dispatched first, scored,
never trained, finish waits for them), eval sets, and the whole pipeline with eval and dynamic sampling.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from vime.broker.settings import BrokerSettings
from vime.broker.state import BrokerState
from vime.config import ConfigError, load_config, parse_config
from vime.data.prompts import DEMO_EVAL_PROMPTS, Prompt, PromptCursor, load_eval_prompts, load_prompts
from vime.eval import EvalSet, EvalTracker, PromptOutcome, is_eval_step, ks_for, mean_pass_at_k, pass_at_k, summarize_set
from vime.protocol.messages import DispatchGroups, EvalResult, Group, GroupScores, Sample, ScoreGroups, Shutdown, TrainBatch

ROLLOUT, ROLLOUT2, REWARD, TRAINER = b"r1", b"r2", b"w1", b"t0"


# --- pass@k ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (4, 1, 1, 1 / 4),
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (4, 1, 4, 1.0),  # n - c < k: every 4-subset holds the correct one
        (4, 2, 2, 1 - 1 / 6),  # 1 - C(2,2)/C(4,2)
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (8, 0, 8, 0.0),
        (8, 8, 1, 1.0),
    ],
)
def test_pass_at_k_by_hand(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_the_fraction_correct_and_bad_arguments_are_refused() -> None:
    for n in range(1, 9):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_reported_k_and_prompts_with_too_few_samples() -> None:
    assert ks_for(1) == [1] and ks_for(3) == [1, 2, 3] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]
    assert mean_pass_at_k([(4, 1), (1, 1)], 2) == pytest.approx(0.5), "the one-sample prompt is left out of pass@2"
    assert mean_pass_at_k([(1, 1)], 2) is None


def outcome(rewards: list[float], failed: int = 0, versions: tuple[int, int] = (3, 3)) -> PromptOutcome:
    return PromptOutcome(rewards, failed, [2] * len(rewards), 0, *versions)


def test_set_metrics_by_hand() -> None:
    # Prompt A: 1 of 4 correct; prompt B: 2 of 4; prompt C: 1 correct of 1 scored (3 failed).
    metrics = summarize_set("arith", [outcome([1, 0, 0, 0]), outcome([1, 1, 0, 0], versions=(3, 4)), outcome([1.0], failed=3)], 4, 1.0)
    assert metrics["eval/arith/pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 1) / 3)
    assert metrics["eval/arith/pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert metrics["eval/arith/pass@4"] == pytest.approx(1.0)
    assert metrics["eval/arith/reward_mean"] == pytest.approx(4 / 9)
    assert metrics["eval/arith/samples_failed"] == 3 and metrics["eval/arith/num_prompts"] == 3
    assert metrics["eval/arith/weight_version_min"] == 3 and metrics["eval/arith/weight_version_max"] == 4
    dapo = summarize_set("m", [outcome([1.0, -1.0])], 2, 1.0)
    assert dapo["eval/m/pass@1"] == 0.5 and dapo["eval/m/reward_mean"] == 0.0, "pass@k uses the raw reward's threshold"


# --- the tracker and the broker --------------------------------------------------------------------


def eval_prompts(n: int = 3) -> list[Prompt]:
    return [Prompt(i, f"{i}+2=", np.array([i, 11], dtype=np.int32), str(i + 2)) for i in range(n)]


def test_schedule() -> None:
    assert [s for s in range(-1, 40) if is_eval_step(s, 10, True)] == [-1, 9, 19, 29, 39]
    assert [s for s in range(-1, 40) if is_eval_step(s, 10, False)] == [9, 19, 29, 39]
    assert not any(is_eval_step(s, None, True) for s in range(-1, 40))


def test_tracker_runs_are_started_once_and_reported_when_all_groups_are_scored() -> None:
    tracker = EvalTracker([EvalSet("a", eval_prompts(2)), EvalSet("b", eval_prompts(1))], n_samples=2, interval=5,
                          before_train=True, threshold=1.0, num_rollout=10)  # fmt: skip
    assert tracker.start(3, 1, now=0.0) == [], "step 3 is not due"
    groups = tracker.start(4, 5, now=1.0)
    assert [g.group_id for g in groups] == ["eval-s4-a-p0", "eval-s4-a-p1", "eval-s4-b-p0"]
    assert all(g.kind == "eval" and g.min_weight_version == 5 and g.n_samples == 2 for g in groups)
    assert tracker.start(4, 5, now=1.0) == [], "a re-announced version starts no second run"
    for g in groups[:2]:
        assert tracker.record(generate(g, 5, rewards=[1.0, 0.0]), now=2.0)
    assert tracker.pop_finished() == [] and tracker.busy
    tracker.record(generate(groups[2], 5, rewards=[1.0, 1.0]), now=3.5)
    [result] = tracker.pop_finished()
    assert (result.step, result.weight_version) == (4, 5)
    assert result.metrics["eval/a/pass@1"] == 0.5 and result.metrics["eval/b/pass@2"] == 1.0
    assert result.metrics["eval/time_s"] == 2.5
    assert tracker.busy, "the final step's run (step 9) is still to come"
    assert not tracker.record(groups[0], now=4.0), "a late duplicate is ignored"


def generate(group: Group, version: int, rewards: list[float] | None = None, length: int = 3) -> Group:
    group.samples = [
        Sample(
            index=i, response_tokens=np.ones(length, dtype=np.int32), rollout_logprobs=np.zeros(length, dtype=np.float32),
            loss_mask=np.ones(length, dtype=np.uint8), token_versions=np.full(length, version, dtype=np.int32), finish_reason="stop",
            reward=None if rewards is None else rewards[i],
        )  # fmt: skip
        for i in range(group.n_samples)
    ]
    return group


def make_state(num_rollout: int = 4, interval: int = 2, before_train: bool = True, staleness: int = 1) -> BrokerState:
    prompts = [Prompt(i, f"{i}+1=", np.array([i, 10], dtype=np.int32), str(i + 1)) for i in range(50)]
    settings = BrokerSettings(
        rollout_batch_size=2, n_samples_per_prompt=2, max_staleness=staleness, update_weights_interval=1,
        num_rollout=num_rollout, worker_timeout_s=10.0, sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 4},
        eval_interval=interval, eval_before_train=before_train, n_samples_per_eval_prompt=4,
        eval_sampling={"temperature": 0.6, "top_p": 1.0, "max_tokens": 8},
    )  # fmt: skip
    state = BrokerState(settings, PromptCursor(prompts, shuffle=False, seed=0), eval_sets=[EvalSet("arith", eval_prompts(3))])
    state.register(ROLLOUT, "rollout-1", "rollout", now=0.0)
    state.register(REWARD, "reward-1", "reward", now=0.0)
    state.register(TRAINER, "trainer-0", "trainer", now=0.0)
    state.add_credit(REWARD, 1000)
    return state


def dispatched(out: list) -> list[Group]:
    return [g for _, msg in out if isinstance(msg, DispatchGroups) for g in msg.groups]


def score(state: BrokerState, reward_of=lambda g, i: float(i % 2), now: float = 0.0) -> list[Group]:
    groups = [g for _, msg in state.dispatch_scoring() if isinstance(msg, ScoreGroups) for g in msg.groups]
    scores = [GroupScores(group_id=g.group_id, rewards=[reward_of(g, i) for i in range(len(g.samples))],
                          failed=[False] * len(g.samples), reasons=[None] * len(g.samples)) for g in groups]  # fmt: skip
    state.on_scored(REWARD, scores, now)
    return groups


def test_job_info_carries_eval_sampling() -> None:
    assert make_state().job_info().eval_sampling == {"temperature": 0.6, "top_p": 1.0, "max_tokens": 8}


def test_eval_groups_go_first_are_outside_admission_and_are_never_trained() -> None:
    state = make_state(staleness=0)
    state.on_weights_published(0, "tcp://w:1", step=-1, now=10.0)  # the initial weights: baseline run
    assert len(state.evals.queue) == 3 and state.counters["eval_runs_started"] == 1
    state.add_credit(ROLLOUT, 4)
    first = dispatched(state.dispatch())
    assert [g.kind for g in first] == ["eval", "eval", "eval", "train"], "eval first, then training work"
    assert state.committed == 1, "eval groups take no training slot"
    assert state.admission_limit == 2
    evals, train = first[:3], first[3]
    # A worker that returns an eval group labelled as training data does not make it training data.
    returned = generate(evals[0], 0)
    returned.kind = "train"
    state.on_generated(ROLLOUT, [returned, generate(evals[1], 0), generate(evals[2], 0), generate(train, 0)])
    score(state, reward_of=lambda g, i: 1.0 if i == 0 else 0.0, now=11.5)
    assert list(state.batches.buffer) == [train.group_id], "only the training group is buffered"
    [(identity, result)] = state.poll_evals()
    assert identity == TRAINER and isinstance(result, EvalResult)
    assert (result.step, result.weight_version) == (-1, 0)
    assert result.metrics["eval/arith/pass@1"] == 0.25 and result.metrics["eval/arith/pass@4"] == 1.0
    assert result.metrics["eval/arith/weight_version_max"] == 0 and result.metrics["eval/time_s"] == 1.5
    status = state.status(now=12.0)
    assert status["eval"]["runs_done"] == 1 and status["eval"]["last"]["eval/arith/pass@1"] == 0.25
    assert status["counters"]["eval_groups_scored"] == 3 and status["counters"]["groups_scored"] == 1


def test_a_dead_workers_eval_groups_are_redispatched_as_eval() -> None:
    state = make_state()
    state.on_weights_published(0, "tcp://w:1", step=-1)
    state.add_credit(ROLLOUT, 2)
    taken = dispatched(state.dispatch())
    assert [g.kind for g in taken] == ["eval", "eval"]
    state.register(ROLLOUT2, "rollout-2", "rollout", now=5.0)
    state.remove_worker(ROLLOUT)
    requeued = [g.group_id for g in state.evals.queue]
    assert sorted(requeued[:2]) == sorted(g.group_id for g in taken) and requeued[2] == "eval-s-1-arith-p2"
    assert state.committed == 0
    state.add_credit(ROLLOUT2, 10)
    again = dispatched(state.dispatch())
    assert [g.kind for g in again[:3]] == ["eval"] * 3 and all(g.min_weight_version == 0 for g in again[:3])


def run_training(state: BrokerState, steps: range) -> None:
    """Train `steps` with whatever work the broker hands out; eval work is generated and scored too."""
    for step in steps:
        state.request_batch(TRAINER, step, 2, policy_version=step, now=float(step))
        for _ in range(100):
            state.add_credit(ROLLOUT, 10)
            for g in dispatched(state.dispatch()):
                state.on_generated(ROLLOUT, [generate(g, state.published_version)])
            score(state)
            out = state.try_fill_batch(float(step))
            if out:
                break
        batch = out[0][1]
        assert isinstance(batch, TrainBatch) and all(g.kind == "train" and not g.group_id.startswith("eval") for g in batch.groups)
        state.on_step_done(step, [g.group_id for g in batch.groups])
        state.on_weights_published(step + 1, "tcp://w:1", step=step)


def test_the_job_finishes_only_after_the_final_steps_eval_is_delivered() -> None:
    state = make_state(num_rollout=4, interval=2)
    state.on_weights_published(0, "tcp://w:1", step=-1)
    run_training(state, range(3))
    results = state.poll_evals()
    assert sorted(m.step for _, m in results if isinstance(m, EvalResult)) == [-1, 1]
    # Last step: StepDone arrives before the weights (and so the final eval) are published.
    state.request_batch(TRAINER, 3, 2, policy_version=3, now=3.0)
    state.add_credit(ROLLOUT, 10)
    for g in dispatched(state.dispatch()):
        state.on_generated(ROLLOUT, [generate(g, 3)])
    score(state)
    batch = state.try_fill_batch(3.0)[0][1]
    assert state.on_step_done(3, [g.group_id for g in batch.groups]) == [], "the final eval is still to come"
    assert state.training_done and not state.finished
    state.on_weights_published(4, "tcp://w:1", step=3)
    state.add_credit(ROLLOUT, 10)
    final = dispatched(state.dispatch())
    assert [g.kind for g in final] == ["eval"] * 3, "no training work after the last step, only its eval"
    assert state.poll_evals() == []
    for g in final:
        state.on_generated(ROLLOUT, [generate(g, 4)])
    score(state)
    out = state.poll_evals()
    assert isinstance(out[0][1], EvalResult) and (out[0][1].step, out[0][1].weight_version) == (3, 4)
    assert {identity for identity, msg in out[1:] if isinstance(msg, Shutdown)} == {ROLLOUT, REWARD, TRAINER}
    assert state.finished
    assert state.counters["groups_trained"] == 8 and state.counters["eval_runs_done"] == 3


def test_without_a_final_eval_the_job_finishes_at_the_last_step() -> None:
    state = make_state(num_rollout=3, interval=2, before_train=False)
    run_training(state, range(2))
    state.poll_evals()
    state.request_batch(TRAINER, 2, 2, policy_version=2, now=2.0)
    state.add_credit(ROLLOUT, 10)
    for g in dispatched(state.dispatch()):
        state.on_generated(ROLLOUT, [generate(g, 2)])
    score(state)
    batch = state.try_fill_batch(2.0)[0][1]
    out = state.on_step_done(2, [g.group_id for g in batch.groups]) + state.poll_evals()
    assert state.finished and {i for i, m in out if isinstance(m, Shutdown)} == {ROLLOUT, REWARD, TRAINER}
    assert state.counters["eval_runs_started"] == state.counters["eval_runs_done"] == 1


def test_results_wait_for_a_trainer_to_be_connected() -> None:
    state = make_state()
    state.remove_worker(TRAINER)
    state.on_weights_published(0, "tcp://w:1", step=-1)
    state.add_credit(ROLLOUT, 3)
    for g in dispatched(state.dispatch()):
        state.on_generated(ROLLOUT, [generate(g, 0)])
    score(state)
    assert state.poll_evals() == [] and len(state.evals.outbox) == 1
    state.register(TRAINER, "trainer-0", "trainer", now=1.0)
    assert [m.step for _, m in state.poll_evals()] == [-1]


# --- config and eval sets ------------------------------------------------------------------------


def test_eval_flags(tmp_path: Path) -> None:
    cfg, _ = parse_config([
        "--eval-interval", "10", "--eval-prompt-data", "arith", "demo:arithmetic", "gsm", "data/gsm.jsonl",
        "--n-samples-per-eval-prompt", "4", "--eval-temperature", "0.6", "--rollout-max-response-len", "7",
    ])  # fmt: skip
    assert cfg.eval_prompt_data == {"arith": "demo:arithmetic", "gsm": "data/gsm.jsonl"}
    assert cfg.eval_sampling == {"temperature": 0.6, "top_p": 1.0, "max_tokens": 7}, "max length defaults to training's"
    assert load_config(None, json.loads(json.dumps(cfg.model_dump(mode="json")))).eval_prompt_data == cfg.eval_prompt_data
    settings = BrokerSettings.from_config(cfg)
    assert settings.eval_interval == 10 and settings.eval_sampling["temperature"] == 0.6 and settings.n_samples_per_eval_prompt == 4
    yaml_cfg = tmp_path / "c.yaml"
    yaml_cfg.write_text("eval_interval: 5\neval_prompt_data:\n  arith: demo:arithmetic\n")
    assert load_config(yaml_cfg).eval_prompt_data == {"arith": "demo:arithmetic"}
    with pytest.raises(ConfigError, match="NAME PATH pairs"):
        load_config(None, {"eval_prompt_data": ["arith"]})
    with pytest.raises(ConfigError, match="needs eval_prompt_data"):
        load_config(None, {"eval_interval": 10})
    with pytest.raises(ConfigError, match="multiple of update_weights_interval"):
        load_config(None, {"eval_interval": 3, "update_weights_interval": 2, "eval_prompt_data": {"a": "demo:arithmetic"}})
    with pytest.raises(ConfigError, match="eval set name"):
        load_config(None, {"eval_prompt_data": {"a/b": "x.jsonl"}})


def test_eval_sets_are_read_like_training_data_and_the_demo_set_is_held_out(tmp_path: Path) -> None:
    from vime.demo.tokenizer import load_tokenizer, save_tokenizer

    tokenizer = load_tokenizer(save_tokenizer(tmp_path / "tok"))
    data = tmp_path / "held.jsonl"
    data.write_text('{"question": "2+2=", "answer": "4"}\n')
    cfg = load_config(None, {"eval_prompt_data": {"mine": str(data)}, "input_key": "question", "label_key": "answer"})
    sets = load_eval_prompts(cfg, tokenizer)
    assert [p.text for p in sets["mine"]] == ["2+2="] and sets["mine"][0].label == "4"
    cfg_demo = load_config(None, {"eval_prompt_data": {"arith": "demo:arithmetic"}})
    held_out = {p.text for p in load_eval_prompts(cfg_demo, tokenizer)["arith"]}
    assert len(held_out) == DEMO_EVAL_PROMPTS
    training = {p.text for p in load_prompts(cfg_demo, tokenizer)}
    assert len(held_out & training) <= 2, "drawn with another seed: (almost) no training problem"
    with pytest.raises(ConfigError, match="eval set 'bad'"):
        load_eval_prompts(load_config(None, {"eval_prompt_data": {"bad": str(tmp_path / "none.jsonl")}}), tokenizer)


# --- the whole pipeline --------------------------------------------------------------------------


@pytest.mark.e2e
def test_pipeline_with_eval_and_dynamic_sampling(tmp_path: Path) -> None:
    """`vime run` with the transformers engine and a reward with spread (the tiny random model solves
    no arithmetic): eval lines at the scheduled steps with pass@k, filtered groups counted, every step
    trained on kept groups only, and the summary/plot handling both kinds of lines."""
    from test_e2e import read_jsonl, vime_run

    from vime.demo.model_factory import make_tiny_qwen3

    model = Path(make_tiny_qwen3(tmp_path / "tiny", seed=0))
    # Spread within most groups (response length parity), none in groups whose answer is a multiple of 3
    # (about a third of the prompts): the filter must drop some groups in every run, not only by chance
    # (with parity alone a run without any all-equal group of 4 happened about 1 time in 25).
    reward = tmp_path / "odd_length.py"
    reward.write_text(
        "def score(prompt, response, label, metadata):\n"
        "    return 1.0 if int(label) % 3 == 0 else float(len(response) % 2)\n"
    )
    run_dir = tmp_path / "run"
    steps = 6
    result = vime_run(
        run_dir, model, "--rollout-engine", "hf", "--num-rollout", str(steps), "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--rollout-concurrency", "8", "--rm-type", "custom", "--custom-rm-path", f"{reward}:score",
        "--dynamic-sampling-filter-path", "check_reward_nonzero_std", "--over-sampling-batch-size", "6",
        "--eval-interval", "3", "--eval-prompt-data", "arith", "demo:arithmetic", "--n-samples-per-eval-prompt", "2",
        "--eval-max-response-len", "4", "--no-torch-compile", timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, f"vime run failed:\n{result.stderr[-4000:]}"
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if "rollout/raw_reward" in r]
    evals = sorted((r for r in records if any(k.startswith("eval/") for k in r)), key=lambda r: r["step"])
    assert [r["step"] for r in train] == list(range(steps))
    assert [(r["step"], r["weight_version"]) for r in evals] == [(-1, 0), (2, 3), (5, 6)]
    for r in evals:
        assert 0.0 <= r["eval/arith/pass@1"] <= r["eval/arith/pass@2"] <= 1.0
        assert r["eval/arith/num_prompts"] == DEMO_EVAL_PROMPTS
        assert r["eval/arith/response_len"] <= 4, "eval sampling's max length, not training's"
        assert r["eval/arith/weight_version_min"] >= r["weight_version"]
    for r in train:
        assert r["rollout/zero_std_group_ratio"] == 0.0, "a filtered group reached the trainer"
        assert "rollout/dynamic_filter_dropped" in r and "rollout/over_sampling_margin" in r
    status = json.loads((run_dir / "status.json").read_text())
    c = status["counters"]
    assert c["groups_trained"] == steps * 4 and c["eval_runs_done"] == 3
    assert c["groups_filtered"] == status["dynamic_sampling"]["dropped"] > 0
    assert c["groups_admitted"] >= c["groups_trained"] + c["groups_filtered"] + c["groups_failed"] + c["groups_dropped_stale"]
    assert "eval at step 5" in result.stderr + result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and [e["step"] for e in summary["eval"]] == [-1, 2, 5]
    assert math.isfinite(summary["reward_last5"])


# --- the rollout worker holds an eval run's weights ----------------------------------------------


class FakeEngine:
    """Generation blocks until released; updates jump to the requested version."""

    def __init__(self, version: int) -> None:
        import asyncio

        self.weight_version = version
        self.asleep = False
        self.release = asyncio.Event()
        self.calls: list[tuple[str, int, float]] = []  # (kind, version at start, temperature)

    async def generate(self, prompt_tokens, n, sampling):  # type: ignore[no-untyped-def]
        from vime.rollout import GeneratedSample

        started = self.weight_version
        self.calls.append(("generate", started, sampling.temperature))
        await self.release.wait()
        return [GeneratedSample(np.array([5], np.int32), np.zeros(1, np.float32), np.ones(1, np.uint8),
                                np.array([started], np.int32), "stop") for _ in range(n)]  # fmt: skip

    async def update_weights(self, version, endpoint):  # type: ignore[no-untyped-def]
        from vime.rollout import WeightUpdateResult

        self.calls.append(("update", version, 0.0))
        self.weight_version = version
        return WeightUpdateResult(version=version, requested_version=version)


class FakeClient:
    def __init__(self) -> None:
        self.sent: list = []

    async def send(self, msg) -> None:  # type: ignore[no-untyped-def]
        self.sent.append(msg)


def test_an_eval_group_holds_weight_updates_until_it_is_generated(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from vime.rollout import SamplingConfig
    from vime.workers import rollout
    from vime.workers.rollout import RolloutWorker

    # The run's second group comes 20 ms after the first ends; a grace of 1 s (not the shipped 0.25 s)
    # keeps a loaded machine's scheduling delays from outlasting it.
    monkeypatch.setattr(rollout, "EVAL_HOLD_GRACE_S", 1.0)

    async def scenario() -> None:
        engine, client = FakeEngine(version=3), FakeClient()
        worker = RolloutWorker(load_config(None, {}), engine, client)  # type: ignore[arg-type]
        worker.sampling = SamplingConfig(temperature=1.0, max_tokens=4)
        worker.eval_sampling = SamplingConfig(temperature=0.25, max_tokens=4)
        updater = asyncio.create_task(worker._update_loop())
        prompt = np.array([1, 2], dtype=np.int32)
        eval_group = Group(group_id="eval-s2-a-p0", prompt_index=0, epoch=0, prompt_tokens=prompt, prompt_text="x",
                           n_samples=2, min_weight_version=3, kind="eval")  # fmt: skip
        train_group = Group(group_id="e0-p9", prompt_index=9, epoch=0, prompt_tokens=prompt, prompt_text="x", n_samples=2, min_weight_version=4)
        eval_task = asyncio.create_task(worker._generate_group(eval_group))
        await asyncio.sleep(0.01)
        worker._note_version(4, "tcp://w:1")  # the trainer published v4 while the eval generates on v3
        train_task = asyncio.create_task(worker._generate_group(train_group))
        await asyncio.sleep(0.05)  # only gives a broken hold the time to let the update through
        assert engine.calls == [("generate", 3, 0.25)], "no update while the eval run holds v3; training waits"
        engine.release.set()
        await asyncio.wait_for(eval_task, 5)
        # The run's next group arrives a round trip later: the hold's grace keeps v3 for it too.
        second = Group(group_id="eval-s2-a-p1", prompt_index=1, epoch=0, prompt_tokens=prompt, prompt_text="y",
                       n_samples=2, min_weight_version=3, kind="eval")  # fmt: skip
        await asyncio.sleep(0.02)
        await asyncio.wait_for(worker._generate_group(second), 5)
        await asyncio.wait_for(train_task, 30)
        assert engine.calls == [("generate", 3, 0.25), ("generate", 3, 0.25), ("update", 4, 0.0), ("generate", 4, 1.0)]
        assert [int(s.token_versions[0]) for s in eval_group.samples + second.samples] == [3, 3, 3, 3]
        assert worker.stats["eval_groups"] == 2 and worker.stats["groups"] == 1 and worker.unpinned.is_set()
        updater.cancel()

    asyncio.run(scenario())
