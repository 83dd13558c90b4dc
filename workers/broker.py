"""`vime-broker`: owns the prompts, dispatch, the scored-group buffer and the staleness gate."""

from __future__ import annotations

import signal
import sys

from vime.broker.server import BrokerServer
from vime.broker.state import BrokerSettings, BrokerState
from vime.config import VimeConfig, build_parser, parse_config
from vime.data.prompts import PromptCursor, load_prompts
from vime.logging import bind_process, configure_logging, get_logger


def build_state(cfg: VimeConfig) -> BrokerState:
    """Load and tokenize the prompts (the broker never loads model weights, only the tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cfg.hf_checkpoint))
    prompts = load_prompts(cfg, tokenizer)
    settings = BrokerSettings(
        rollout_batch_size=cfg.rollout_batch_size,
        n_samples_per_prompt=cfg.n_samples_per_prompt,
        max_staleness=cfg.max_staleness,
        update_weights_interval=cfg.update_weights_interval,
        num_rollout=cfg.num_rollout,
        worker_timeout_s=cfg.worker_timeout_s,
        sampling={
            "temperature": cfg.rollout_temperature,
            "top_p": cfg.rollout_top_p,
            "max_tokens": cfg.rollout_max_response_len,
        },
        rm_type=cfg.rm_type,
    )
    return BrokerState(settings, PromptCursor(prompts, shuffle=cfg.rollout_shuffle, seed=cfg.seed))


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_config(list(sys.argv[1:] if argv is None else argv), build_parser("vime-broker"))
    configure_logging()
    bind_process("broker", "broker")
    log = get_logger("vime.broker")
    state = build_state(cfg)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    server = BrokerServer(state, cfg.broker_bind or cfg.broker_address, status_path=cfg.run_dir / "status.json")
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, server.stop)
    log.info("prompts_loaded", count=len(state.cursor), source=cfg.prompt_data)
    server.serve()


if __name__ == "__main__":
    main()
