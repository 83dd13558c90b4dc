"""The `vime` command: run a job, query a broker, report on a run, build the demo model, benchmark,
make CURVE keys."""

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
    parser.add_argument(
        "--min-reward-gain", type=float, default=None, metavar="GAIN",
        help="exit with code 3 when the mean reward of the last 5 steps exceeds that of the first 5 by less "
        "than GAIN (`make demo` asks for 0.3)",
    )  # fmt: skip
    add_config_flags(parser)
    cfg, args = parse_config(argv, parser)
    from vime.demo.model_factory import DemoModelError
    from vime.launcher import AddressInUse, run_job
    from vime.logging import configure_logging

    configure_logging()
    try:
        return run_job(cfg, progress=not args.no_progress, timeout_s=args.timeout, min_reward_gain=args.min_reward_gain)
    except (DemoModelError, AddressInUse) as exc:
        print(f"vime: {exc}", file=sys.stderr)
        return 1


def _cmd_status(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vime status", description="ask a running broker for its state")
    parser.add_argument("--broker-address", default="tcp://127.0.0.1:5555")
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--curve-keys-dir", type=Path, default=None, help="the job's `vime keys` directory (client key: clients/status)")
    parser.add_argument("--allow-insecure", action="store_true", help="allow plaintext to a non-loopback broker")
    args = parser.parse_args(argv)
    from vime.broker.client import query_status
    from vime.security import Security, SecurityError

    try:
        status = query_status(
            args.broker_address, args.timeout, security=Security(args.curve_keys_dir, args.allow_insecure)
        )
    except (TimeoutError, SecurityError) as exc:
        print(f"vime status: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    print(f"weight version {status['weight_version']}  step {status['step']}  finished {status['finished']}")
    print("queues  " + "  ".join(f"{k}={v}" for k, v in status["queues"].items()))
    print("counters " + "  ".join(f"{k}={v}" for k, v in status["counters"].items()))
    print(f"metrics  {status.get('metrics_url') or '-'}")  # .get: an older broker's status has none
    for w in status["workers"]:
        print(f"  {w['role']:8s} {w['worker_id']:24s} version={w['weight_version']} leased={w['leased']} credits={w['credits']}"
              f" metrics={w.get('metrics_url') or '-'}")  # fmt: skip
    return 0


def _cmd_report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="vime report", description="render a run directory (finished, in progress or resumed) as a one-page report: "
        "a multi-panel PNG and an HTML page embedding it with the numbers (docs/observability.md)",
    )  # fmt: skip
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="the PNG to write (default RUN_DIR/report.png; the HTML goes beside it)")
    parser.add_argument("--no-html", action="store_true", help="write only the PNG")
    args = parser.parse_args(argv)
    from vime.report import ReportError, render

    try:
        report = render(args.run_dir, args.out, html=not args.no_html)
    except ReportError as exc:
        print(f"vime report: {exc}", file=sys.stderr)
        return 2
    for panel in report.panels.values():
        print(f"  {panel.title}" if panel.has_data else f"  {panel.name}: NO DATA ({panel.note.splitlines()[0]})")
    print(f"report: {report.png}" + (f"  {report.html}" if report.html else ""))
    return 0


def _cmd_make_demo_model(argv: list[str]) -> int:
    from vime.demo.model_factory import main as factory_main

    return int(factory_main(argv) or 0)


def _cmd_slurm(argv: list[str]) -> int:
    from vime.slurm.command import main as slurm_main

    return slurm_main(argv)


def _cmd_keys(argv: list[str]) -> int:
    from vime.security import CLIENT_ROLES, KeyPaths, create_keys

    parser = argparse.ArgumentParser(
        prog="vime keys",
        description="create CURVE key pairs for a job: DIR/server.key_secret (broker and weight publisher), "
        "DIR/clients/<name>.key_secret (one per client role), DIR/authorized/<name>.key (the servers' "
        "allow-list). Existing keys are kept; then pass --curve-keys-dir DIR to every process.",
        allow_abbrev=False,
    )
    parser.add_argument("directory", type=Path, help="where the keys go (created, owner-only)")
    parser.add_argument("--client", dest="clients", action="append", default=None, metavar="NAME",
                        help=f"client pair to create (repeatable; default: {', '.join(CLIENT_ROLES)})")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="replace existing pairs (every process must restart)")
    args = parser.parse_args(argv)
    try:
        written = create_keys(args.directory, args.clients or CLIENT_ROLES, force=args.force)
    except (OSError, ValueError) as exc:
        print(f"vime keys: {exc}", file=sys.stderr)
        return 2
    paths = KeyPaths(args.directory)
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"vime keys: every key already exists in {args.directory} (--force replaces them)")
    allowed = sorted(p.stem for p in paths.authorized.glob("*.key"))
    print(f"allowed clients: {', '.join(allowed)}; use: --curve-keys-dir {args.directory}")
    return 0


def _cmd_bench(argv: list[str]) -> int:
    benches = {"r3": "vime.bench.r3"}
    if not argv or argv[0] not in benches:
        print(f"usage: vime bench {{{','.join(benches)}}} [--json] ...", file=sys.stderr)
        return 2
    import importlib

    return int(importlib.import_module(benches[argv[0]]).main(argv[1:]) or 0)


COMMANDS = {
    "run": _cmd_run, "status": _cmd_status, "report": _cmd_report, "make-demo-model": _cmd_make_demo_model,
    "bench": _cmd_bench, "slurm": _cmd_slurm, "keys": _cmd_keys,
}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: vime {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        sys.exit(2)
    from vime.security import SecurityError

    try:
        sys.exit(COMMANDS[argv[0]](argv[1:]))
    except (ConfigError, SecurityError) as exc:
        print(f"vime: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
