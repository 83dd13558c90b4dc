"""bench/broker_scale.py in its quick form: the real broker process with simulated workers, end to end.

Checks what must hold whatever the machine's speed (timing goals live in the bench, not here): the last
line is the JSON summary with the figures the issue asks for, groups went all the way to the trainer,
none was lost or trained twice, no worker got an error reply, and every credit a worker granted is
accounted for (dispatched to it, or still held by the broker).
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, run_env


def test_quick_broker_scale_run_moves_groups_end_to_end_and_accounts_for_every_credit() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "broker_scale.py"), "--quick", "--json"],
        cwd=REPO, env=run_env(VIME_LOG_LEVEL="WARNING"), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("messages_per_s", "p99_dispatch_ms_half_load", "rollout_workers", "groups_per_s", "broker_peak_rss_mib"):
        assert key in summary, key
    assert summary["rollout_workers"] == 20 and summary["reward_workers"] == 4
    assert summary["groups_trained"] > 0
    assert summary["groups_lost"] == 0
    assert summary["zmq_pipe_probe"]["peers"] == 25 and summary["zmq_peer_steady_kib"] > 0, summary["zmq_pipe_probe"]
    # The probe's baseline message is handshake-sized, the rest as large as the shape's group on the wire
    # (libzmq's batch buffers are touched as far as the largest message reaches).
    probe = summary["zmq_pipe_probes"]["demo"]
    assert probe["first_message_bytes"] == 100 and probe["message_bytes"] == summary["points"][0]["group_bytes"], probe
    assert {p["load"] for p in summary["points"]} == {"full", "half"}
    for point in summary["points"]:
        assert point["checks"]["groups_lost_zero"] and point["checks"]["trained_twice_zero"], point["checks"]
        assert point["groups_trained_total"] > 0, point
        assert point["checks"]["no_error_replies"], point
        assert point["checks"]["dispatches_matched_credits"], point
        for role, credits in point["credits"].items():
            assert credits["granted"] == credits["dispatched"] + credits["held_by_broker"], (role, credits)
        assert point["messages_per_s"] > 0 and point["dispatch_samples"] > 0
        assert point["broker_dispatch_samples"] > 0 and point["broker_dispatch_p99_ms"] is not None, point
        assert point["group_decoded_bytes"] > point["group_bytes"], "decoded objects cost more than their bytes"
        # The bound adds libzmq's per-peer cost (the pipe probe's) to the buffered groups'.
        assert point["broker_rss_bound_mib"] >= point["broker_rss_bound_buffer_only_mib"], point
    assert summary["ok"]
