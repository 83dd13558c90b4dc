"""Prometheus `/metrics` for vime's processes: one HTTP server per process, fed by snapshots.

The broker and each rollout and reward worker serve `/metrics` with prometheus_client's own HTTP
server, in a daemon thread, on `--metrics-host` and `--metrics-port` (the broker) or
`--worker-metrics-port` (each worker); port 0 lets the OS pick a free one, which is what a machine
with many workers needs: the real URL is logged (`metrics_serving`) and listed by `vime status`.
`--no-metrics` serves none.

No lock on a process's hot path: its own loop builds an immutable snapshot now and then (the broker
its status, once a second; a worker its heartbeat stats) and `SnapshotCollector.publish`es it, which
swaps one reference. A scrape turns the latest snapshot into metric families in the server's thread,
so it never reads live state and never waits for the loop; values are up to one snapshot old.

Each process serves its own `CollectorRegistry`, not prometheus_client's global one (where vLLM would
put its engine metrics). A non-loopback `--metrics-host` (0.0.0.0 for a Prometheus on another machine)
is allowed and logged as a warning: the endpoint is read-only but unauthenticated, like the reward
server's `/health`.

This module holds the shared part and the workers' families; the broker's families are in
`vime.broker.prometheus`. Names: `vime_` prefix, units in the name, `_total` for counters.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from vime.logging import get_logger
from vime.security import is_local_endpoint
from vime.slurm.network import advertised_endpoint

log = get_logger(__name__)

S = TypeVar("S")


class MetricsError(RuntimeError):
    """The /metrics server could not start (the port is taken, the host is not an address here)."""


class SnapshotCollector(Collector, Generic[S]):
    """Serves the latest published snapshot as the metric families `families` makes of it (none until
    the first publish). `families` runs in the HTTP server's thread and must only read the snapshot."""

    def __init__(self, families: Callable[[S], Iterable[Metric]]) -> None:
        self._families = families
        self._snapshot: S | None = None

    def publish(self, snapshot: S) -> None:
        """Make `snapshot` the one scrapes see. The caller must not change it afterwards."""
        self._snapshot = snapshot  # one reference store: atomic, so no lock on the caller's loop

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot
        if snapshot is not None:
            yield from self._families(snapshot)


@dataclass
class MetricsServer:
    """A running /metrics server; `url` is what scrapers (and `vime status`) use."""

    url: str
    port: int
    _httpd: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


def metrics_url(host: str, port: int) -> str:
    """The URL of /metrics served on `host:port`; a wildcard host becomes this machine's name."""
    return "http://" + advertised_endpoint(_tcp(host, port)).removeprefix("tcp://") + "/metrics"


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


def start_metrics_server(collector: Collector, host: str, port: int, *, process: str) -> MetricsServer:
    """Serve `collector` at http://host:port/metrics from a daemon thread (port 0: a free port) and log
    the real URL. Raises MetricsError when it cannot bind, naming the address."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise MetricsError(
            f"{process}: cannot serve Prometheus /metrics on {host}:{port}: {exc} "
            "(port 0 picks a free port; --no-metrics serves none)"
        ) from exc
    server = MetricsServer(url=metrics_url(host, httpd.server_port), port=httpd.server_port, _httpd=httpd, _thread=thread)
    if not is_local_endpoint(_tcp(host, server.port)):
        log.warning("metrics_on_network", url=server.url, host=host,
                    risk="anyone who can reach this address can read the job's metrics (no authentication)")  # fmt: skip
    log.info("metrics_serving", process=process, url=server.url, port=server.port)
    return server


def histogram_family(name: str, doc: str, edges: Iterable[float], counts: Iterable[int], total: float | None,
                     labels: Mapping[str, str] | None = None) -> HistogramMetricFamily:  # fmt: skip
    """A Prometheus histogram from per-bucket counts (`counts[i]`: values in (edges[i-1], edges[i]],
    one more count than edges for the values above them all), made cumulative with a `+Inf` bucket."""
    labels = dict(labels or {})
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    buckets: list[tuple[str, float]] = []
    per_bucket, seen = list(counts), 0
    for edge, count in zip(edges, per_bucket):
        seen += count
        buckets.append((floatToGoString(edge), seen))
    buckets.append(("+Inf", seen + sum(per_bucket[len(buckets) :])))
    family.add_metric(list(labels.values()), buckets, total)
    return family


def latency_family(name: str, doc: str, status: Mapping[str, Any], labels: Mapping[str, str] | None = None) -> HistogramMetricFamily:
    """A histogram in seconds from a `vime.broker.latency.LatencyHistogram.status()`."""
    edges_s = [ms / 1e3 for ms in status["edges_ms"]]
    return histogram_family(name, doc, edges_s, status["counts"], status.get("sum_s"), labels)


# --- workers ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSnapshot:
    """What a worker's /metrics shows: its heartbeat, copied when the heartbeat is sent."""

    role: str
    worker_id: str
    weight_version: int
    in_flight: int
    stats: Mapping[str, float]
    histograms: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> LatencyHistogram.status()


