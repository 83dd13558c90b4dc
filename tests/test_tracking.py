"""Experiment tracking (vime/tracking.py): metric lines to W&B and TensorBoard, read back with their own
formats. W&B runs offline (WANDB_MODE=offline, every W&B folder in tmp_path): nothing here touches the
network. The offline run's transaction log (`run-ID.wandb`) is read with W&B's own protobuf records;
TensorBoard's event files with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import structlog

from conftest import run_env
from vime.config import VimeConfig, load_config
from vime.tracking import (
    STEP_METRIC, TensorBoardSink, TrackerNotInstalled, Trackers, TrackingError, WandbSink, open_trackers, scalars,
)  # fmt: skip

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("wandb", reason="the tracking extra is not installed (`make install` installs it)")
pytest.importorskip("tensorboard", reason="the tracking extra is not installed (`make install` installs it)")


def offline_wandb_env(root: Path) -> dict[str, str]:
    """Every W&B setting that could reach the network or the home directory, pointed offline / at `root`."""
    return {
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(root / "wandb-default"),
        "WANDB_CONFIG_DIR": str(root / "wandb-config"), "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_DATA_DIR": str(root / "wandb-data"), "WANDB_ARTIFACT_DIR": str(root / "wandb-artifacts"),
        "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
    }  # fmt: skip


@pytest.fixture(autouse=True)
def _offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for key, value in offline_wandb_env(tmp_path).items():
        monkeypatch.setenv(key, value)


def config(run_dir: Path, **overrides: Any) -> VimeConfig:
    return load_config(None, {"run_dir": run_dir, **overrides})


# --- reading W&B's offline transaction log ---------------------------------------------------------
# The log is LevelDB's log format: 32 KiB blocks of chunks (crc32c, length, type) after a 7-byte W&B
# header; each record is a serialized wandb.proto Record, split over chunks when it crosses a block.
_BLOCK, _CHUNK_HEADER, _FILE_HEADER = 32768, 7, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pending, pos = [], b"", _FILE_HEADER
    while pos + _CHUNK_HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        chunk = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            records.append(pending + chunk)
        else:  # zeroed tail of a block that was never written
            break
    out = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        out.append(record)
    return out


def wandb_runs(root: Path, wait_s: float = 60.0) -> dict[Path, list[Any]]:
    """Each offline run's transaction log under `root` (one per wandb.init), with its records. W&B's
    service process writes the log and may still be flushing it after `finish()` returns: wait (up to
    `wait_s`) for every log to end with its exit record."""
    deadline = time.monotonic() + wait_s
    while True:
        runs = {p: wandb_records(p) for p in sorted(root.rglob("offline-run-*/run-*.wandb"))}
        complete = all(any(r.WhichOneof("record_type") == "exit" for r in records) for records in runs.values())
        if complete or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


def wandb_history(records: list[Any]) -> list[dict[str, Any]]:
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def wandb_run_record(records: list[Any]) -> Any:
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert runs, "no run record"
    return runs[0]


def wandb_config(run: Any) -> dict[str, Any]:
    return {item.key: json.loads(item.value_json) for item in run.config.update}


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_text(log_dir: Path, tag: str) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [b"".join(e.tensor_proto.string_val).decode() for e in acc.Tensors(f"{tag}/text_summary")]


def line(step: int, reward: float, **extra: Any) -> dict[str, Any]:
    return {"step": step, "weight_version": step + 1, "time": 1.8e9 + step, "rollout/raw_reward": reward,
            "train/loss": -reward, **extra}  # fmt: skip


# --- the sinks -------------------------------------------------------------------------------------


def test_scalars_are_the_numeric_metrics_only() -> None:
    got = scalars({"step": 3, "time": 1.0, "train/loss": 0.5, "rollout/n": 4, "note": "text", "list": [1.0]})
    assert got == {"train/loss": 0.5, "rollout/n": 4.0}


def test_no_tracking_flag_opens_nothing_and_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    trackers = open_trackers(config(run_dir))
    assert not trackers and trackers.sinks == {}
    trackers.log(0, line(0, 0.5))
    trackers.close()
    assert not run_dir.exists()


def test_wandb_offline_run_has_every_line_at_its_training_step_and_the_config(tmp_path: Path) -> None:
    cfg = config(tmp_path / "run", use_wandb=True, wandb_mode="offline", wandb_project="proj", wandb_group="grp",
                 num_rollout=7)  # fmt: skip
    sink = WandbSink.open(cfg, continuing=False)
    for step in range(3):
        sink.log(step, line(step, reward=0.25 * step, note="not a number"))
    # Eval of the weights after step 0 arrives after step 2's line: W&B must keep it at step 0.
    sink.log(0, {"step": 0, "weight_version": 1, "time": 1.8e9, "eval/arith/score": 0.75})
    sink.close()

    runs = wandb_runs(tmp_path / "run")
    assert len(runs) == 1, runs
    records = next(iter(runs.values()))
    run = wandb_run_record(records)
    assert run.run_id == (tmp_path / "run" / "wandb_run_id").read_text().strip()
    assert (run.project, run.run_group) == ("proj", "grp")
    assert wandb_config(run)["num_rollout"] == 7
    history = wandb_history(records)
    assert [(h[STEP_METRIC], h.get("rollout/raw_reward")) for h in history] == [(0, 0), (1, 0.25), (2, 0.5), (0, None)]
    assert history[1]["train/loss"] == -0.25 and history[1]["weight_version"] == 2
    assert history[3]["eval/arith/score"] == 0.75
    assert all("note" not in h and "step" not in h and "time" not in h for h in history)
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == STEP_METRIC for m in metrics), metrics


def test_wandb_run_continues_only_for_a_continuing_trainer(tmp_path: Path) -> None:
    cfg = config(tmp_path / "run", use_wandb=True, wandb_mode="offline")
    first = WandbSink.open(cfg, continuing=False)
    first.log(0, line(0, 0.1))
    first.close()
    again = WandbSink.open(cfg, continuing=True)  # a resumed trainer (--load) of the same job
    again.log(1, line(1, 0.2))
    again.close()
    fresh = WandbSink.open(cfg, continuing=False)  # a new job in the same run dir
    fresh.close()
    steps_by_id: dict[str, list[int]] = {}
    for records in wandb_runs(tmp_path / "run").values():
        steps = [h[STEP_METRIC] for h in wandb_history(records)]
        steps_by_id.setdefault(wandb_run_record(records).run_id, []).extend(steps)
    fresh_id = (tmp_path / "run" / "wandb_run_id").read_text().strip()
    assert steps_by_id.pop(fresh_id) == []
    ((_, steps),) = steps_by_id.items()  # the first run and its continuation: one id
    assert sorted(steps) == [0, 1]


def test_wandb_run_id_flag_and_dir_are_used(tmp_path: Path) -> None:
    cfg = config(tmp_path / "run", use_wandb=True, wandb_mode="offline", wandb_run_id="myrun-01",
                 wandb_dir=tmp_path / "elsewhere")  # fmt: skip
    WandbSink.open(cfg, continuing=False).close()
    runs = wandb_runs(tmp_path / "elsewhere")
    assert [wandb_run_record(r).run_id for r in runs.values()] == ["myrun-01"]
    assert not list((tmp_path / "run").rglob("*.wandb"))


def test_wandb_run_id_flag_is_checked() -> None:
    with pytest.raises(Exception, match="W&B run id"):
        load_config(None, {"wandb_run_id": "a/b"})


def test_wandb_that_cannot_start_is_an_error_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    def refuse(**kwargs: Any) -> None:
        raise wandb.errors.CommError("no route to the server")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(TrackingError, match="no route to the server"):
        open_trackers(config(tmp_path / "run", use_wandb=True, wandb_mode="online"))


def test_tensorboard_has_every_line_at_its_step_and_the_config(tmp_path: Path) -> None:
    cfg = config(tmp_path / "run", use_tensorboard=True, num_rollout=9)
    sink = TensorBoardSink.open(cfg, continuing=False, first_step=0)
    for step in range(3):
        sink.log(step, line(step, reward=0.25 * step, note="not a number"))
    sink.log(1, {"step": 1, "time": 1.8e9, "eval/arith/score": 0.5})  # behind step 2's line
    sink.close()
    log_dir = tmp_path / "run" / "tensorboard"
    got = tensorboard_scalars(log_dir)
    assert got["rollout/raw_reward"] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert got["train/loss"] == [(0, 0.0), (1, -0.25), (2, -0.5)]
    assert got["eval/arith/score"] == [(1, 0.5)]
    assert not {"note", "step", "time"} & set(got)
    (text,) = tensorboard_text(log_dir, "config")
    assert "num_rollout: 9" in text


def test_tensorboard_project_and_experiment_name_choose_the_directory(tmp_path: Path) -> None:
    cfg = config(tmp_path / "run", use_tensorboard=True, tb_project_name=str(tmp_path / "tb"), tb_experiment_name="exp1")
    trackers = open_trackers(cfg)
    trackers.log(4, line(4, 0.5))
    trackers.close()
    assert tensorboard_scalars(tmp_path / "tb" / "exp1")["rollout/raw_reward"] == [(4, 0.5)]


def test_tensorboard_resumed_trainer_appends_and_each_step_shows_once(tmp_path: Path) -> None:
    cfg = config(tmp_path / "run", use_tensorboard=True)
    log_dir = tmp_path / "run" / "tensorboard"
    first = TensorBoardSink.open(cfg, continuing=False, first_step=0)
    for step in range(4):
        first.log(step, line(step, reward=float(step)))
    first.close()
    # Resumed from the checkpoint after step 1: steps 2 and 3 are trained again, with new values.
    resumed = TensorBoardSink.open(cfg, continuing=True, first_step=2)
    for step in range(2, 5):
        resumed.log(step, line(step, reward=10.0 + step))
    resumed.close()
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2
    assert tensorboard_scalars(log_dir)["rollout/raw_reward"] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0)]
    # A new job in the same run dir hides the old job's steps altogether.
    fresh = TensorBoardSink.open(cfg, continuing=False, first_step=0)
    fresh.log(0, line(0, reward=7.0))
    fresh.close()
    assert tensorboard_scalars(log_dir)["rollout/raw_reward"] == [(0, 7.0)]


@pytest.mark.parametrize(("flag", "hidden", "package"), [
    ("use_wandb", "wandb", "wandb"),
    ("use_tensorboard", "tensorboard", "tensorboard"),
    ("use_tensorboard", "torch.utils.tensorboard", "tensorboard"),  # torch's writer fails without tensorboard
])  # fmt: skip
def test_a_flag_whose_package_is_missing_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str, hidden: str, package: str
) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, hidden, None)  # `import hidden` now raises ImportError
    with pytest.raises(TrackerNotInstalled) as caught:
        open_trackers(config(tmp_path / "run", **{flag: True}))
    assert (caught.value.flag, caught.value.module) == ("--" + flag.replace("_", "-"), package)
    assert "pip install 'vime[tracking]'" in str(caught.value)
    assert not (tmp_path / "run").exists()


class Recording:
    def __init__(self) -> None:
        self.lines: list[tuple[int, dict[str, Any]]] = []
        self.closed = False

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.lines.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed = True


class Broken:
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        raise ConnectionError("network is down")

    def close(self) -> None:
        raise ConnectionError("network is down")


def test_a_tracker_failing_mid_run_is_warned_once_and_the_others_go_on() -> None:
    good = Recording()
    trackers = Trackers({"broken": Broken(), "good": good})
    with structlog.testing.capture_logs() as logs:
        for step in range(3):
            trackers.log(step, line(step, 0.1))
        trackers.close()
    assert [step for step, _ in good.lines] == [0, 1, 2] and good.closed
    assert trackers.failed == {"broken"}
    warnings = [e for e in logs if e["event"] == "tracker_failed"]
    assert len(warnings) == 1 and warnings[0]["tracker"] == "broken" and "network is down" in warnings[0]["error"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- a real run --------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_demo_run_writes_wandb_offline_and_tensorboard(tmp_path: Path) -> None:
    from vime.demo.model_factory import make_tiny_qwen3

    model = Path(make_tiny_qwen3(tmp_path / "model", seed=0))
    run_dir = tmp_path / "run"
    steps = 3
    argv = [
        sys.executable, "-m", "vime.cli", "run", str(REPO / "configs" / "demo.yaml"),
        "--run-dir", str(run_dir), "--hf-checkpoint", str(model), "--no-make-demo-model",
        "--broker-address", f"tcp://127.0.0.1:{free_port()}", "--no-progress", "--timeout", "200",
        "--rollout-engine", "hf", "--num-rollout", str(steps), "--rollout-batch-size", "2", "--no-torch-compile",
        "--use-wandb", "--wandb-mode", "offline", "--wandb-project", "vime-test", "--use-tensorboard",
    ]  # fmt: skip
    result = subprocess.run(argv, cwd=REPO, env=run_env(**offline_wandb_env(tmp_path)), capture_output=True,
                            text=True, timeout=240)  # fmt: skip
    assert result.returncode == 0, f"vime run failed:\n{result.stderr[-4000:]}"
    lines = [json.loads(text) for text in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(steps))

    (records,) = wandb_runs(run_dir).values()
    assert wandb_config(wandb_run_record(records))["use_wandb"] is True
    history = wandb_history(records)
    assert [h[STEP_METRIC] for h in history] == list(range(steps))
    for row, metric_line in zip(history, lines):
        assert row["rollout/raw_reward"] == pytest.approx(metric_line["rollout/raw_reward"])
        assert row["train/loss"] == pytest.approx(metric_line["train/loss"])

    board = tensorboard_scalars(run_dir / "tensorboard")
    assert [step for step, _ in board["rollout/raw_reward"]] == list(range(steps))
    assert [v for _, v in board["rollout/raw_reward"]] == pytest.approx([m["rollout/raw_reward"] for m in lines])
    assert {"train/loss", "perf/step_time"} <= set(board)
