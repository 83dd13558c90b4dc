"""`vime report RUN_DIR` (vime/report.py) from synthetic run directories and from a real short run, and
`vime run`'s console: one progress line on a terminal, JSON log lines elsewhere (vime/launcher.py)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image

from vime.report import PANELS, ReportError, engine_idle, load_run, read_faults, render

from conftest import run_env

REPO = Path(__file__).resolve().parent.parent
T0 = 1_800_000_000.0  # the runs' unix start time
EMPTY_GREY = (246, 246, 246)  # the background of a panel without data (vime.report._say_empty)


def iso(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def step_line(step: int, busy_per_s: float = 0.6, **extra: Any) -> dict[str, Any]:
    """Step `step` ends at T0 + 10 + step seconds; the rollout engine was busy `busy_per_s` of each second."""
    return {
        "step": step, "weight_version": step + 1, "time": T0 + 10 + step, "rollout/raw_reward": 0.2 + 0.01 * step,
        "rollout/staleness_mean": 0.75, "rollout/staleness_max": 1.0, "train/train_rollout_logprob_abs_diff": 0.01,
        "perf/step_time": 1.0, "perf/wait_time": 0.3, "perf/train_time": 0.6, "perf/weight_sync_time": 0.05,
        "perf/rollout_busy_s_total": busy_per_s * step, **extra,
    }  # fmt: skip


def eval_line(step: int, pass1: float) -> dict[str, Any]:
    return {"step": step, "weight_version": step + 1, "time": T0 + 30, "eval/arith/pass@1": pass1, "eval/arith/pass@4": min(1.0, 2 * pass1)}


def log_line(t: float, event: str, level: str = "info", **fields: Any) -> str:
    return json.dumps({**fields, "event": event, "level": level, "timestamp": iso(t)})


def start_marker(name: str, t: float) -> str:
    return f"--- vime: {name} started {iso(t)}: python -m vime.workers.main --role x"


def make_run(
    root: Path, *, steps: int = 20, evals: bool = True, logs: bool = True, status: bool = True, drop_keys: tuple[str, ...] = (),
    config: dict[str, Any] | None = None,
) -> Path:  # fmt: skip
    """A run directory as `vime run` leaves it: one broker restart (the supervisor's), one expired worker,
    two failed groups, eval lines at steps -1, 9 and 19."""
    run = root / "run"
    (run / "logs").mkdir(parents=True)
    cfg = {"num_rollout": steps, "hf_checkpoint": "runs/demo-model", "rollout_batch_size": 4, "n_samples_per_prompt": 8,
           "max_staleness": 1, "num_rollout_workers": 1, "heartbeat_interval_s": 0.5, "rollout_engine": "hf", **(config or {})}  # fmt: skip
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [{k: v for k, v in step_line(i).items() if k not in drop_keys} for i in range(steps)]
    if evals:
        lines += [eval_line(-1, 0.1), eval_line(9, 0.3), eval_line(19, 0.5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if status:
        counters = {"groups_failed": 2, "broker_restarts": 1, "groups_trained": steps * 4}
        (run / "status.json").write_text(json.dumps({"finished": True, "counters": counters}))
    if logs:
        (run / "logs" / "launcher.log").write_text("\n".join([
            log_line(T0, "job_started", num_rollout=steps),
            log_line(T0 + 15, "child_restarted", "warning", name="broker", restarts=1),
        ]) + "\n")  # fmt: skip
        (run / "logs" / "broker.log").write_text("\n".join([
            start_marker("broker", T0), log_line(T0 + 1, "broker_started"), "Traceback (most recent call last):", "  boom",
            start_marker("broker", T0 + 15), log_line(T0 + 16, "worker_expired", "warning", worker_id="reward-0"),
        ]) + "\n")  # fmt: skip
        (run / "logs" / "rollout-0.log").write_text(start_marker("rollout-0", T0) + "\n" + log_line(T0 + 29, "generated") + "\n")
    return run


# --- the report ----------------------------------------------------------------------------------


def test_every_panel_is_filled_for_a_run_with_every_kind_of_data(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    report = render(run)
    assert list(report.panels) == list(PANELS)
    assert report.empty_panels == [], {p.name: p.note for p in report.panels.values() if not p.has_data}
    with Image.open(report.png) as image:
        assert image.format == "PNG" and image.size == (1800, 1450)
        colours = dict((rgb, n) for n, rgb in image.convert("RGB").getcolors(maxcolors=1 << 20))
    assert len(colours) > 200, "a page of panels, not a blank canvas"
    assert colours.get(EMPTY_GREY, 0) < 5000, "no panel is greyed out as empty (a few anti-aliased pixels may match)"
    assert report.png == run / "report.png"
    html = report.html.read_text()  # type: ignore[union-attr]
    assert "data:image/png;base64," in html and "NO DATA" not in html
    assert "eval: arith/pass@1 0.500 at step 19" in html, "the panel readings are in the page"
    assert report.numbers["final eval/arith/pass@1"] == "0.500 (step 19)"
    assert report.numbers["steps"] == "20 of 20" and report.numbers["state"] == "finished"


def test_a_missing_kind_of_data_yields_a_panel_that_says_so(tmp_path: Path) -> None:
    run = make_run(
        tmp_path, evals=False, logs=False, status=False,
        drop_keys=("train/train_rollout_logprob_abs_diff", "perf/rollout_busy_s_total"),
    )  # fmt: skip
    report = render(run, tmp_path / "out" / "page.png")
    assert sorted(report.empty_panels) == sorted(["eval", "logprob_diff", "engine_idle", "faults"])
    notes = {name: report.panels[name].note for name in report.empty_panels}
    assert notes["eval"].startswith("no eval lines in metrics.jsonl")
    assert "train/train_rollout_logprob_abs_diff" in notes["logprob_diff"]
    assert "perf/rollout_busy_s_total" in notes["engine_idle"]
    assert "status.json" in notes["faults"]
    assert {"reward", "staleness", "step_time"} <= {n for n, p in report.panels.items() if p.has_data}
    assert report.png == tmp_path / "out" / "page.png" and report.html == tmp_path / "out" / "page.html"
    assert report.html.read_text().count("NO DATA") == 4
    with Image.open(report.png) as image:
        assert image.size == (1800, 1450)
        colours = dict((rgb, n) for n, rgb in image.convert("RGB").getcolors(maxcolors=1 << 20))
    assert colours.get(EMPTY_GREY, 0) > 4 * 200 * 150, "each empty panel is greyed out on the page"


def test_engine_idle_is_the_share_of_wall_time_without_a_request_in_flight(tmp_path: Path) -> None:
    windows, overall = engine_idle(load_run(make_run(tmp_path / "one")))
    assert overall == pytest.approx(0.4)  # busy 0.6 s of every second, one worker
    assert windows and all(idle == pytest.approx(0.4) for _, _, idle in windows)
    assert windows[0][0] == 0 and windows[-1][1] == 19, "the windows cover the run"
    # Busy time is summed over workers: two workers busy 0.6 s a second between them are idle 70%.
    _, two = engine_idle(load_run(make_run(tmp_path / "two", config={"num_rollout_workers": 2})))
    assert two == pytest.approx(0.7)


def test_a_restarted_workers_busy_total_starting_again_is_not_negative_busy_time(tmp_path: Path) -> None:
    run = make_run(tmp_path, logs=False)
    lines = [step_line(i) for i in range(10)] + [{**step_line(i), "perf/rollout_busy_s_total": 0.6 * (i - 10)} for i in range(10, 20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    windows, overall = engine_idle(load_run(run))
    assert overall == pytest.approx(0.4) and all(0.0 <= idle <= 1.0 for _, _, idle in windows)


def test_the_time_between_a_job_and_its_resumed_launch_is_not_engine_idle_time(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    # The job stopped after step 9 and was resumed (`--load`) 100 s later; the busy total kept growing
    # (a broker that summed the old worker's stats), so only the launch says where the gap is.
    lines = [step_line(i) for i in range(10)] + [{**step_line(i), "time": T0 + 110 + i} for i in range(10, 20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with (run / "logs" / "launcher.log").open("a") as handle:
        handle.write(log_line(T0 + 115, "job_started", num_rollout=20, load="latest") + "\n")
    windows, overall = engine_idle(load_run(run))
    assert overall == pytest.approx(0.4)
    assert not any(first <= 9 and last >= 10 for first, last, _ in windows), windows
    assert read_faults(run, None).counts["resumed launches (--load)"] == 1


def test_faults_count_restarts_expirations_broker_counters_and_tracebacks(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    faults = read_faults(run, json.loads((run / "status.json").read_text()))
    counts = faults.counts
    assert counts["process restarts (supervisor)"] == 1
    assert counts["resumed launches (--load)"] == 0
    assert counts["workers expired (no heartbeat)"] == 1
    assert counts["groups failed"] == 2 and counts["broker resumed from journal"] == 1
    assert counts["tracebacks in logs"] == 1
    assert [what for _, what in faults.restarts] == ["broker"] and faults.restarts[0][0] == pytest.approx(T0 + 15)
    assert len(faults.lives["broker"]) == 2 and faults.lives["broker"][0] == (T0, T0 + 1), "a life ends at its last log line"
    assert "launcher" not in faults.lives


def test_without_the_launchers_log_restarts_come_from_the_start_markers_and_a_resume_is_not_a_restart(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    (run / "logs" / "launcher.log").unlink()
    assert read_faults(run, None).counts["process restarts (supervisor)"] == 1  # broker started twice, the rest once
    # A resumed launch (`--load`) starts every process again: that is no restart.
    (run / "logs" / "rollout-0.log").write_text(start_marker("rollout-0", T0) + "\n" + start_marker("rollout-0", T0 + 15) + "\n")
    resumed = read_faults(run, None).counts
    assert resumed["process restarts (supervisor)"] == 0 and resumed["resumed launches (--load)"] == 1


def test_a_resumed_run_counts_each_replayed_step_once(tmp_path: Path) -> None:
    run = make_run(tmp_path, evals=False)
    replayed = [step_line(i, **{"rollout/raw_reward": 0.9}) for i in (17, 18, 19)]
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in replayed))
    report = render(run, html=False)
    assert report.html is None and not (run / "report.html").exists()
    assert report.numbers["steps"] == "20 of 20"
    assert report.numbers["steps replayed after a restart"] == "3"
    assert report.numbers["final reward (last 5 mean)"] == f"{(0.2 + 0.15 + 0.2 + 0.16 + 0.9 * 3) / 5:.3f}", "a replayed step's last line counts"


def test_a_run_in_progress_with_a_half_written_line(tmp_path: Path) -> None:
    run = make_run(tmp_path, steps=30, evals=False)
    (run / "status.json").unlink()
    lines = (run / "metrics.jsonl").read_text().splitlines()[:12]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 12, "time": ')
    report = render(run)
    assert report.numbers["steps"] == "12 of 30" and report.numbers["state"].startswith("in progress")
    assert not report.panels["eval"].has_data and report.panels["reward"].has_data


def test_what_is_not_a_reportable_run_is_an_error_naming_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vime.cli import _cmd_report

    with pytest.raises(ReportError, match="not a run directory"):
        render(tmp_path)
    with pytest.raises(ReportError, match="is not a directory"):
        render(tmp_path / "absent")
    (tmp_path / "config.yaml").write_text("num_rollout: 3\n")
    with pytest.raises(ReportError, match="metrics.jsonl does not exist"):
        render(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    assert _cmd_report([str(tmp_path)]) == 2
    assert "metrics.jsonl holds no training step yet" in capsys.readouterr().err
    assert not (tmp_path / "report.png").exists()


# --- a real run ----------------------------------------------------------------------------------


@pytest.mark.e2e
def test_report_of_a_real_short_run_fills_every_panel(tmp_path: Path) -> None:
    from test_e2e import vime_run

    from vime.demo.model_factory import make_tiny_qwen3

    model = Path(make_tiny_qwen3(tmp_path / "tiny", seed=0))
    run_dir = tmp_path / "run"
    result = vime_run(
        run_dir, model, "--rollout-engine", "hf", "--num-rollout", "4", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--rollout-concurrency", "8", "--no-torch-compile",
        "--eval-interval", "2", "--eval-prompt-data", "arith", "demo:arithmetic", "--n-samples-per-eval-prompt", "1",
        "--eval-max-response-len", "4", timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, f"vime run failed:\n{result.stderr[-4000:]}"
    launcher_log = [json.loads(line) for line in (run_dir / "logs" / "launcher.log").read_text().splitlines()]
    assert [r["event"] for r in launcher_log] == ["job_started", "job_ended"] and launcher_log[-1]["exit_code"] == 0
    out = tmp_path / "report.png"
    report = subprocess.run(
        [sys.executable, "-m", "vime.cli", "report", str(run_dir), "--out", str(out)],
        cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert "NO DATA" not in report.stdout, report.stdout
    assert "faults and restarts: none recorded" in report.stdout
    page = out.with_suffix(".html").read_text()
    assert "NO DATA" not in page and page.count("<td>yes</td>") == len(PANELS)
    with Image.open(out) as image:
        assert image.size == (1800, 1450)


# --- the console progress line -------------------------------------------------------------------


PROGRESS_CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from vime import launcher
    from vime.supervisor import log as supervisor_log

    if sys.stderr.isatty():  # as run_job does before its first log line
        launcher._log_above_the_bar()
    metrics = Path(sys.argv[1])
    view = launcher.ProgressView(metrics, total=4, enabled=True)
    for step in range(4):
        with metrics.open("a") as handle:
            handle.write(json.dumps({"step": step, "rollout/raw_reward": 0.5, "perf/step_time": 0.1}) + "\\n")
        view.refresh()
        supervisor_log.warning("child_died", name="rollout-0", step=step)
    view.close()
""")


