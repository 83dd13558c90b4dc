"""Prometheus /metrics on the broker and the workers, scraped over HTTP.

One pipeline runs for the module: a real broker (metrics on), a real rollout worker (a stub engine that
answers "2" with two tokens) and a real reward worker (the arithmetic reward), both serving their own
/metrics, and a simulated trainer that takes one batch. The tests then scrape the three endpoints and
check the values against what the pipeline did, that `vime status` lists the URLs, and that every
expression of the Grafana dashboard names a metric these endpoints export.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from vime.broker.client import BrokerClient, query_status
from vime.broker.prometheus import broker_families
from vime.broker.server import BrokerServer
from vime.broker.settings import BrokerSettings
from vime.broker.state import BrokerState
from vime.config import load_config, parse_config
from vime.data.prompts import Prompt, PromptCursor
from vime.prometheus import MetricsError, SnapshotCollector, WorkerMetrics, metrics_url, start_metrics_server
from vime.protocol.codec import decode, encode
from vime.protocol.messages import BatchRequest, Hello, TrainBatch, Welcome
from vime.rollout import GeneratedSample, SamplingConfig
from vime.workers.reward import RewardWorker
from vime.workers.rollout import RolloutWorker

from helpers_engines import StubEngine

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "docs" / "grafana" / "vime-dashboard.json"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class AnswersTwo(StubEngine):
    """Every sample is the two tokens [5, 6], text "2", made by weight version 0."""

    async def generate(self, prompt_tokens: list[int], n: int, sampling: SamplingConfig) -> list[GeneratedSample]:
        return [
            GeneratedSample(
                response_tokens=np.array([5, 6], dtype=np.int32), rollout_logprobs=np.zeros(2, dtype=np.float32),
                loss_mask=np.ones(2, dtype=np.uint8), token_versions=np.zeros(2, dtype=np.int32), finish_reason="stop",
                response_text="2",
            )
            for _ in range(n)
        ]  # fmt: skip


class WorkerThread:
    """A worker's session on its own event loop and thread, cancelled by `stop`."""

    def __init__(self, session: Callable[[], Awaitable[int]]) -> None:
        self.loop = asyncio.new_event_loop()
        self.task: asyncio.Future[int] | None = None
        self.thread = threading.Thread(target=self._run, args=(session,), daemon=True)
        self.thread.start()

    def _run(self, session: Callable[[], Awaitable[int]]) -> None:
        async def main() -> None:
            self.task = asyncio.ensure_future(session())
            try:
                await self.task
            except asyncio.CancelledError:
                pass

        self.loop.run_until_complete(main())

    def stop(self) -> None:
        if self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(timeout=15)


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def wait_for_scrape(url: str, done: Callable[[Samples], bool], timeout_s: float = 30.0) -> Samples:
    """Scrape until `done` holds (snapshots are published about once a second / once a heartbeat)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if done(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} never showed what the test waited for; last scrape: {sorted(samples)[:40]}")
        time.sleep(0.1)


def wait_for(what: str, condition: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return result


@pytest.fixture(scope="module")
def pipeline() -> Iterator[dict[str, Any]]:
    prompts = [Prompt(i, "1+1=", np.array([1, 2], dtype=np.int32), "2") for i in range(8)]
    # Two groups per step, staleness 0: admission lets exactly one step's two groups through.
    settings = BrokerSettings(2, 2, 0, 1, 10, 30.0, {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4})
    state = BrokerState(settings, PromptCursor(prompts, shuffle=False, seed=0))
    collector: SnapshotCollector[dict[str, Any]] = SnapshotCollector(broker_families)
    broker_metrics = start_metrics_server(collector, "127.0.0.1", 0, process="broker")
    state.metrics_url = broker_metrics.url
    server = BrokerServer(state, "tcp://127.0.0.1:*", metrics=collector)
    endpoint = server.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    broker_thread = threading.Thread(target=server.serve, daemon=True)
    broker_thread.start()

    trainer = zmq.Context.instance().socket(zmq.DEALER)
    trainer.setsockopt(zmq.IDENTITY, b"trainer-0")
    trainer.setsockopt(zmq.LINGER, 0)
    trainer.connect(endpoint)
    trainer.send_multipart(encode(Hello(role="trainer", worker_id="trainer-0")))
    assert trainer.poll(5000) and isinstance(decode(trainer.recv_multipart()), Welcome)
    trainer.send_multipart(encode(BatchRequest(step=0, n_groups=2, policy_version=0)))

    cfg = load_config(None, {"heartbeat_interval_s": 0.2, "rollout_concurrency": 4, "reward_concurrency": 4})
    workers: dict[str, Any] = {}

    async def rollout_session() -> int:
        client = BrokerClient(endpoint, "rollout", "rollout-1", broker_timeout_s=30.0)
        workers["rollout"] = RolloutWorker(cfg, AnswersTwo(), client)
        return await client.run_session(workers["rollout"].run())

    async def reward_session() -> int:
        client = BrokerClient(endpoint, "reward", "reward-1", broker_timeout_s=30.0)
        workers["reward"] = RewardWorker(cfg, client)
        return await client.run_session(workers["reward"].run())

    threads = [WorkerThread(rollout_session), WorkerThread(reward_session)]
    try:
        batch = None
        deadline = time.monotonic() + 60
        while batch is None and time.monotonic() < deadline:
            if trainer.poll(100):
                msg = decode(trainer.recv_multipart(copy=False))
                batch = msg if isinstance(msg, TrainBatch) else None
        assert batch is not None and len(batch.groups) == 2, "the trainer got no batch"
        rollout_url = wait_for("the rollout worker's /metrics", lambda: workers["rollout"].metrics.url)
        reward_url = wait_for("the reward worker's /metrics", lambda: workers["reward"].metrics.url)
        yield {
            "endpoint": endpoint,
            "state": state,
            "broker_url": broker_metrics.url,
            "rollout_url": rollout_url,
            "reward_url": reward_url,
            # Waited for until the last counts of the pipeline are in each process's snapshot.
            "broker": wait_for_scrape(broker_metrics.url, lambda s: value(s, "vime_broker_staleness_versions_count") == 2),
            "rollout": wait_for_scrape(rollout_url, lambda s: value(s, "vime_rollout_groups_total", role="rollout", worker_id="rollout-1") == 2),
            "reward": wait_for_scrape(reward_url, lambda s: value(s, "vime_reward_groups_total", role="reward", worker_id="reward-1") == 2),
        }  # fmt: skip
    finally:
        for thread in threads:
            thread.stop()
        trainer.close()
        server.stop()
        broker_thread.join(timeout=10)
        broker_metrics.close()


def test_the_broker_exports_what_the_pipeline_did(pipeline: dict[str, Any]) -> None:
    s = pipeline["broker"]
    assert value(s, "vime_broker_groups_admitted_total") == 2
    assert value(s, "vime_broker_groups_generated_total") == 2
    assert value(s, "vime_broker_groups_scored_total") == 2
    assert value(s, "vime_broker_bad_messages_total") == 0
    assert value(s, "vime_broker_messages_total", type="Hello") == 3
    assert value(s, "vime_broker_messages_total", type="GroupsGenerated") == 2
    assert value(s, "vime_broker_messages_total", type="BatchRequest") == 1
    # The batch went out: the buffer is empty, its groups are in training.
    assert value(s, "vime_broker_queue_groups", queue="buffered") == 0
    assert value(s, "vime_broker_queue_groups", queue="training") == 2
    assert value(s, "vime_broker_workers", role="rollout") == 1
    assert value(s, "vime_broker_workers", role="reward") == 1
    assert value(s, "vime_broker_workers", role="trainer") == 1
    # Both groups were generated on version 0 and trained by policy 0: staleness 0.
    assert value(s, "vime_broker_staleness_versions_bucket", le="0.0") == 2
    assert value(s, "vime_broker_staleness_versions_bucket", le="+Inf") == 2
    assert value(s, "vime_broker_staleness_versions_sum") == 0
    # One credit spent per group, by each role: cumulative buckets ending at the count.
    for role in ("rollout", "reward"):
        assert value(s, "vime_broker_dispatch_latency_seconds_count", role=role) == 2
        assert value(s, "vime_broker_dispatch_latency_seconds_bucket", role=role, le="+Inf") == 2
        buckets = sorted(
            (float(dict(labels)["le"]), v) for (name, labels), v in s.items()
            if name == "vime_broker_dispatch_latency_seconds_bucket" and dict(labels)["role"] == role
        )  # fmt: skip
        assert [v for _, v in buckets] == sorted(v for _, v in buckets), "buckets are cumulative"
        assert value(s, "vime_broker_dispatch_latency_seconds_sum", role=role) > 0


def test_the_broker_exports_each_workers_liveness_busy_time_and_weight_version(pipeline: dict[str, Any]) -> None:
    s = pipeline["broker"]
    rollout, reward = {"worker_id": "rollout-1", "role": "rollout"}, {"worker_id": "reward-1", "role": "reward"}
    assert value(s, "vime_broker_worker_weight_version", **rollout) == 0
    assert value(s, "vime_broker_worker_weight_version_lag", **rollout) == 0
    assert value(s, "vime_broker_worker_weight_version", **reward) is None  # a reward worker holds no weights
    for worker in (rollout, reward):
        assert value(s, "vime_broker_worker_busy_seconds_total", **worker) is not None
        assert value(s, "vime_broker_worker_seconds_since_seen", **worker) < 30
        assert value(s, "vime_broker_worker_leased_groups", **worker) == 0
    assert value(s, "vime_broker_worker_credits", **rollout) == 4  # concurrency 4, every group returned its credit
    assert value(s, "vime_broker_worker_leased_groups", worker_id="trainer-0", role="trainer") == 0


def test_each_worker_serves_its_own_metrics(pipeline: dict[str, Any]) -> None:
    rollout = {"role": "rollout", "worker_id": "rollout-1"}
    s = pipeline["rollout"]
    assert value(s, "vime_rollout_groups_total", **rollout) == 2
    assert value(s, "vime_rollout_samples_total", **rollout) == 4
    assert value(s, "vime_rollout_tokens_generated_total", **rollout) == 8  # 2 groups x 2 samples x 2 tokens
    assert value(s, "vime_rollout_weight_version", **rollout) == 0
    assert value(s, "vime_rollout_busy_seconds_total", **rollout) > 0
    reward = {"role": "reward", "worker_id": "reward-1"}
    s = pipeline["reward"]
    assert value(s, "vime_reward_groups_total", **reward) == 2
    assert value(s, "vime_reward_samples_total", **reward) == 4
    assert value(s, "vime_reward_samples_failed_total", **reward) == 0
    # Each ScoreGroups message is timed: one or two messages carried the two groups.
    assert value(s, "vime_reward_score_seconds_count", **reward) in (1, 2)


def test_status_lists_the_metrics_urls_of_the_broker_and_each_worker(pipeline: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    status = query_status(pipeline["endpoint"])
    assert status["metrics_url"] == pipeline["broker_url"]
    by_id = {w["worker_id"]: w for w in status["workers"]}
    assert by_id["rollout-1"]["metrics_url"] == pipeline["rollout_url"]
    assert by_id["reward-1"]["metrics_url"] == pipeline["reward_url"]
    assert by_id["trainer-0"]["metrics_url"] is None  # its Hello named none
    from vime.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--broker-address", pipeline["endpoint"]])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"metrics  {pipeline['broker_url']}" in out
    assert f"metrics={pipeline['rollout_url']}" in out and f"metrics={pipeline['reward_url']}" in out
    port = int(pipeline["broker_url"].rsplit(":", 1)[1].split("/")[0])
    assert port > 0 and pipeline["broker_url"] == f"http://127.0.0.1:{port}/metrics"


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def test_the_grafana_dashboard_only_queries_metrics_that_are_exported(pipeline: dict[str, Any]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = {name for key in ("broker", "rollout", "reward") for name, _ in pipeline[key]}
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert dashboard["schemaVersion"] >= 39
    queried: set[str] = set()
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert len({p["id"] for p in _panels(dashboard)}) == len(list(_panels(dashboard))), "panel ids are unique"
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bvime_[a-z0-9_]+", target["expr"]))
            assert names, f"{panel['title']}: {target['expr']} names no vime metric"
            assert names <= exported, f"{panel['title']}: not exported: {sorted(names - exported)}"
            queried |= names
    # The panels the issue asks for are there.
    titles = " | ".join(p["title"].lower() for p in panels)
    for needed in ("throughput", "queue", "staleness", "dispatch latency", "workers alive", "busy", "weight version lag"):
        assert needed in titles, needed
    assert any("histogram_quantile(0.99" in t["expr"] for p in panels for t in p["targets"])


def test_a_worker_with_metrics_off_serves_none_and_says_so() -> None:
    cfg = load_config(None, {"metrics": False})
    metrics = WorkerMetrics("reward")
    assert metrics.start(cfg, "reward-x") is None and metrics.server is None
    metrics.publish(-1, 0, {"groups": 1.0})  # publishing without a server is harmless
    metrics.close()


def test_a_taken_port_fails_naming_the_address_and_a_wildcard_url_names_the_host() -> None:
    first = start_metrics_server(SnapshotCollector(broker_families), "127.0.0.1", 0, process="broker")
    try:
        with pytest.raises(MetricsError, match=f"127.0.0.1:{first.port}"):
            start_metrics_server(SnapshotCollector(broker_families), "127.0.0.1", first.port, process="broker")
    finally:
        first.close()
    assert metrics_url("0.0.0.0", 9400) == f"http://{socket.gethostname()}:9400/metrics"
    assert metrics_url("::1", 9400) == "http://[::1]:9400/metrics"


def test_the_metrics_flags() -> None:
    cfg, _ = parse_config(["--no-metrics", "--metrics-port", "9400", "--worker-metrics-port", "0", "--metrics-host", "0.0.0.0"])
    assert (cfg.metrics, cfg.metrics_port, cfg.worker_metrics_port, cfg.metrics_host) == (False, 9400, 0, "0.0.0.0")
    default = load_config(None, {})
    assert (default.metrics, default.metrics_port, default.metrics_host) == (True, 0, "127.0.0.1")


def test_hello_with_and_without_a_metrics_url_decodes_on_either_side() -> None:
    import msgspec

    from vime.protocol.codec import PROTOCOL_VERSION, ProtocolError

    class OldHello(msgspec.Struct, tag="hello", tag_field="type", kw_only=True):  # a broker from before the field
        role: str
        worker_id: str
        host: str = ""
        pid: int = 0
        weight_version: int = -1
        info: dict[str, Any] = {}

    new = encode(Hello(role="rollout", worker_id="w", metrics_url="http://h:1/metrics"))
    version, old = msgspec.msgpack.decode(new[0], type=tuple[int, OldHello])
    assert version == PROTOCOL_VERSION and old.worker_id == "w"  # the new field is ignored, not an error
    from_old_worker = [msgspec.msgpack.encode((PROTOCOL_VERSION, OldHello(role="reward", worker_id="r")))]
    hello = decode(from_old_worker, (Hello,))
    assert isinstance(hello, Hello) and hello.metrics_url is None
    with pytest.raises(ProtocolError, match="metrics_url"):
        decode(encode(Hello(role="rollout", worker_id="w", metrics_url="x" * 600)), (Hello,))


def test_a_trainer_publishing_its_steps_is_scraped_with_its_own_names() -> None:
    """What the trainer's wiring (rank 0) will serve: its steps, step time and weight version."""
    metrics = WorkerMetrics("trainer")
    url = metrics.start(load_config(None, {}), "trainer-0")
    try:
        assert url is not None and url.startswith("http://127.0.0.1:")
        metrics.publish(3, 0, {"steps": 2.0, "step_s": 1.5, "batch_wait_s": 0.25})
        s = scrape(url)
        labels = {"role": "trainer", "worker_id": "trainer-0"}
        assert value(s, "vime_trainer_steps_total", **labels) == 2
        assert value(s, "vime_trainer_step_seconds_total", **labels) == 1.5
        assert value(s, "vime_trainer_weight_version", **labels) == 3
    finally:
        metrics.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)  # closed: nothing serves there any more


def test_scrapes_and_the_broker_loop_run_side_by_side(pipeline: dict[str, Any]) -> None:
    """Scrapes hammering /metrics neither block nor are blocked by the loop answering status requests
    (the loop only swaps a snapshot reference; a lock shared with the scrape would show up here)."""
    scraped: list[Samples] = []
    scraper = threading.Thread(target=lambda: scraped.extend(scrape(pipeline["broker_url"]) for _ in range(20)), daemon=True)
    scraper.start()
    answered = [query_status(pipeline["endpoint"], timeout_s=10)["step"] for _ in range(20)]
    scraper.join(timeout=60)
    assert answered == [0] * 20
    assert len(scraped) == 20 and all(value(s, "vime_broker_groups_admitted_total") == 2 for s in scraped)
