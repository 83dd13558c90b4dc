"""The chaos test under `vime run`: the harness only kills; the launcher's supervisor restarts (a
file of its own, so that the two chaos runs share the suite's two workers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_chaos import _run_chaos


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_random_kills_under_vime_run_are_restarted_by_its_supervisor(tmp_path: Path) -> None:
    summary = _run_chaos(tmp_path, "--supervised", broker_kills=0)  # the job kill restarts the broker
    assert summary["supervised"] is True
    restarted = summary["restart_latency_s"]
    assert "broker" in restarted and "trainer-0" in restarted, restarted
