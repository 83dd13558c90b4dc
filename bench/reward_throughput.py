"""Rewards per second through the reward worker's remote client vs the scoring function in process.

Starts `bin/vime-reward-server` on 127.0.0.1 (a free port), then for each reward (`arithmetic`, the CPU
demo's, microseconds of work; `gsm8k`, math-verify in a process pool) scores the same samples:
- bare function (arithmetic only): the demo's scoring function in a plain loop, the ceiling;
- in process: the worker's local path, `vime.workers.reward.score_groups` over a `LocalScorer` of the
  reward function it would build for `--rm-type NAME` (`build_reward_fn`), every sample concurrently;
- remote, per format: `vime.workers.reward.score_groups` (the worker's own scoring path, minus the broker)
  over a `RemoteReward` client: slime (one POST per sample), openrlhf and vime (batches of
  `--batch-size`), `--concurrency` requests in flight.
- a standard-library server (`bench/stdlib_reward_server.py`: ThreadingHTTPServer, HTTP/1.0, listen
  backlog 5, the arithmetic reward), slime format: the client at its defaults (adaptive concurrency,
  at most 64), the old fixed 64 in flight (`adaptive_concurrency=False`), and the fixed 64 against the
  same server with a backlog of 128, and the defaults without quick connect retries (`connect_retry_s=0`);
  with `rm_connect_stalls` (connections that took > 0.5 s to open, or were opened again after 0.2 s) and
  the CPU milliseconds per request of the client (this process) and of the server.
Groups have 8 samples like the demo; half the answers are right (one text), the others one of 8 near
misses, so texts repeat and the client sends each text of a group once (`--rm-dedupe`; `req/pass` counts
what it sent). Each measurement is repeated `--repeats` times after one warm-up pass and the median
rate is reported. Client, server and the math-verify workers share this machine's cores, so on a small
machine the remote numbers include that contention.

    python bench/reward_throughput.py                       # human readable
    python bench/reward_throughput.py --json                # one JSON object on stdout
    python bench/reward_throughput.py --samples 2048 --math-samples 256 --math-workers 1
    python bench/reward_throughput.py --only stdlib --stdlib-samples 512   # the standard-library server alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# Per-request info lines would drown the report; set before vime configures logging on import.
os.environ.setdefault("VIME_LOG_LEVEL", "WARNING")

from bench.stdlib_reward_server import StdlibServer  # noqa: E402
from vime.protocol.messages import Group, Sample, ScoringGroup  # noqa: E402
from vime.rewards import build_reward_fn  # noqa: E402
from vime.rewards.math import MathReward, MathVerifier  # noqa: E402
from vime.rewards.remote import RemoteReward, RemoteRewardSettings  # noqa: E402
from vime.workers.reward import LocalScorer, score_groups  # noqa: E402

GROUP_SIZE = 8


def make_groups(reward: str, n_samples: int, seed: int = 0) -> list[ScoringGroup]:
    """Groups of 8 demo-like samples (arithmetic) or GSM8K-style answers; about half correct."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_samples // GROUP_SIZE):
        a, b = (int(x) for x in rng.integers(100, 500, size=2))
        label = str(a + b)
        prompt = f"{a}+{b}=" if reward == "arithmetic" else f"Janet has {a} eggs and buys {b} more. How many?"
        samples = []
        for i in range(GROUP_SIZE):
            answer = label if rng.random() < 0.5 else str(a + b + int(rng.integers(1, 9)))
            text = answer if reward == "arithmetic" else f"She has {a} + {b} = {answer} eggs.\n#### {answer}"
            toks = np.arange(4, dtype=np.int32)
            samples.append(Sample(i, toks, np.zeros(4, np.float32), np.ones(4, np.uint8), np.zeros(4, np.int32), "stop", text))
        groups.append(ScoringGroup.of(Group(f"g{g}", g, 0, np.arange(6, dtype=np.int32), prompt, GROUP_SIZE, label, {}, 0, samples)))
    return groups