# Cumulative heartbeat stats each role exports as counters: stat -> (metric name without _total, help).
WORKER_COUNTERS: dict[str, dict[str, tuple[str, str]]] = {
    "rollout": {
        "groups": ("vime_rollout_groups", "training groups generated"),
        "eval_groups": ("vime_rollout_eval_groups", "eval groups generated"),
        "samples": ("vime_rollout_samples", "samples generated (training and eval)"),
        "tokens": ("vime_rollout_tokens_generated", "response tokens generated"),
        "groups_failed_in_rollout": ("vime_rollout_groups_failed", "groups whose generate function or environment failed"),
        "busy_s": ("vime_rollout_busy_seconds", "wall time with at least one group generating"),
        "updates": ("vime_rollout_weight_updates", "weight updates loaded"),
        "update_s": ("vime_rollout_weight_update_seconds", "time spent in weight updates"),
        "fetch_s": ("vime_rollout_weight_fetch_seconds", "time spent fetching weights"),
        "load_s": ("vime_rollout_weight_load_seconds", "time spent loading weights into the engine"),
        "paused_s": ("vime_rollout_paused_seconds", "time generation was paused for weight updates"),
        "update_bytes": ("vime_rollout_weight_update_bytes", "bytes of weights fetched"),
        "asleep_s": ("vime_rollout_asleep_seconds", "time the colocated engine slept while the trainer stepped"),
    },
    "trainer": {
        "steps": ("vime_trainer_steps", "training steps done by this trainer process"),
        "step_s": ("vime_trainer_step_seconds", "time spent training (waits for batches excluded)"),
        "batch_wait_s": ("vime_trainer_batch_wait_seconds", "time spent waiting for the broker's batches"),
    },
    "reward": {
        "groups": ("vime_reward_groups", "groups scored"),
        "samples": ("vime_reward_samples", "samples scored (failed ones included)"),
        "samples_failed": ("vime_reward_samples_failed", "samples the reward could not score"),
        "busy_s": ("vime_reward_busy_seconds", "wall time with at least one batch scoring"),
    },
}
# Latency histograms a worker may publish: snapshot key -> (metric name, help).
WORKER_HISTOGRAMS = {
    "score": ("vime_reward_score_seconds", "time to score one ScoreGroups message (all its groups)"),
}
# Remote reward (--rm-type remote_rm) stats that are levels, not counts: stat -> (metric name, help).
REMOTE_REWARD_GAUGES = {
    "rm_in_flight": ("vime_reward_remote_in_flight", "HTTP requests to reward servers in flight"),
    "rm_samples_waiting": ("vime_reward_remote_samples_waiting", "samples waiting for a reward server that is down"),
    "rm_outage_s": ("vime_reward_remote_outage_seconds", "how long the longest-failing reward server URL has failed"),
    "rm_limit": ("vime_reward_remote_limit", "the adaptive concurrency limits' sum"),
}


