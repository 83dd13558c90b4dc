"""`vime-broker`: owns the prompts, dispatch, the scored-group buffer and the staleness gate."""

from __future__ import annotations

import signal
import sys
from typing import Any

from vime.broker.journal import JournalWriter, journal_file, move_aside, read_journal
from vime.broker.prometheus import broker_families
from vime.broker.recovery import compacted, header_for, job_finished, restore, steps_recorded
from vime.broker.server import BrokerServer
from vime.broker.settings import BrokerSettings
from vime.broker.state import BrokerState
from vime.config import VimeConfig, build_parser, parse_config
from vime.data.prompts import PromptCursor, load_eval_prompts, load_prompts
from vime.eval import EvalSet
from vime.data.tokenizer import load_tokenizer
from vime.filters import build_group_filter
from vime.logging import bind_process, configure_logging, get_logger
from vime.prometheus import MetricsError, MetricsServer, SnapshotCollector, start_metrics_server
from vime.security import Security


def build_state(cfg: VimeConfig) -> BrokerState:
    """Load and tokenize the prompts and eval sets, load the dynamic sampling filter (the broker never
    loads model weights, only the tokenizer). A bad dataset or filter spec fails here, at start-up."""
    tokenizer = load_tokenizer(cfg.hf_checkpoint)
    prompts = load_prompts(cfg, tokenizer)
    eval_sets = []
    if cfg.eval_interval is not None:
        eval_sets = [EvalSet(name, p) for name, p in load_eval_prompts(cfg, tokenizer).items()]
    return BrokerState(
        BrokerSettings.from_config(cfg), PromptCursor(prompts, shuffle=cfg.rollout_shuffle, seed=cfg.seed),
        group_filter=build_group_filter(cfg), eval_sets=eval_sets,
    )  # fmt: skip


def open_journal(cfg: VimeConfig, state: BrokerState) -> JournalWriter:
    """Resume from the run dir's journal if it holds an unfinished job, else start a new one.

    A journal of a finished job (one that recorded its finish, not merely its last step: a broker killed
    while the job wound down resumes and finishes it) is moved aside (`broker.journal.done-<time>`), so
    running the same command again starts a new job. Raises JournalError for a damaged journal or one written for a
    different dataset or batch shape (the message says what differs)."""
    log = get_logger("vime.broker")
    path = journal_file(cfg.run_dir)
    writer_args = {"fsync": cfg.journal_fsync, "fsync_interval_s": cfg.journal_fsync_interval_s}
    if path.exists():
        records, intact = read_journal(path)
        if records and (steps_recorded(records) < cfg.num_rollout or not job_finished(records)):
            restore(state, records)
            writer = JournalWriter(path, truncate_to=intact, **writer_args)  # type: ignore[arg-type]
            writer.rewrite(compacted(state))  # also drops a torn tail for good
            # After the rewrite, which records this restart's count: one line per counted restart.
            log.warning(
                "broker_resumed", journal=str(path), step=state.trained_steps, weight_version=state.published_version,
                buffered=len(state.batches.buffer), in_training=len(state.batches.training), to_regenerate=len(state.in_flight.retry),
                replayable_steps=len(state.batches.step_batches), records=len(records),
                broker_restarts=state.counters["broker_restarts"],
            )  # fmt: skip
            return writer
        if records:
            log.info("previous_job_finished", journal=str(move_aside(path, "done")))
        else:
            path.unlink()
    writer = JournalWriter(path, **writer_args)  # type: ignore[arg-type]
    writer.append(header_for(state))
    writer.flush()
    return writer


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_config(list(sys.argv[1:] if argv is None else argv), build_parser("vime-broker"))
    configure_logging()
    bind_process("broker", "broker")
    log = get_logger("vime.broker")
    state = build_state(cfg)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    collector: SnapshotCollector[dict[str, Any]] = SnapshotCollector(broker_families)
    metrics: MetricsServer | None = None
    if cfg.metrics:
        try:
            metrics = start_metrics_server(collector, cfg.metrics_host, cfg.metrics_port, process="broker")
        except MetricsError as exc:
            log.error("metrics_failed", error=str(exc))
            sys.exit(2)
        state.metrics_url = metrics.url
    journal = open_journal(cfg, state) if cfg.journal else None
    server = BrokerServer(
        state, cfg.broker_bind or cfg.broker_address, status_path=cfg.status_file,
        security=Security.from_config(cfg), journal=journal, compact_bytes=cfg.journal_compact_bytes,
        metrics=collector if metrics is not None else None, job_name=cfg.job_name,
    )  # fmt: skip
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, server.stop)
    log.info("prompts_loaded", count=len(state.admission.cursor), source=cfg.prompt_data)
    if state.evals.tracker is not None:
        sets = {e.name: len(e.prompts) for e in state.evals.tracker.sets}
        log.info("eval_sets_loaded", sets=sets, interval=cfg.eval_interval)
    try:
        server.serve()
    finally:
        if metrics is not None:
            metrics.close()


if __name__ == "__main__":
    main()
