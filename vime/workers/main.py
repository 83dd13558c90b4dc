"""`vime-worker --role rollout|reward|trainer`: start one worker of the job.

All roles take the same job flags as `vime-broker` (`--config`, slime-style flags, `--vllm-*`), so a
worker started by hand on another machine only needs `--broker-address` to join.
"""

from __future__ import annotations

import sys

from vime.config import build_parser, parse_config
from vime.logging import bind_process, configure_logging, get_logger


def main(argv: list[str] | None = None) -> None:
    parser = build_parser("vime-worker")
    parser.add_argument("--role", required=True, choices=["rollout", "reward", "trainer"])
    parser.add_argument("--worker-id", default=None, help="stable id (default: role-host-pid-random)")
    cfg, args = parse_config(list(sys.argv[1:] if argv is None else argv), parser)
    configure_logging()
    from vime.broker.client import new_worker_id

    worker_id = args.worker_id or new_worker_id(args.role)
    bind_process(args.role, worker_id)
    log = get_logger("vime.worker")
    log.info("worker_starting", config=str(args.config) if args.config else None)
    if args.role == "trainer":
        from vime.workers import trainer

        sys.exit(trainer.run(cfg, worker_id))
    import uvloop

    if args.role == "rollout":
        from vime.workers import rollout

        sys.exit(uvloop.run(rollout.run(cfg, worker_id)))
    from vime.workers import reward

    sys.exit(uvloop.run(reward.run(cfg, worker_id)))


if __name__ == "__main__":
    main()
