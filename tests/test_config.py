"""Config: YAML + slime-style flags + --vllm-* pass-through; clear errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from vime.config import ConfigError, build_parser, load_config, parse_config, split_vllm_flags


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_flags_override_yaml_and_vllm_args_pass_through(tmp_path: Path) -> None:
    path = write(tmp_path, "rollout-batch-size: 4\nn_samples_per_prompt: 2\nvllm:\n  dtype: bfloat16\n")
    cfg, _ = parse_config(["--config", str(path), "--rollout-batch-size", "8", "--use-kl-loss", "--vllm-max-model-len", "128", "--vllm-enforce-eager=true"])
    assert cfg.rollout_batch_size == 8 and cfg.n_samples_per_prompt == 2 and cfg.use_kl_loss is True
    assert cfg.vllm == {"dtype": "bfloat16", "max_model_len": 128, "enforce_eager": True}


def test_a_kv_cache_size_flag_replaces_the_files_other_kv_cache_size(tmp_path: Path) -> None:
    """vLLM obeys kv_cache_memory_bytes over gpu_memory_utilization: a flag giving the cache size one way
    drops the config file's other way, instead of being overruled by it."""
    path = write(tmp_path, "vllm:\n  max_model_len: 64\n  kv_cache_memory_bytes: 67108864\n")
    cfg, _ = parse_config(["--config", str(path), "--vllm-gpu-memory-utilization", "0.35"])
    assert cfg.vllm == {"max_model_len": 64, "gpu_memory_utilization": 0.35}
    path = write(tmp_path, "vllm:\n  gpu-memory-utilization: 0.9\n  dtype: bfloat16\n")
    cfg, _ = parse_config(["--config", str(path), "--vllm-kv-cache-memory-bytes", "1048576"])
    assert cfg.vllm == {"dtype": "bfloat16", "kv_cache_memory_bytes": 1048576}
    cfg, _ = parse_config(["--config", str(path), "--vllm-max-model-len", "128"])  # other flags keep the file's size
    assert cfg.vllm == {"gpu-memory-utilization": 0.9, "dtype": "bfloat16", "max_model_len": 128}


def test_unknown_flag_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--rollout-batch-sise", "8"])
    assert "unrecognized arguments: --rollout-batch-sise" in capsys.readouterr().err


def test_unknown_yaml_key_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rollout_batch_sise"):
        load_config(write(tmp_path, "rollout_batch_sise: 3\n"))


def test_wrong_type_and_range_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rollout_batch_size"):
        load_config(write(tmp_path, "rollout_batch_size: many\n"))
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(None, {"max_staleness": -1})


def test_inconsistent_batch_shape_is_explained() -> None:
    with pytest.raises(ConfigError, match="not a multiple of global_batch_size"):
        load_config(None, {"rollout_batch_size": 3, "n_samples_per_prompt": 3, "global_batch_size": 4})


def test_custom_reward_needs_a_path() -> None:
    with pytest.raises(ConfigError, match="custom_rm_path"):
        load_config(None, {"rm_type": "custom"})


def test_bad_yaml_and_missing_file_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1, 2\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_vllm_flag_without_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match="needs a value"):
        split_vllm_flags(["--vllm-dtype"])


def test_demo_config_loads() -> None:
    cfg = load_config(Path(__file__).parent.parent / "configs" / "demo.yaml")
    assert cfg.prompt_data == "demo:arithmetic" and cfg.vllm["max_model_len"] == 64


def test_every_field_has_a_flag() -> None:
    text = build_parser().format_help()
    for flag in ["--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size", "--eps-clip-high", "--kl-loss-type", "--use-tis", "--max-staleness", "--custom-rm-path", "--apply-chat-template"]:
        assert flag in text


def test_vllm_flags_with_the_hf_engine_are_named_in_a_warning(tmp_path: Path) -> None:
    """Issue 15: `--vllm-*` flags were silently ignored with `--rollout-engine hf`. As for other
    inapplicable settings (a custom_rm_path's rm_type), vime logs a warning naming them and goes on."""
    from structlog.testing import capture_logs

    from vime.logging import configure_logging

    configure_logging()  # first, or its structlog.configure() would replace capture_logs' processors
    path = write(tmp_path, "rollout_engine: hf\nvllm:\n  max_model_len: 64\n")
    with capture_logs() as logs:
        cfg, _ = parse_config(["--config", str(path), "--vllm-gpu-memory-utilization", "0.5", "--vllm-dtype", "float32"])
        # Nothing to say when vLLM may run them, or when no vLLM flag is given.
        for argv in (["--rollout-engine", "vllm", "--vllm-max-model-len", "64"], ["--rollout-engine", "auto", "--vllm-max-model-len", "64"],
                     ["--rollout-engine", "hf"]):  # fmt: skip
            parse_config(argv)
    assert cfg.vllm == {"max_model_len": 64, "gpu_memory_utilization": 0.5, "dtype": "float32"}, "kept as given"
    [warning] = [e for e in logs if e["event"] == "vllm_flags_ignored"]
    assert warning["log_level"] == "warning" and warning["rollout_engine"] == "hf"
    assert warning["flags"] == ["--vllm-gpu-memory-utilization", "--vllm-max-model-len"]
    # --vllm-dtype still sets the dtype the trainer publishes weights in: said, not listed as ignored.
    assert "--vllm-dtype" in warning["dtype"] and "--rollout-dtype" in warning["dtype"]


