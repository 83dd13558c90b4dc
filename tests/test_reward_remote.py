"""The reward worker's remote client against real HTTP server processes that misbehave on purpose.

Run as a script, this file *is* that server (`python tests/test_reward_remote.py`): plain asyncio on
127.0.0.1, port printed on stdout. It scores every sample as `len(response)` in whichever format the body
is (slime, openrlhf or vime) and misbehaves by path:

    /ok                         answer correctly
    /dict                       slime: answer {"score": len, "acc": 10 * len}
    /fail/MODE                  always misbehave
    /flaky/KEY/N/MODE           misbehave on the first N requests under KEY, then answer correctly
    /stats                      (GET) requests seen per path

MODE: slow (answer after 5 s), 500, drop (close the connection without a reply), malformed (truncated
JSON with status 200), short (a reply with too few rewards), 401.

Each test states the documented outcome (docs/reward-servers.md): a sample whose reward cannot be had
is a failed result with a reason and a failure kind, counted; none is lost or scored silently.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from vime.rewards.remote import RemoteReward, RemoteRewardSettings, distinct_items
from vime.rewards.types import RewardResult
from vime.rewards.wire import ReplyError, ScoreItem, decode_reply, encode_reply, encode_request

from conftest import run_env

HERE = Path(__file__).resolve()


# ------------------------------------------------------------------------------ the misbehaving server


def _score(body: dict) -> tuple[int, object]:
    """Reward = len(response), in the body's own format."""
    if "samples" in body:
        results = [{"id": s["id"], "reward": float(len(s["response"])), "extra": {"len": len(s["response"])}} for s in body["samples"]]
        return 200, {"version": 1, "results": results}
    if "query" in body:
        prompts = body.get("prompts") or [""] * len(body["query"])
        rewards = [float(len(q) - len(p)) for q, p in zip(body["query"], prompts)]
        return 200, {"rewards": rewards, "scores": rewards, "extra_logs": {"len": rewards}}
    return 200, float(len(body["response"]))


