"""The chaos test under `vime run`: the harness only kills; the launcher's supervisor restarts (a
file of its own, so that the two chaos runs share the suite's two workers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_chaos import _run_chaos


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_random_kills_under_vime_run_are_restarted_by_its_supervisor(tmp_path: Path) -> None:
    """Two trainer ranks; besides the job kill (broker + rank 0), rank 1 alone is SIGKILLed: the
    supervisor restarts both ranks together, from the latest checkpoint."""
    summary = _run_chaos(tmp_path, "--supervised", "--trainer-ranks", "2", "--trainer-kills", "1", "--trainer-kill-rank", "1",
                         broker_kills=0)  # the job kill restarts the broker  # fmt: skip
    assert summary["supervised"] is True
    restarted = summary["restart_latency_s"]
    assert "broker" in restarted and "trainer-0" in restarted, restarted
    assert len(restarted.get("trainer-1", [])) == 2, restarted  # with rank 0 at the job kill, and killed itself
    rank1 = [f for f in summary["faults"] if f["kind"] == "trainer"]
    assert [f["target"] for f in rank1] == ["trainer-1"] and rank1[0]["survived"], rank1
