"""`vime-reward-server` as a real process on 127.0.0.1: every format, the built-in and custom rewards,
the token, bad requests, and a `vime run` job training against it through the reward worker's client.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from pydantic import SecretStr

from test_e2e import free_port, logged_events, read_jsonl, tiny_model, vime_run  # noqa: F401  (tiny_model is a fixture)
from vime.rewards.remote import RemoteReward, RemoteRewardSettings
from vime.rewards.wire import ScoreItem

REPO = Path(__file__).resolve().parent.parent
TOKEN = "test-token-123"

CUSTOM = '''
import asyncio

def judge(prompt, response, label, metadata):
    if response == "explode":
        raise ValueError("judge cannot read this")
    return {"score": float(response.strip() == label) + metadata.get("bonus", 0.0), "length": len(response)}

async def async_len(prompt, response, label, metadata):
    await asyncio.sleep(0)
    return len(response)
'''


class Server:
    """A started `bin/vime-reward-server`; `url` is its base address."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.log = tmp / f"server-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            [str(REPO / "bin" / "vime-reward-server"), "--port", "0", *args],
            stdout=subprocess.DEVNULL, stderr=self.log.open("wb"), env=env or _env(), cwd=tmp,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self._wait_port()}"
        self._wait_healthy()

    def _wait_port(self, timeout_s: float = 60) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log.read_text().splitlines():
                if '"reward_server_listening"' in line:
                    return int(json.loads(line)["port"])
            if self.proc.poll() is not None:
                raise RuntimeError(f"vime-reward-server exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"vime-reward-server did not start:\n{self.log.read_text()[-3000:]}")

    def _wait_healthy(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.health()
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
        raise RuntimeError("vime-reward-server never answered /health")

    def health(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/health", timeout=10) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VIME_RM_TOKEN"}
    env["VIME_LOG_LEVEL"] = "INFO"  # the server announces its port in an info line
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("reward_server")
    (tmp / "judges.py").write_text(CUSTOM)
    srv = Server(
        tmp, "--custom-rm-path", "judge=judges.py:judge", "--custom-rm-path", "alen=judges.py:async_len",
        "--max-batch", "50", "--math-workers", "1", env=_env(VIME_RM_TOKEN=TOKEN),
    )  # fmt: skip
    yield srv
    srv.stop()


def post(url: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def score(url: str, fmt: str, batch: list[ScoreItem], token: str | None = TOKEN, **kw):
    settings = RemoteRewardSettings(
        urls=[url], fmt=fmt, token=SecretStr(token) if token else None, retries=1, backoff_initial_s=0.01, **kw
    )

    async def go():
        async with RemoteReward(settings) as rm:
            return await rm.score_batch(batch), rm.stats()

    return asyncio.run(go())


def item(response: str, label: str | None, prompt: str = "q", **metadata) -> ScoreItem:
    return ScoreItem(f"id{time.monotonic_ns()}", prompt, response, label, metadata)


# -------------------------------------------------------------------------------------------- tests


def test_health_needs_no_token_and_lists_what_is_served(server: Server) -> None:
    health = server.health()
    assert health["status"] == "ok" and health["auth"] is True
    assert {"arithmetic", "math", "gsm8k", "dapo", "boxed_math", "judge", "alen"} <= set(health["rewards"])
    assert health["formats"] == ["slime", "openrlhf", "vime"] and health["vime_versions"] == [1]


BUILTIN_CASES = [
    ("arithmetic", "46", "46", 1.0),
    ("arithmetic", "47", "46", 0.0),
    ("gsm8k", "so she has 3 + 4 = 7 eggs.\n#### 7", "Janet's ducks...\n#### 7", 1.0),
    ("gsm8k", "#### 8", "7", 0.0),
    ("dapo", "work\nAnswer: \\frac{1}{2}", "0.5", 1.0),
    ("dapo", "Answer: 3", "4", -1.0),
    ("boxed_math", "thus $\\boxed{\\frac{2}{4}}$", "\\frac{1}{2}", 1.0),
    ("math", "the answer is \\boxed{12}", "12", 1.0),
]


@pytest.mark.parametrize("fmt", ["slime", "openrlhf", "vime"])
def test_builtin_rewards_in_every_format(server: Server, fmt: str) -> None:
    for name, response, label, expected in BUILTIN_CASES:
        results, _ = score(f"{server.url}/{fmt}/{name}", fmt, [item(response, label)])
        assert not results[0].failed, (name, results[0].reason)
        assert results[0].reward == expected, (fmt, name, response, label)


def test_dapo_extras_travel_in_the_batch_formats(server: Server) -> None:
    for fmt in ("openrlhf", "vime"):
        results, _ = score(f"{server.url}/{fmt}/dapo", fmt, [item("Answer: 5", "5"), item("Answer: 6", "5")])
        assert [r.reward for r in results] == [1.0, -1.0]
        assert [bool(r.extra["acc"]) for r in results] == [True, False]


def test_custom_functions_by_path_sync_and_async(server: Server) -> None:
    batch = [item("7", "7"), item("8", "7"), item("7", "7", bonus=0.5)]
    results, _ = score(f"{server.url}/vime/judge", "vime", batch)
    assert [r.reward for r in results] == [1.0, 0.0, 1.5]  # metadata reaches the function (vime format)
    assert results[0].extra == {"length": 1}
    picked, _ = score(f"{server.url}/slime/judge", "slime", [item("7", "7")])
    assert picked[0].reward == 1.0
    lengths, _ = score(f"{server.url}/openrlhf/alen", "openrlhf", [item("abc", None, prompt="p:"), item("", None)])
    assert [r.reward for r in lengths] == [3.0, 0.0]  # the response is split back out of prompt + response


def test_unscorable_samples_are_failed_with_the_reason_in_every_format(server: Server) -> None:
    for fmt in ("slime", "openrlhf", "vime"):
        batch = [item("explode", "7"), item("7", "7")]
        results, stats = score(f"{server.url}/{fmt}/judge", fmt, batch)
        assert results[0].failed and "judge cannot read this" in results[0].reason, fmt
        assert not results[1].failed and results[1].reward == 1.0, fmt
        assert stats["rm_samples_failed"] == stats["rm_samples_failed_unscorable"] == 1
        assert stats.get("rm_retries", 0) == 0  # the server is fine: nothing to retry
        missing, _ = score(f"{server.url}/{fmt}/gsm8k", fmt, [item("#### 3", None)])
        assert missing[0].failed and "no label" in missing[0].reason, fmt


def test_wrong_or_missing_token_is_refused_and_reported(server: Server) -> None:
    for token in ("wrong", None):
        # max_wait_s=0: fail at once; the reward worker would wait (and warn) until the token works.
        results, stats = score(f"{server.url}/slime/arithmetic", "slime", [item("1", "1")], token=token, max_wait_s=0.0)
        assert results[0].failed and "HTTP 401" in results[0].reason and "bearer token" in results[0].reason
        assert stats["rm_requests"] == 1  # not retried
    status, body = post(f"{server.url}/slime/arithmetic", b'{"prompt": "", "response": "1", "label": "1"}', token="nope")
    assert status == 401 and "token" in body["error"]


def test_bad_requests_get_json_errors(server: Server) -> None:
    status, body = post(f"{server.url}/vime/arithmetic", b'{"version": 1, "samples": [')
    assert status == 400 and "malformed JSON" in body["error"]
    status, body = post(f"{server.url}/openrlhf/arithmetic", b'{"query": ["a"], "labels": ["1", "2"]}')
    assert status == 400 and "labels" in body["error"]
    status, body = post(f"{server.url}/vime/arithmetic", b'{"version": 9, "samples": []}')
    assert status == 400 and "version 9" in body["error"]
    status, body = post(f"{server.url}/slime/nonesuch", b'{"prompt": "", "response": "1"}')
    assert status == 404 and "arithmetic" in body["error"]
    many = json.dumps({"query": ["1"] * 51}).encode()
    status, body = post(f"{server.url}/openrlhf/arithmetic", many)
    assert status == 413 and "--max-batch 50" in body["error"]
    # The slime format is parsed whatever Content-Type the client sent (urllib sends a form type).
    status, body = post(f"{server.url}/slime/arithmetic", b'{"prompt": "1+1=", "response": "2", "label": "2"}')
    assert status == 200 and body == 1.0


def test_a_bad_custom_path_stops_the_server_at_start(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(REPO / "bin" / "vime-reward-server"), "--port", "0", "--custom-rm-path", "nowhere.py:fn"],
        capture_output=True, text=True, timeout=60, env=_env(), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "custom reward file not found: nowhere.py" in proc.stderr


@pytest.mark.e2e
def test_vime_run_trains_against_the_reward_server(
    server: Server, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """Two reward workers, the vime format, and a dead second URL that retries route around."""
    monkeypatch.setenv("VIME_RM_TOKEN", TOKEN)  # the launcher's children inherit it
    before = server.health()["counters"].get("samples", 0)
    dead = f"http://127.0.0.1:{free_port()}/vime/arithmetic"
    run_dir = tmp_path / "run"
    steps = 3
    result = vime_run(
        run_dir, tiny_model, "--rm-type", "remote_rm", "--rm-url", f"{server.url}/vime/arithmetic,{dead}",
        "--rm-format", "vime", "--rm-batch-size", "16", "--rm-retries", "3", "--num-reward-workers", "2",
        "--rollout-engine", "hf", "--num-rollout", str(steps), "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--no-torch-compile", timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, f"vime run failed:\n{result.stderr[-4000:]}"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    status = json.loads((run_dir / "status.json").read_text())
    assert status["counters"]["groups_trained"] == steps * 4
    assert status["counters"]["samples_failed"] == 0  # the dead URL cost retries, not samples
    served = server.health()["counters"]["samples"] - before
    assert served >= steps * 4 * 4
    reward_workers = [w for w in status["workers"] if w.get("role") == "reward"]
    assert len(reward_workers) == 2
    retried = [e for i in range(2) for e in logged_events(run_dir / "logs" / f"reward-{i}.log", "reward_request_retry")]
    assert retried and all(e["url"] == dead for e in retried)  # the dead URL was tried, and routed around