async def _serve_forever() -> None:
    seen: Counter[str] = Counter()

    async def reply(writer: asyncio.StreamWriter, status: int, payload: bytes) -> None:
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        writer.write(head.encode() + payload)
        await writer.drain()

    async def misbehave(mode: str, writer: asyncio.StreamWriter, body: dict) -> bool:
        """Act out `mode`; False when the connection is gone."""
        if mode == "slow":
            await asyncio.sleep(5)
            status, payload = _score(body)
            await reply(writer, status, json.dumps(payload).encode())
        elif mode == "500":
            await reply(writer, 500, b'{"error": "internal trouble"}')
        elif mode == "401":
            await reply(writer, 401, b'{"error": "missing or wrong bearer token"}')
        elif mode == "drop":
            writer.close()
            return False
        elif mode == "malformed":
            await reply(writer, 200, b'{"rewards": [1.0, ')
        elif mode == "short":
            await reply(writer, 200, json.dumps({"rewards": [], "version": 1, "results": []}).encode())
        return True

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                parts = path.strip("/").split("/")
                seen["/".join(parts[:2])] += 1
                if method == "GET" and parts[0] == "stats":
                    await reply(writer, 200, json.dumps(seen).encode())
                    continue
                body = json.loads(raw or b"{}")
                mode = None
                if parts[0] == "fail":
                    mode = parts[1]
                elif parts[0] == "flaky":
                    key, n, flaky_mode = parts[1], int(parts[2]), parts[3]
                    counts = flaky_counts.setdefault(key, 0)
                    flaky_counts[key] = counts + 1
                    mode = flaky_mode if counts < n else None
                if mode is not None:
                    if not await misbehave(mode, writer, body):
                        return
                    continue
                if parts[0] == "dict":
                    await reply(writer, 200, json.dumps({"score": float(len(body["response"])), "acc": 10.0 * len(body["response"])}).encode())
                    continue
                status, payload = _score(body)
                await reply(writer, status, json.dumps(payload).encode())
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    flaky_counts: dict[str, int] = {}
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fault_server() -> str:
    env = run_env()  # the script imports vime like the tests do
    proc = subprocess.Popen([sys.executable, str(HERE)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def server_stats(base: str) -> Counter[str]:
    with urllib.request.urlopen(f"{base}/stats", timeout=10) as resp:
        return Counter(json.loads(resp.read()))


def settings(*urls: str, **kw) -> RemoteRewardSettings:
    """Fast retries so the fault cases take fractions of a second; a breaker only where a test wants one.
    `max_wait_s=0`: a request that fails after its retries fails its samples at once, so these tests see
    how each fault is classified (the reward worker instead waits for the server: test_reward_outage.py)."""
    base = dict(urls=list(urls), timeout_s=2.0, retries=2, backoff_initial_s=0.01, backoff_max_s=0.05, breaker_failures=1000,
                max_wait_s=0.0)  # fmt: skip
    base.update(kw)
    return RemoteRewardSettings(**base)


def items(n: int, prefix: str = "s") -> list[ScoreItem]:
    return [ScoreItem(f"{prefix}{i}", "prompt: ", "x" * (i + 1), str(i + 1)) for i in range(n)]


def score(s: RemoteRewardSettings, batch: list[ScoreItem]) -> tuple[list[RewardResult], dict[str, float]]:
    async def go():
        async with RemoteReward(s) as rm:
            return await rm.score_batch(batch), rm.stats()

    return asyncio.run(go())


# ----------------------------------------------------------------------------------- correct replies


@pytest.mark.parametrize("fmt", ["slime", "openrlhf", "vime"])
def test_every_format_maps_rewards_to_their_samples(fault_server: str, fmt: str) -> None:
    batch = items(7)
    results, stats = score(settings(f"{fault_server}/ok", fmt=fmt, batch_size=3), batch)
    assert [r.reward for r in results] == [float(i + 1) for i in range(7)]
    assert not any(r.failed for r in results)
    assert stats["rm_requests"] == (7 if fmt == "slime" else 3)  # slime: one per sample; others: batches of 3
    if fmt != "slime":
        assert results[2].extra["len"] == 3  # other fields travel as extras


@pytest.mark.parametrize("fmt", ["slime", "openrlhf", "vime"])
def test_identical_samples_go_to_the_server_once(fault_server: str, fmt: str) -> None:
    """A group that repeats answers: each distinct sample is sent once and every copy gets its reward."""
    repeated = [ScoreItem(f"d{i}", "prompt: ", "x" * (1 + i % 3), str(1 + i % 3)) for i in range(9)]
    path = f"ok/dedupe-{fmt}"
    results, stats = score(settings(f"{fault_server}/{path}", fmt=fmt, batch_size=2), repeated)
    assert [r.reward for r in results] == [float(1 + i % 3) for i in range(9)]
    assert stats["rm_samples_deduplicated"] == 6 and stats["rm_samples"] == 9
    assert server_stats(fault_server)[path] == (3 if fmt == "slime" else 2)  # 3 distinct: 3 posts, or batches of 2


def test_without_dedupe_or_with_other_metadata_every_sample_is_sent(fault_server: str) -> None:
    same = [ScoreItem(f"s{i}", "prompt: ", "xx", "2") for i in range(4)]
    results, stats = score(settings(f"{fault_server}/ok/no-dedupe", dedupe=False), same)
    assert [r.reward for r in results] == [2.0] * 4 and "rm_samples_deduplicated" not in stats
    assert server_stats(fault_server)["ok/no-dedupe"] == 4
    turns = [ScoreItem(f"t{i}", "prompt: ", "xx", "2", {"turn": i}) for i in range(3)] + [ScoreItem("t9", "prompt: ", "xx", "2", {"turn": 0})]
    results, stats = score(settings(f"{fault_server}/ok/metadata"), turns)
    assert [r.reward for r in results] == [2.0] * 4 and stats["rm_samples_deduplicated"] == 1
    assert server_stats(fault_server)["ok/metadata"] == 3


def test_items_whose_metadata_cannot_be_keyed_are_never_merged() -> None:
    odd = {1: "a", "b": 2}  # json.dumps(sort_keys=True) cannot order int and str keys
    batch = [ScoreItem("a", "p", "r", "l", odd), ScoreItem("b", "p", "r", "l", odd), ScoreItem("c", "p", "r", "l"), ScoreItem("d", "p", "r", "l")]
    distinct, twin_of = distinct_items(batch)
    assert [i.id for i in distinct] == ["a", "b", "c"] and twin_of == [0, 1, 2, 2]


def test_reward_key_picks_a_field_of_a_dict_reward(fault_server: str) -> None:
    plain, _ = score(settings(f"{fault_server}/dict"), items(2))
    assert [r.reward for r in plain] == [1.0, 2.0] and plain[1].extra == {"acc": 20.0}
    picked, _ = score(settings(f"{fault_server}/dict", reward_key="acc"), items(2))
    assert [r.reward for r in picked] == [10.0, 20.0] and picked[1].extra == {"score": 2.0}
    missing, _ = score(settings(f"{fault_server}/dict", reward_key="nope"), items(1))
    assert missing[0].failed and "'nope'" in missing[0].reason


def test_several_urls_share_the_load(fault_server: str) -> None:
    before = server_stats(fault_server)
    results, _ = score(settings(f"{fault_server}/ok/a", f"{fault_server}/ok/b", concurrency=4), items(40))
    assert not any(r.failed for r in results)
    after = server_stats(fault_server)
    a, b = after["ok/a"] - before["ok/a"], after["ok/b"] - before["ok/b"]
    assert a + b == 40 and a > 0 and b > 0


def test_two_clients_at_once_like_two_reward_workers(fault_server: str) -> None:
    async def go():
        async with RemoteReward(settings(f"{fault_server}/ok", fmt="vime", batch_size=4)) as one, RemoteReward(
            settings(f"{fault_server}/ok")
        ) as two:
            return await asyncio.gather(one.score_batch(items(20, "p")), two.score_batch(items(20, "q")))

    first, second = asyncio.run(go())
    assert [r.reward for r in first] == [r.reward for r in second] == [float(i + 1) for i in range(20)]


# -------------------------------------------------------------------------------------- fault cases


def test_slow_server_times_out_and_is_retried_then_fails_with_reason(fault_server: str) -> None:
    results, stats = score(settings(f"{fault_server}/fail/slow", timeout_s=0.3, retries=1), items(2))
    assert all(r.failed for r in results)
    assert all("did not answer within 0.3s" in r.reason and r.extra["reward_error"] == "timeout" for r in results)
    assert stats["rm_requests"] == 4 and stats["rm_retries"] == 2  # 2 samples x (1 try + 1 retry)
    assert stats["rm_samples_failed_timeout"] == 2


def test_a_slow_first_attempt_is_retried_and_the_sample_scored(fault_server: str) -> None:
    # The retry must be answered within timeout_s: 1.5 s leaves a loaded machine room, and still ends
    # the 5 s slow attempt long before it would answer.
    results, stats = score(settings(f"{fault_server}/flaky/slow1/1/slow", timeout_s=1.5), items(1))
    assert not results[0].failed and results[0].reward == 1.0
    assert stats["rm_retries"] == 1


def test_http_500_is_retried_then_fails_with_reason(fault_server: str) -> None:
    results, stats = score(settings(f"{fault_server}/fail/500", fmt="vime", retries=2), items(3))
    assert all(r.failed and "HTTP 500" in r.reason and "internal trouble" in r.reason for r in results)
    assert stats["rm_requests"] == 3 and stats["rm_samples_failed_http_5xx"] == 3  # one batch, 3 tries


def test_transient_500s_are_absorbed_by_retries(fault_server: str) -> None:
    results, stats = score(settings(f"{fault_server}/flaky/five/2/500", fmt="openrlhf", retries=3), items(4))
    assert [r.reward for r in results] == [1.0, 2.0, 3.0, 4.0] and not any(r.failed for r in results)
    assert stats["rm_retries"] == 2


def test_dropped_connections_are_retried_then_fail_with_reason(fault_server: str) -> None:
    results, stats = score(settings(f"{fault_server}/fail/drop"), items(2))
    assert all(r.failed and r.extra["reward_error"] == "connection" for r in results)
    assert all("reward server" in r.reason and "fail/drop" in r.reason for r in results)
    ok, _ = score(settings(f"{fault_server}/flaky/drop1/1/drop"), items(1))
    assert not ok[0].failed and ok[0].reward == 1.0


def test_malformed_json_fails_the_samples_with_reason(fault_server: str) -> None:
    results, stats = score(settings(f"{fault_server}/fail/malformed", fmt="openrlhf", retries=1), items(3))
    assert all(r.failed and "malformed JSON" in r.reason for r in results)
    assert stats["rm_requests"] == 2 and stats["rm_samples_failed_malformed"] == 3


def test_a_reply_of_the_wrong_shape_is_not_retried(fault_server: str) -> None:
    results, stats = score(settings(f"{fault_server}/fail/short", fmt="openrlhf", retries=3), items(3))
    assert all(r.failed and "list of 3 rewards" in r.reason for r in results)
    assert stats["rm_requests"] == 1 and stats["rm_samples_failed_bad_reply"] == 3


def test_a_refused_token_is_not_retried(fault_server: str) -> None:
    results, stats = score(settings(f"{fault_server}/fail/401", retries=3), items(1))
    assert results[0].failed and "HTTP 401" in results[0].reason and "VIME_RM_TOKEN" in results[0].reason
    assert stats["rm_requests"] == 1 and stats["rm_samples_failed_auth"] == 1


def test_nothing_listening_fails_with_reason(fault_server: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/slime/x"  # bound, not listening: refused
        results, _ = score(settings(dead, retries=1), items(2))
    assert all(r.failed and r.extra["reward_error"] == "connection" for r in results)


def test_a_failing_url_is_routed_around(fault_server: str) -> None:
    results, stats = score(settings(f"{fault_server}/fail/500", f"{fault_server}/ok", retries=2, concurrency=2), items(10))
    assert [r.reward for r in results] == [float(i + 1) for i in range(10)]


class BreakerClock:
    """Stands in for the wall clock purgatory's circuit states read (`time.time()` in
    `purgatory.domain.model`): the test moves time past `breaker_reset_s` instead of sleeping, and a
    slow machine cannot let the pause run out before the "blocked" batch is sent."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


def test_circuit_opens_after_repeated_failures_and_stops_sending(fault_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import purgatory.domain.model

    clock = BreakerClock()
    monkeypatch.setattr(purgatory.domain.model, "time", clock)
    url = f"{fault_server}/fail/500/breaker"
    s = settings(url, retries=0, breaker_failures=3, breaker_reset_s=30.0, concurrency=1)

    async def go():
        async with RemoteReward(s) as rm:
            first = await rm.score_batch(items(3, "a"))  # 3 failures open the circuit
            sent = server_stats(fault_server)["fail/500"]
            clock.now += 29.0  # still inside the pause
            blocked = await rm.score_batch(items(5, "b"))  # not sent at all
            not_sent = server_stats(fault_server)["fail/500"] == sent
            clock.now += 2.0  # past breaker_reset_s: one trial request goes out
            trial = await rm.score_batch(items(1, "c"))
            trial_sent = server_stats(fault_server)["fail/500"] == sent + 1
            return first, blocked, not_sent, trial, trial_sent, rm.stats()

    first, blocked, not_sent, trial, trial_sent, stats = asyncio.run(go())
    assert all(r.failed and "HTTP 500" in r.reason for r in first)
    assert all(r.failed and r.extra["reward_error"] == "circuit_open" for r in blocked)
    assert "last error" in blocked[0].reason and "HTTP 500" in blocked[0].reason
    assert not_sent and trial_sent and trial[0].failed
    assert stats["rm_circuits_opened"] == 2  # opened, half-opened for the trial, opened again


# ------------------------------------------------------------------------- worker: nothing is lost


def _group(group_id: str, responses: list[str], label: str = "2"):
    """A generated group as the broker sends it to a reward worker."""
    from vime.protocol.messages import Group, Sample, ScoringGroup

    def sample(i: int, text: str) -> Sample:
        toks = np.arange(3, dtype=np.int32)
        return Sample(i, toks, np.zeros(3, np.float32), np.ones(3, np.uint8), np.zeros(3, np.int32), "stop", text)

    return ScoringGroup.of(Group(group_id, 0, 0, np.arange(4, dtype=np.int32), "1+1=", len(responses), label, {}, 0,
                                 [sample(i, t) for i, t in enumerate(responses)]))  # fmt: skip


def test_worker_scores_each_group_and_marks_failures_without_losing_samples(fault_server: str) -> None:
    from vime.workers.reward import score_groups

    groups = [_group("g0", ["a", "bb"]), _group("g1", ["ccc"])]

    async def go(url: str):
        async with RemoteReward(settings(url, retries=0)) as rm:
            return await score_groups(rm, groups)

    good = asyncio.run(go(f"{fault_server}/ok"))
    assert [(s.group_id, s.rewards, s.failed) for s in good] == [("g0", [1.0, 2.0], [False, False]), ("g1", [3.0], [False])]
    bad = asyncio.run(go(f"{fault_server}/fail/500"))
    assert [len(s.rewards) for s in bad] == [2, 1]
    assert all(all(s.failed) and all("HTTP 500" in r for r in s.reasons) for s in bad)
    for s in bad:
        s.validate()  # a failed sample still makes a valid message for the broker


def test_worker_survives_a_scorer_that_raises() -> None:
    from vime.workers.reward import score_groups

    class Broken:
        async def score_batch(self, batch):
            raise RuntimeError("boom")

    scores = asyncio.run(score_groups(Broken(), [_group("g", ["a", "b"])]))
    assert scores[0].failed == [True, True] and "boom" in scores[0].reasons[0]


# ---------------------------------------------------------------------------------- wire edge cases


def test_vime_reply_missing_or_duplicate_ids() -> None:
    batch = items(2)
    partial = decode_reply("vime", {"version": 1, "results": [{"id": "s0", "reward": 0.5}]}, batch, None)
    assert partial[0].reward == 0.5 and partial[1].failed and "'s1'" in partial[1].reason
    with pytest.raises(ReplyError, match="two results"):
        decode_reply("vime", {"version": 1, "results": [{"id": "s0", "reward": 1}, {"id": "s0", "reward": 1}]}, batch, None)
    with pytest.raises(ReplyError, match="version 2"):
        decode_reply("vime", {"version": 2, "results": []}, batch, None)


def test_unusable_reward_values_fail_only_their_sample() -> None:
    results = decode_reply("openrlhf", {"rewards": [1.0, "high", None], "extra_logs": {"reward_error": [None, None, "timeout"]}}, items(3), None)
    assert [r.failed for r in results] == [False, True, True]
    assert "timeout" in results[2].reason


def test_json_true_and_false_are_not_rewards() -> None:
    """The outcome table: a reward that is not a number fails its sample; JSON booleans are not numbers
    (issue 15: they were taken as 1.0/0.0)."""
    slime = decode_reply("slime", True, items(1), None)[0]
    assert slime.failed and "true" in slime.reason
    assert decode_reply("slime", {"score": False, "acc": 1}, items(1), None)[0].failed
    assert decode_reply("slime", {"acc": True, "r": 0.5}, items(1), "acc")[0].failed
    assert decode_reply("slime", {"score": 0.5, "acc": True}, items(1), None)[0].extra == {"acc": True}  # an extra may be a bool
    mixed = decode_reply("openrlhf", {"rewards": [1.0, True, 0]}, items(3), None)
    assert [r.failed for r in mixed] == [False, True, False] and mixed[2].reward == 0.0
    vime = decode_reply("vime", {"version": 1, "results": [{"id": "s0", "reward": False}]}, items(1), None)[0]
    assert vime.failed and "false" in vime.reason


def test_server_and_client_halves_agree() -> None:
    batch = items(3)
    results = [RewardResult(1.0, {"acc": True, "pred": "1"}), RewardResult.failure("no label"), RewardResult(0.0, {"acc": False})]
    for fmt in ("openrlhf", "vime"):
        status, body = encode_reply(fmt, batch, results)
        assert status == 200
        back = decode_reply(fmt, json.loads(json.dumps(body)), batch, None)
        assert [r.failed for r in back] == [False, True, False]
        assert [r.reward for r in back if not r.failed] == [1.0, 0.0]
        assert "no label" in back[1].reason
    assert encode_request("slime", batch[:1]) == {"prompt": "prompt: ", "response": "x", "label": "1"}
    assert encode_reply("slime", batch[:1], results[1:2]) == (422, {"error": "no label"})


if __name__ == "__main__":
    try:
        asyncio.run(_serve_forever())
    except KeyboardInterrupt:
        pass