def worker_families(snapshot: WorkerSnapshot) -> Iterator[Metric]:
    """A worker's metric families (`vime_rollout_*`, `vime_reward_*`, `vime_trainer_*`); every family
    has the labels `role` and `worker_id`, so a dashboard can join them with the broker's view."""
    role, labels = snapshot.role, {"role": snapshot.role, "worker_id": snapshot.worker_id}
    names, values = list(labels), list(labels.values())

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=names)
        family.add_metric(values, value)
        return family

    yield gauge(f"vime_{role}_in_flight", "groups (rollout) or scoring tasks (reward) in flight", snapshot.in_flight)
    if role in ("rollout", "trainer"):
        yield gauge(f"vime_{role}_weight_version", "the weight version this process holds", snapshot.weight_version)
    for stat, (name, doc) in WORKER_COUNTERS.get(role, {}).items():
        if stat in snapshot.stats:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, snapshot.stats[stat])
            yield family
    remote = CounterMetricFamily("vime_reward_remote_events", "remote reward events by kind (requests, retries, failures...)",
                                 labels=[*names, "event"])  # fmt: skip
    extras = GaugeMetricFamily("vime_reward_extra_mean", "running mean of a numeric reward extra", labels=[*names, "key"])
    for stat, value in snapshot.stats.items():
        if stat in REMOTE_REWARD_GAUGES:
            yield gauge(*REMOTE_REWARD_GAUGES[stat], value)
        elif stat.startswith("rm_"):
            remote.add_metric([*values, stat.removeprefix("rm_")], value)
        elif stat.startswith("extra_mean/"):
            extras.add_metric([*values, stat.removeprefix("extra_mean/")], value)
    for family in (remote, extras):
        if family.samples:
            yield family
    for key, status in snapshot.histograms.items():
        if key in WORKER_HISTOGRAMS:
            yield latency_family(*WORKER_HISTOGRAMS[key], status, labels)


class WorkerMetrics:
    """A worker's /metrics: `start` it once the worker runs, `publish` at each heartbeat, `close` at exit.
    Publishing without a server (not started, or --no-metrics) costs one reference store."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.worker_id = ""
        self.collector: SnapshotCollector[WorkerSnapshot] = SnapshotCollector(worker_families)
        self.server: MetricsServer | None = None

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    def start(self, cfg: Any, worker_id: str) -> str | None:
        """Serve on the job's `metrics_host`:`worker_metrics_port` unless `metrics` is off; returns the
        URL (None when off). Raises MetricsError when it cannot bind."""
        self.worker_id = worker_id
        if self.server is None and cfg.metrics:
            self.server = start_metrics_server(self.collector, cfg.metrics_host, cfg.worker_metrics_port, process=self.role)
        return self.url

    def publish(self, weight_version: int, in_flight: int, stats: Mapping[str, float],
                histograms: Mapping[str, Mapping[str, Any]] | None = None) -> None:  # fmt: skip
        """`stats` must be a copy the worker no longer changes (the heartbeat's)."""
        self.collector.publish(WorkerSnapshot(self.role, self.worker_id, weight_version, in_flight, stats, histograms or {}))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    @contextlib.contextmanager
    def serving(self, cfg: Any, client: Any) -> Iterator[None]:
        """Serve while the worker runs: the URL goes into `client`'s Hello, the server stops at exit."""
        client.metrics_url = self.start(cfg, client.worker_id)
        try:
            yield
        finally:
            self.close()


__all__ = [
    "MetricsError", "MetricsServer", "SnapshotCollector", "WorkerMetrics", "WorkerSnapshot", "histogram_family",
    "latency_family", "metrics_url", "start_metrics_server", "worker_families",
]  # fmt: skip