async def rate(scorer: Any, groups: list[ScoringGroup], repeats: int) -> dict[str, float]:
    """Median rewards/s over `repeats` passes after a warm-up pass; also checks nothing failed."""
    n = sum(len(g.samples) for g in groups)
    await score_groups(scorer, groups)  # warm-up: connections, pool workers, caches
    rates, failed = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        scores = await score_groups(scorer, groups)
        rates.append(n / (time.perf_counter() - t0))
        failed += sum(sum(s.failed) for s in scores)
    return {"rewards_per_s": statistics.median(rates), "min": min(rates), "max": max(rates), "samples": n, "failed": failed}


def bare_rate(groups: list[Group], repeats: int) -> dict[str, float]:
    """The demo's scoring function called in a plain loop: the ceiling, with no asyncio or worker code."""
    from vime.demo.arithmetic import arithmetic_reward

    pairs = [(s.response_text, g.label) for g in groups for s in g.samples]
    rates = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for response, label in pairs:
            arithmetic_reward(response, label)
        rates.append(len(pairs) / (time.perf_counter() - t0))
    rates = rates[1:]
    return {"rewards_per_s": statistics.median(rates), "min": min(rates), "max": max(rates), "samples": len(pairs), "failed": 0}


class Server:
    def __init__(self, math_workers: int) -> None:
        self.log = Path(tempfile.mkstemp(prefix="reward-server-", suffix=".log")[1])
        env = {k: v for k, v in os.environ.items() if k != "VIME_RM_TOKEN"}
        env["VIME_LOG_LEVEL"] = "INFO"  # its port is announced in an info line
        self.proc = subprocess.Popen(
            [str(REPO / "bin" / "vime-reward-server"), "--port", "0", "--math-workers", str(math_workers)],
            stdout=subprocess.DEVNULL, stderr=self.log.open("wb"), env=env,
        )  # fmt: skip
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        port = None
        while port is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"vime-reward-server did not start:\n{self.log.read_text()[-2000:]}")
            for line in self.log.read_text().splitlines():
                if '"reward_server_listening"' in line:
                    port = json.loads(line)["port"]
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM: uvicorn shuts down and the server's lifespan stops its math-verify workers."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.unlink(missing_ok=True)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_stdlib(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Slime format against the standard-library server: defaults vs the old fixed concurrency."""
    rows = []
    groups = make_groups("arithmetic", args.stdlib_samples)
    rows.append({"reward": "arithmetic", "path": "in-process", **await rate(LocalScorer(build_reward_fn("arithmetic")), groups, args.repeats)})
    cases = [
        ("stdlib defaults (adaptive)", None, {}),
        ("stdlib defaults, no quick connect retry", None, {"connect_retry_s": 0.0}),
        ("stdlib fixed 64 (old)", None, {"adaptive_concurrency": False}),
        ("stdlib fixed 8", None, {"adaptive_concurrency": False, "concurrency": 8}),
        ("stdlib b128 fixed 64", 128, {"adaptive_concurrency": False}),
    ]
    for name, backlog, kw in cases:
        server = StdlibServer(backlog=backlog)
        try:
            settings = RemoteRewardSettings(urls=[server.url], fmt="slime", **kw)
            async with RemoteReward(settings) as client:
                client_cpu, server_cpu = time.process_time(), process_cpu_s(server.proc.pid)
                row = await rate(client, groups, args.repeats)
                client_cpu, server_cpu = time.process_time() - client_cpu, process_cpu_s(server.proc.pid) - server_cpu
                stats = client.stats()
                requests = stats.get("rm_requests", 0.0)
                # CPU per request of this process (the client; the scoring in the same loop is trivial) and of the server
                row["client_cpu_ms_per_request"] = 1e3 * client_cpu / max(1.0, requests)
                row["server_cpu_ms_per_request"] = 1e3 * server_cpu / max(1.0, requests)
                row["requests_per_pass"] = requests / (args.repeats + 1)
                row["connect_stalls_per_pass"] = stats["rm_connect_stalls"] / (args.repeats + 1)
                row["connect_retries_per_pass"] = stats.get("rm_connect_retries", 0.0) / (args.repeats + 1)
                row["final_limit"] = stats["rm_limit"]
        finally:
            server.stop()
        rows.append({"reward": "arithmetic", "path": name, **row})
    return rows