def test_max_tokens_per_gpu_makes_micro_batches_by_token_budget(tmp_path: Path) -> None:
    """Both backends (MegatronTrainerConfig inherits `from_vime_config`; megatron-core needs a GPU)."""
    from vime.trainer.torch_backend import TorchTrainerConfig

    path = write(tmp_path, "hf_checkpoint: model\nmicro_batch_size: 4\n")
    budget, _ = parse_config(["--config", str(path), "--max-tokens-per-gpu", "8192"])
    plain, _ = parse_config(["--config", str(path)])
    by_tokens = TorchTrainerConfig.from_vime_config(budget)
    assert (by_tokens.max_tokens_per_micro_batch, by_tokens.micro_batch_size) == (8192, None)
    by_samples = TorchTrainerConfig.from_vime_config(plain)
    assert (by_samples.max_tokens_per_micro_batch, by_samples.micro_batch_size) == (None, 4)
    with pytest.raises(ConfigError, match="max_tokens_per_gpu"):
        load_config(path, {"max_tokens_per_gpu": 0})


def test_gradient_checkpointing_flag_reaches_the_torch_trainer(tmp_path: Path) -> None:
    from vime.trainer.torch_backend import TorchTrainerConfig

    path = write(tmp_path, "hf_checkpoint: model\n")
    on, _ = parse_config(["--config", str(path), "--gradient-checkpointing"])
    off, _ = parse_config(["--config", str(path)])
    assert TorchTrainerConfig.from_vime_config(on).gradient_checkpointing is True
    assert TorchTrainerConfig.from_vime_config(off).gradient_checkpointing is False
    with pytest.raises(ConfigError, match="recompute-granularity"):
        load_config(path, {"gradient_checkpointing": True, "train_backend": "megatron"})


def test_torch_compile_flag_reaches_both_trainers_and_megatron_refuses_it_with_replay(tmp_path: Path) -> None:
    from vime.trainer.torch_backend import TorchTrainerConfig

    path = write(tmp_path, "hf_checkpoint: model\n")
    on, _ = parse_config(["--config", str(path), "--torch-compile"])
    assert TorchTrainerConfig.from_vime_config(on).torch_compile is True
    assert TorchTrainerConfig.from_vime_config(parse_config(["--config", str(path)])[0]).torch_compile is False
    assert load_config(path, {"torch_compile": True, "train_backend": "megatron"}).torch_compile is True
    with pytest.raises(ConfigError, match="torch_compile with use_rollout_routing_replay"):
        load_config(path, {"torch_compile": True, "train_backend": "megatron", "use_rollout_routing_replay": True})


def test_optimizer_implementation_flag_reaches_the_torch_trainer_and_is_refused_for_megatron(tmp_path: Path) -> None:
    from vime.trainer.torch_backend import TorchTrainerConfig

    path = write(tmp_path, "hf_checkpoint: model\n")
    chosen, _ = parse_config(["--config", str(path), "--optimizer-implementation", "foreach"])
    assert TorchTrainerConfig.from_vime_config(chosen).optimizer_implementation == "foreach"
    assert TorchTrainerConfig.from_vime_config(parse_config(["--config", str(path)])[0]).optimizer_implementation == "auto"
    with pytest.raises(ConfigError, match="optimizer_implementation"):
        load_config(path, {"optimizer_implementation": "fast"})
    with pytest.raises(ConfigError, match="optimizer_implementation is the torch backend's"):
        load_config(path, {"optimizer_implementation": "fused", "train_backend": "megatron"})


def test_share_prompts_flag_reaches_the_torch_trainer_and_is_refused_for_megatron(tmp_path: Path) -> None:
    from vime.trainer.torch_backend import TorchTrainerConfig

    path = write(tmp_path, "hf_checkpoint: model\n")
    assert TorchTrainerConfig.from_vime_config(parse_config(["--config", str(path), "--share-prompts"])[0]).share_prompts
    assert not TorchTrainerConfig.from_vime_config(parse_config(["--config", str(path)])[0]).share_prompts
    with pytest.raises(ConfigError, match="share_prompts is the torch backend's"):
        load_config(path, {"share_prompts": True, "train_backend": "megatron"})
    with pytest.raises(ConfigError, match="--no-share-prompts with --use-rollout-routing-replay"):
        load_config(path, {"share_prompts": True, "use_rollout_routing_replay": True})
    with pytest.raises(ConfigError, match="two micro-batch layouts"):
        load_config(path, {"share_prompts": True, "pack_sequences": "on"})


def test_rm_flags_reach_the_remote_reward_client() -> None:
    from vime.rewards.remote import RemoteRewardSettings

    flags = ["--rm-type", "remote_rm", "--rm-url", "http://a:1/r,http://b:2/r", "--rm-max-wait-s", "90", "--rm-retries", "5"]
    settings = RemoteRewardSettings.from_config(parse_config(flags)[0], environ={"VIME_RM_TOKEN": "t"})
    assert settings.urls == ["http://a:1/r", "http://b:2/r"]
    assert settings.max_wait_s == 90.0 and settings.retries == 5
    assert settings.token is not None and settings.token.get_secret_value() == "t"
    # unset: samples wait for the servers as long as it takes
    assert RemoteRewardSettings.from_config(parse_config(flags[:4])[0], environ={}).max_wait_s is None
    assert RemoteRewardSettings.from_config(parse_config(flags[:4])[0], environ={}).connect_retry_s == 0.05
    no_quick = parse_config([*flags[:4], "--rm-connect-retry-s", "0"])[0]
    assert RemoteRewardSettings.from_config(no_quick, environ={}).connect_retry_s == 0.0


@pytest.mark.parametrize(
    ("url", "problem"),
    [("ftp://a/r", "must look like"), ("http://a:99999/r", "Port out of range"), ("http://a:1/a b", "percent-encode")],
)
def test_a_reward_server_url_the_client_cannot_use_fails_the_config(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_config(None, {"rm_type": "remote_rm", "rm_url": url})
