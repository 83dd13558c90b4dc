"""The broker's status: one JSON-ready dict of its queues, counters, parts and workers, for `vime status`
(over the socket, or from the snapshot file the server writes when the broker is not reachable), and
what the broker's Prometheus `/metrics` is made of (`vime.broker.prometheus`). It is read from another
thread there, so it holds copies, never the state's live containers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vime.broker.state import BrokerState


# The broker's counters, in the order `vime status` shows them (BrokerState keeps them; the parts add to them).
COUNTERS = (
    "groups_dispatched", "groups_generated", "groups_scored", "groups_trained", "groups_dropped_stale",
    "groups_failed", "groups_admitted", "groups_filtered", "groups_filter_kept", "filter_errors",
    "eval_runs_started", "eval_runs_done", "eval_groups_dispatched", "eval_groups_scored", "groups_requeued",
    "samples_failed", "late_results_dropped", "bad_messages", "unknown_peer_messages", "groups_trained_twice",
    "steps_replayed", "batches_resent", "broker_restarts",
)  # fmt: skip


def broker_status(state: BrokerState, now: float) -> dict[str, Any]:
    return {
        "weight_version": state.published_version,
        "step": state.trained_steps,
        "finished": state.finished,
        "groups_lost": state.groups_lost,
        "groups_trained_twice": state.counters["groups_trained_twice"],
        "checkpoint_steps": state.batches.checkpoint_steps,
        "admission_limit": state.admission_limit,
        "committed": state.committed,
        "metrics_url": state.metrics_url,
        "queues": {
            "eval": len(state.evals.queue),
            **state.in_flight.sizes(),
            "buffered": len(state.batches.buffer),
            "training": len(state.batches.training),
        },
        "counters": dict(state.counters),
        "messages": dict(state.received),
        # From a credit's arrival to the send of the group that spends it (vime.broker.latency).
        "dispatch_latency": state.credit_wait["rollout"].status(),
        "scoring_dispatch_latency": state.credit_wait["reward"].status(),
        # Weight versions between each trained group's oldest token and the policy that trains it.
        "staleness": state.staleness.status(),
        "dynamic_sampling": state.dynamic.status(state.settings.over_sampling_batch_size, state.over_sampling_margin),
        "eval": state.evals.status(),
        "workers": [
            {
                "worker_id": w.worker_id,
                "role": w.role,
                "credits": w.credits,
                "leased": len(w.leased),
                "weight_version": w.weight_version,
                "seconds_since_seen": round(now - w.last_seen, 3),
                "metrics_url": w.metrics_url,
                "stats": dict(w.stats),
            }
            for w in state.workers.values()
        ],
    }
