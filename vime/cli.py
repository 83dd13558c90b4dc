"""The `vime` command: run a job, query a broker, report on a run, build the demo model, benchmark."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vime.config import ConfigError, add_config_flags, parse_config


def _cmd_run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vime run", description="run a whole job on this machine", allow_abbrev=False)
    parser.add_argument("config", type=Path, help="YAML config (flags override it)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--timeout", type=float, default=None, help="stop the job after this many seconds")
    add_config_flags(parser)
    cfg, args = parse_config(argv, parser)
    from vime.launcher import run_job
    from vime.logging import configure_logging

    configure_logging()
    return run_job(cfg, progress=not args.no_progress, timeout_s=args.timeout)


def _cmd_status(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vime status", description="ask a running broker for its state")
    parser.add_argument("--broker-address", default="tcp://127.0.0.1:5555")
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    from vime.broker.client import query_status

    try:
        status = query_status(args.broker_address, args.timeout)
    except TimeoutError as exc:
        print(f"vime status: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    print(f"weight version {status['weight_version']}  step {status['step']}  finished {status['finished']}")
    print("queues  " + "  ".join(f"{k}={v}" for k, v in status["queues"].items()))
    print("counters " + "  ".join(f"{k}={v}" for k, v in status["counters"].items()))
    for w in status["workers"]:
        print(f"  {w['role']:8s} {w['worker_id']:24s} version={w['weight_version']} leased={w['leased']} credits={w['credits']}")
    return 0


def _cmd_report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vime report", description="summarise and plot a run directory")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    from vime.metrics import plot_metrics, read_metrics, summarize

    metrics = args.run_dir / "metrics.jsonl"
    if not metrics.exists():
        print(f"vime report: {metrics} does not exist", file=sys.stderr)
        return 2
    print(json.dumps(summarize(read_metrics(metrics)), indent=1))
    print(f"plot: {plot_metrics(metrics, args.run_dir / 'reward_curve.png')}")
    return 0


def _cmd_make_demo_model(argv: list[str]) -> int:
    from vime.demo.model_factory import main as factory_main

    return int(factory_main(argv) or 0)


def _cmd_slurm(argv: list[str]) -> int:
    from vime.slurm.command import main as slurm_main

    return slurm_main(argv)


def _cmd_bench(argv: list[str]) -> int:
    benches = {"r3": "vime.bench.r3"}
    if not argv or argv[0] not in benches:
        print(f"usage: vime bench {{{','.join(benches)}}} [--json] ...", file=sys.stderr)
        return 2
    import importlib

    return int(importlib.import_module(benches[argv[0]]).main(argv[1:]) or 0)


COMMANDS = {
    "run": _cmd_run, "status": _cmd_status, "report": _cmd_report, "make-demo-model": _cmd_make_demo_model,
    "bench": _cmd_bench, "slurm": _cmd_slurm,
}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: vime {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        sys.exit(2)
    try:
        sys.exit(COMMANDS[argv[0]](argv[1:]))
    except ConfigError as exc:
        print(f"vime: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