async def run_all(args: argparse.Namespace, server: Server) -> list[dict[str, Any]]:
    rows = []
    for reward, n in (("arithmetic", args.samples), ("gsm8k", args.math_samples)):
        groups = make_groups(reward, n)
        verifier = None
        if reward == "arithmetic":
            fn = build_reward_fn("arithmetic")
        else:
            verifier = MathVerifier(num_workers=args.math_workers)
            fn = MathReward("gsm8k", verifier)
        if reward == "arithmetic":
            rows.append({"reward": reward, "path": "bare function", **bare_rate(groups, args.repeats)})
        rows.append({"reward": reward, "path": "in-process", **await rate(LocalScorer(fn), groups, args.repeats)})
        if verifier is not None:
            verifier.close()  # its workers would otherwise compete with the server's
        for fmt in ("slime", "openrlhf", "vime"):
            settings = RemoteRewardSettings(
                urls=[f"{server.url}/{fmt}/{reward}"], fmt=fmt, batch_size=args.batch_size, concurrency=args.concurrency,
                timeout_s=120.0,
            )  # fmt: skip
            async with RemoteReward(settings) as client:
                row = await rate(client, groups, args.repeats)
                row["requests_per_pass"] = client.stats().get("rm_requests", 0.0) / (args.repeats + 1)
            rows.append({"reward": reward, "path": f"remote {fmt}", **row})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=4096, help="arithmetic samples per pass")
    p.add_argument("--math-samples", type=int, default=512, help="gsm8k samples per pass")
    p.add_argument("--batch-size", type=int, default=64, help="samples per request (openrlhf, vime)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    p.add_argument("--math-workers", type=int, default=1, help="math-verify processes (in process and in the server)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stdlib-samples", type=int, default=512, help="samples per pass against the standard-library server")
    p.add_argument("--only", choices=["all", "reference", "stdlib"], default="all")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()

    rows = []
    if args.only in ("all", "reference"):
        server = Server(args.math_workers)
        try:
            rows += asyncio.run(run_all(args, server))
        finally:
            server.stop()
    if args.only in ("all", "stdlib"):
        stdlib_rows = asyncio.run(run_stdlib(args))
        base_row = stdlib_rows.pop(0)
        if args.only == "stdlib":
            rows.append(base_row)
        rows += stdlib_rows
    base = {r["reward"]: r["rewards_per_s"] for r in rows if r["path"] == "in-process"}
    for r in rows:
        r["vs_in_process"] = r["rewards_per_s"] / base[r["reward"]]
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "results": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{'reward':<11} {'path':<40} {'rewards/s':>11} {'x in-proc':>9} {'req/pass':>9} {'failed':>6} {'stalls/pass':>11} "
          f"{'quick/pass':>10} {'client ms/req':>13} {'server ms/req':>13}")  # fmt: skip
    for r in rows:
        cpu = "".join(f" {r[k]:>13.3f}" if k in r else f" {'-':>13}" for k in ("client_cpu_ms_per_request", "server_cpu_ms_per_request"))
        print(f"{r['reward']:<11} {r['path']:<40} {r['rewards_per_s']:>11.0f} {r['vs_in_process']:>9.3f} "
              f"{r.get('requests_per_pass', 0):>9.0f} {r['failed']:>6} {r.get('connect_stalls_per_pass', 0):>11.1f} "
              f"{r.get('connect_retries_per_pass', 0):>10.1f}{cpu}")  # fmt: skip


if __name__ == "__main__":
    main()