def test_on_a_terminal_progress_is_one_line_and_log_lines_go_above_it(tmp_path: Path) -> None:
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))  # 30 rows, 120 columns
    child = subprocess.Popen(
        [sys.executable, "-c", PROGRESS_CHILD, str(tmp_path / "metrics.jsonl")],
        stdin=terminal, stdout=terminal, stderr=terminal, cwd=REPO, env=run_env(),
    )  # fmt: skip
    os.close(terminal)
    chunks = []
    while True:
        ready, _, _ = select.select([controller], [], [], 60)
        assert ready, "the child wrote nothing for a minute"
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert child.wait(timeout=30) == 0, b"".join(chunks).decode(errors="replace")
    os.close(controller)
    screen = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    shown = [line.rsplit("\r", 1)[-1] for line in screen.split("\n")]  # what stays on each terminal line
    died = [line for line in shown if "child_died" in line]
    assert len(died) == 4
    assert all("vime:" not in line and "step/s" not in line for line in died), f"a log line shares a line with the bar: {died}"
    bars = [line for line in shown if line.startswith("vime:")]
    assert len(bars) == 1 and "4/4" in bars[0] and "reward=0.500" in bars[0], shown


def test_off_a_terminal_progress_is_json_log_lines(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROGRESS_CHILD, str(tmp_path / "metrics.jsonl")],
        cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr, "no bar redraws in a file"
    records = [json.loads(line) for line in result.stderr.splitlines()]  # every line is JSON
    progress = [r for r in records if r["event"] == "progress"]
    assert [r["steps"] for r in progress] == [1, 2, 3, 4] and progress[-1]["reward"] == 0.5 and progress[-1]["of"] == 4
    assert sum(r["event"] == "child_died" for r in records) == 4
