"""The broker's Prometheus metric families, made from its status snapshot (`vime.broker.status`).

The server publishes each status it builds (once a second) to a `vime.prometheus.SnapshotCollector`
over `broker_families`; a scrape turns the latest one into families in the HTTP server's thread, so
the loop never takes a lock for it. What is exported:
- `vime_broker_<counter>_total` for every status counter (groups admitted, trained, dropped, filtered,
  bad messages, broker restarts, ...) and `vime_broker_messages_total{type}` (messages handled);
- gauges: queue depths (`vime_broker_queue_groups{queue}`), weight version, step, admission limit,
  committed and lost groups, workers alive per role (`vime_broker_workers{role}`);
- per worker (labels `worker_id`, `role`; bounded by the workers, never per group): busy seconds,
  weight version and its lag behind the published one, leases, credits, groups in flight, seconds
  since it was last heard;
- histograms: the staleness of trained groups (`vime_broker_staleness_versions`) and the credit
  dispatch latency of rollout and reward work (`vime_broker_dispatch_latency_seconds{role}`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vime.prometheus import histogram_family, latency_family

ROLES = ("rollout", "reward", "trainer")
COUNTER_HELP = {
    "groups_admitted": "training groups admitted (prompts taken from the dataset)",
    "groups_dispatched": "training groups handed to rollout workers (retries included)",
    "groups_generated": "training groups generated",
    "groups_scored": "training groups scored",
    "groups_trained": "groups trained (their step finished)",
    "groups_dropped_stale": "groups dropped by the staleness gate",
    "groups_filtered": "groups dropped by the dynamic sampling filter",
    "groups_failed": "groups whose every sample failed",
    "bad_messages": "malformed, unknown or unexpected messages answered with an error",
    "broker_restarts": "times the broker resumed this job from its journal",
}


def broker_families(status: Mapping[str, Any]) -> Iterator[Metric]:
    """The metric families of one broker status (`vime.broker.status.broker_status`)."""
    for name, value in status["counters"].items():
        yield _counter(f"vime_broker_{name.removeprefix('broker_')}", COUNTER_HELP.get(name, name.replace("_", " ")), value)
    messages = CounterMetricFamily("vime_broker_messages", "messages the broker handled, by type", labels=["type"])
    for kind, n in sorted(status.get("messages", {}).items()):
        messages.add_metric([kind], n)
    yield messages
    queues = GaugeMetricFamily("vime_broker_queue_groups", "groups in each of the broker's queues", labels=["queue"])
    for queue, n in status["queues"].items():
        queues.add_metric([queue], n)
    yield queues
    yield _gauge("vime_broker_weight_version", "the newest published weight version", status["weight_version"])
    yield _gauge("vime_broker_step", "training steps done", status["step"])
    yield _gauge("vime_broker_admission_limit", "admit training groups while committed is below this", status["admission_limit"])
    yield _gauge("vime_broker_committed_groups", "training groups admitted and not dropped", status["committed"])
    yield _gauge("vime_broker_lost_groups", "open groups that are nowhere (must be 0)", status["groups_lost"])
    yield _gauge("vime_broker_finished", "1 once training finished", int(bool(status["finished"])))
    yield from _worker_families(status["workers"], status["weight_version"])
    staleness = status["staleness"]
    yield histogram_family(
        "vime_broker_staleness_versions", "weight versions between a trained group's oldest token and its policy",
        staleness["edges"], staleness["counts"], staleness["sum"],
    )  # fmt: skip
    name, doc = "vime_broker_dispatch_latency_seconds", "from a worker's credit to the dispatch of the work that spends it"
    latency = latency_family(name, doc, status["dispatch_latency"], {"role": "rollout"})
    latency.samples.extend(latency_family(name, doc, status["scoring_dispatch_latency"], {"role": "reward"}).samples)
    yield latency


def _worker_families(workers: list[Mapping[str, Any]], published: int) -> Iterator[Metric]:
    alive = GaugeMetricFamily("vime_broker_workers", "workers registered (alive: heard from within the timeout)", labels=["role"])
    for role in ROLES:
        alive.add_metric([role], sum(1 for w in workers if w["role"] == role))
    yield alive
    labels = ["worker_id", "role"]
    busy = CounterMetricFamily("vime_broker_worker_busy_seconds", "a worker's busy time, from its heartbeats", labels=labels)
    version = GaugeMetricFamily("vime_broker_worker_weight_version", "the weight version a worker holds", labels=labels)
    lag = GaugeMetricFamily("vime_broker_worker_weight_version_lag", "published weight version minus the worker's", labels=labels)
    leased = GaugeMetricFamily("vime_broker_worker_leased_groups", "groups leased to a worker", labels=labels)
    credits = GaugeMetricFamily("vime_broker_worker_credits", "a worker's unspent credits", labels=labels)
    in_flight = GaugeMetricFamily("vime_broker_worker_in_flight", "groups a worker has in flight, from its heartbeats", labels=labels)
    silent = GaugeMetricFamily("vime_broker_worker_seconds_since_seen", "seconds since the broker last heard a worker", labels=labels)
    for w in workers:
        ids = [w["worker_id"], w["role"]]
        stats = w.get("stats") or {}
        if "busy_s" in stats:
            busy.add_metric(ids, stats["busy_s"])
        if w["weight_version"] >= 0:
            version.add_metric(ids, w["weight_version"])
            lag.add_metric(ids, published - w["weight_version"])
        leased.add_metric(ids, w["leased"])
        credits.add_metric(ids, w["credits"])
        if "in_flight" in stats:
            in_flight.add_metric(ids, stats["in_flight"])
        silent.add_metric(ids, w["seconds_since_seen"])
    yield from (busy, version, lag, leased, credits, in_flight, silent)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
