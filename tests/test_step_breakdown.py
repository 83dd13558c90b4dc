"""bench/step_breakdown.py's figures from synthetic metrics records (no run launched), and the shared
training-FLOPs formula (vime.bench.flops) it and the Megatron GPU check use."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from vime.bench.flops import H200_BF16_PEAK_FLOPS, attention_seq_len, matmul_params, training_flops_per_token

from conftest import load_bench

sb = load_bench("step_breakdown")

# hidden 8, 2 layers, 2 query heads / 1 KV head of 4, MLP 16, vocabulary 10. Per layer: q 8*8 + k 8*4 +
# v 8*4 + o 8*8 = 192 attention, 3*8*16 = 384 MLP; 2 * 576 + LM head 10*8 = 1232 matmul parameters.
TINY_DENSE = {
    "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 4, "intermediate_size": 16, "vocab_size": 10,
}  # fmt: skip
TINY_MATMUL_PARAMS = 1232


def step_record(step: int, time: float, **values: float) -> dict[str, Any]:
    """A metrics line with the keys the existing breakdown needs; `values` adds or overrides keys."""
    base = {
        "step": step, "time": time, "perf/step_time": 1.0, "perf/wait_time": 0.2, "perf/train_time": 0.7,
        "perf/weight_sync_time": 0.1, "perf/rollout_busy_s_total": 0.5 * step, "perf/reward_busy_s_total": 0.1 * step,
        "perf/rollout_update_s_total": 0.05 * step, "rollout/staleness_mean": 1.0,
        "train/train_rollout_logprob_abs_diff": 0.01, "rollout/raw_reward": 0.5,
    }  # fmt: skip
    return {**base, **values}


# ---------------------------------------------------------------------------------------------------
# training FLOPs


def test_flops_of_a_hand_computed_tiny_config() -> None:
    assert matmul_params(TINY_DENSE) == TINY_MATMUL_PARAMS
    # 6 * 1232 + causal attention 6 * 2 layers * 5 tokens * q_dim 8
    assert training_flops_per_token(TINY_DENSE, seq_len=5) == 6 * 1232 + 6 * 2 * 5 * 8 == 7872


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    without_head_dim = {k: v for k, v in TINY_DENSE.items() if k != "head_dim"}
    assert matmul_params(without_head_dim) == TINY_MATMUL_PARAMS
    wider_heads = {**TINY_DENSE, "head_dim": 6}  # Qwen3-style: head_dim set, not hidden / heads
    # q 8*12 + k 8*6 + v 8*6 + o 12*8 = 288 attention per layer
    assert matmul_params(wider_heads) == 2 * (288 + 384) + 80


def test_matmul_params_match_the_linear_layers_of_a_transformers_qwen3() -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    for tied in (True, False):
        cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied)  # fmt: skip
        model = AutoModelForCausalLM.from_config(cfg)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert matmul_params(cfg) == linear  # the PretrainedConfig object, as megatron_check passes it
        assert matmul_params(cfg.to_dict()) == linear  # config.json's dict, as step_breakdown passes it


def test_flops_of_a_qwen3_moe_count_the_router_and_the_routed_experts_only() -> None:
    moe = {**TINY_DENSE, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 6}
    # per layer: attention 192, router 8*8, 2 routed experts of 3*8*6; plus the LM head 10*8
    assert matmul_params(moe) == 2 * (192 + 64 + 2 * 144) + 80
    # a dense layer among sparse ones (mlp_only_layers) counts its full MLP
    assert matmul_params({**moe, "mlp_only_layers": [0]}) == (192 + 384) + (192 + 64 + 2 * 144) + 80


def test_moe_matmul_params_match_the_linear_layers_a_token_passes_in_transformers() -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=24, tie_word_embeddings=False)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    experts = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    all_expert_params = sum(p.numel() for m in experts for p in m.parameters())
    routers = sum(p.numel() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # every Linear (attention, LM head), the routers, and a quarter of the experts' weights (top-2 of 8)
    assert routers == 2 * 8 * 32
    assert matmul_params(cfg) == linear + routers + all_expert_params * 2 // 8


def test_a_saved_qwen3_moe_config_naming_its_experts_num_local_experts_counts_the_same() -> None:
    moe = {**TINY_DENSE, "num_experts_per_tok": 2, "moe_intermediate_size": 6}
    assert matmul_params({**moe, "num_local_experts": 8}) == matmul_params({**moe, "num_experts": 8})
    with pytest.raises(ValueError, match="num_local_experts"):  # Mixtral-style: no moe_intermediate_size
        matmul_params({**TINY_DENSE, "num_local_experts": 8, "num_experts_per_tok": 2})


def test_flops_refuse_an_unmodelled_mixture_of_experts_layout() -> None:
    with pytest.raises(ValueError, match="n_routed_experts"):
        training_flops_per_token({**TINY_DENSE, "n_routed_experts": 8, "num_experts_per_tok": 2}, seq_len=5)


def test_attention_seq_len_weights_each_sequence_by_its_tokens() -> None:
    assert attention_seq_len([4, 4]) == 4.0
    assert attention_seq_len([2, 6]) == (4 + 36) / 8  # 5.0, not the mean 4
    # exact: summing per-sequence FLOPs equals tokens x FLOPs at the weighted length
    per_sequence = sum(n * training_flops_per_token(TINY_DENSE, n) for n in (2, 6))
    assert per_sequence == pytest.approx(8 * training_flops_per_token(TINY_DENSE, attention_seq_len([2, 6])))
    with pytest.raises(ValueError):
        attention_seq_len([])


def test_megatron_check_uses_the_shared_peak() -> None:
    from vime.bench import megatron_check

    assert megatron_check.H200_BF16_PEAK_FLOPS == H200_BF16_PEAK_FLOPS == 989e12
    assert megatron_check.training_flops_per_token is training_flops_per_token


# ---------------------------------------------------------------------------------------------------
# step_breakdown's figures


def test_rollout_tokens_per_second_over_the_window() -> None:
    records = [
        step_record(0, 100.0, **{"perf/rollout_tokens_total": 500.0}),
        step_record(1, 102.0, **{"perf/rollout_tokens_total": 1500.0}),
        step_record(2, 106.0, **{"perf/rollout_tokens_total": 6500.0}),
    ]
    # 6000 tokens generated in the 6 s from step 0's end to the last step's
    assert sb.rollout_throughput(records)["rollout_tokens_per_s"] == pytest.approx(1000.0)


def test_trainer_tokens_are_weighted_by_train_time() -> None:
    records = [
        step_record(0, 0.0, **{"perf/tokens_per_gpu_per_sec": 1e9, "perf/train_time": 9.0, "rollout/num_samples": 1.0}),
        step_record(1, 1.0, **{"perf/tokens_per_gpu_per_sec": 1000.0, "perf/train_time": 1.0, "rollout/num_samples": 10.0}),
        step_record(2, 2.0, **{"perf/tokens_per_gpu_per_sec": 4000.0, "perf/train_time": 3.0, "rollout/num_samples": 16.0}),
    ]  # fmt: skip
    out = sb.trainer_throughput(records, trainer_world_size=2)
    # 1000 + 12000 tokens per GPU in 4 s (not the 2500 mean of the two rates); step 0 is start-up
    assert out["trainer_tokens_per_gpu_per_s"] == pytest.approx(3250.0)
    # 13000 tokens on each of 2 GPUs over 26 samples
    assert out["trainer_seq_len_mean"] == pytest.approx(1000.0)


def test_sequence_length_falls_back_to_response_length() -> None:
    records = [
        step_record(i, float(i), **{"perf/tokens_per_gpu_per_sec": 100.0, "rollout/response_len": 10.0 * i})
        for i in range(3)
    ]
    assert sb.trainer_throughput(records, trainer_world_size=1)["trainer_seq_len_mean"] == pytest.approx(15.0)


def test_engine_weight_update_cost_per_update_and_per_gb() -> None:
    def totals(fetch: float, load: float, paused: float, nbytes: float) -> dict[str, float]:
        return {"perf/rollout_fetch_s_total": fetch, "perf/rollout_load_s_total": load,
                "perf/rollout_paused_s_total": paused, "perf/rollout_update_bytes_total": nbytes}  # fmt: skip

    # --update-weights-interval 2: steps 0 and 2 publish. A record's totals were read before its step
    # trained, so step 0's update falls inside the window and the last step's would not.
    records = [
        step_record(0, 0.0, **totals(1.0, 1.0, 1.0, 1e9)),
        step_record(1, 1.0, **{"perf/weight_sync_time": 0.0}, **totals(2.0, 1.5, 3.0, 3e9)),
        step_record(2, 2.0, **totals(3.0, 2.0, 5.0, 5e9)),
        step_record(3, 3.0, **{"perf/weight_sync_time": 0.0}, **totals(5.0, 3.0, 7.0, 9e9)),
    ]
    out = sb.engine_weight_update_cost(records, num_rollout_workers=2)
    # 2 updates, each applied by 2 engines: 4 engine updates of 8 GB in all
    assert out["weight_updates"] == 2
    assert out["engine_update_gb_per_update"] == pytest.approx(2.0)
    assert out["engine_update_fetch_s_per_update"] == pytest.approx(1.0)  # 4 s / 4
    assert out["engine_update_load_s_per_update"] == pytest.approx(0.5)  # 2 s / 4
    assert out["engine_update_paused_s_per_update"] == pytest.approx(1.5)  # 6 s / 4
    assert out["engine_update_fetch_s_per_gb"] == pytest.approx(0.5)
    assert out["engine_update_load_s_per_gb"] == pytest.approx(0.25)
    assert out["engine_update_paused_s_per_gb"] == pytest.approx(0.75)


def test_engine_updates_counted_by_the_engines_beat_the_publishes() -> None:
    # Three publishes inside the window, but the engine found two versions waiting once and loaded
    # only the newer: two loads of 4 GB each.
    records = [
        step_record(i, float(i), **{"perf/rollout_updates_total": float(loads), "perf/rollout_update_bytes_total": 4e9 * loads,
                                    "perf/rollout_load_s_total": 0.5 * loads})
        for i, loads in enumerate([0, 0, 1, 2])
    ]  # fmt: skip
    out = sb.engine_weight_update_cost(records, num_rollout_workers=1)
    assert out["weight_updates"] == 3
    assert out["engine_updates"] == 2.0
    assert out["engine_update_gb_per_update"] == pytest.approx(4.0)
    assert out["engine_update_load_s_per_update"] == pytest.approx(0.5)


def test_publish_parts_are_steady_step_means_or_none() -> None:
    parts = [{"perf/weight_export_time": e, "perf/weight_copy_time": 2 * e, "perf/weight_checksum_time": 0.5}
             for e in (9.0, 1.0, 3.0)]  # fmt: skip
    out = sb.publish_parts([step_record(i, float(i), **p) for i, p in enumerate(parts)])
    assert out == {"trainer_weight_export_s": 2.0, "trainer_weight_copy_s": 4.0, "trainer_weight_checksum_s": 0.5}
    assert set(sb.publish_parts([step_record(i, float(i)) for i in range(3)]).values()) == {None}


def test_colocate_turns_are_steady_step_means_or_none() -> None:
    turns = [{"perf/colocate_sleep_s": s, "perf/colocate_wake_s": 3 * s, "perf/colocate_weight_fetch_s": 0.01,
              "perf/colocate_weight_load_s": 0.1} for s in (5.0, 0.2, 0.4)]  # fmt: skip
    out = sb.colocate_turns([step_record(i, float(i), **t) for i, t in enumerate(turns)])
    assert out["colocate_sleep_s"] == pytest.approx(0.3)  # step 0 (engine start) is left out
    assert out["colocate_wake_s"] == pytest.approx(0.9)
    assert out["colocate_weight_fetch_s"] == pytest.approx(0.01)
    assert set(sb.colocate_turns([step_record(i, float(i)) for i in range(3)]).values()) == {None}  # split layout


def test_modes_set_staleness_and_flags() -> None:
    assert sb.mode_flags("async", 3) == (3, [])
    assert sb.mode_flags("sync", 3) == (0, [])
    assert sb.mode_flags("colocate", 3) == (0, ["--colocate"])
    with pytest.raises(ValueError, match="async, sync or colocate"):
        sb.mode_flags("split", 3)


def test_metrics_without_the_new_totals_give_none() -> None:
    records = [step_record(i, float(i)) for i in range(4)]  # a metrics file from before the keys existed
    assert sb.rollout_throughput(records)["rollout_tokens_per_s"] is None
    cost = sb.engine_weight_update_cost(records, num_rollout_workers=1)
    assert cost["weight_updates"] == 3
    assert all(cost[k] is None for k in cost if k.startswith("engine_update_"))
    assert sb.breakdown(records)["steps_measured"] == 3  # the existing figures still come out


def test_mfu_from_throughput_config_and_peak() -> None:
    out = sb.model_flops_utilization(1000.0, 5.0, TINY_DENSE, peak_flops=1e9)
    assert out["model_flops_per_token"] == 7872.0
    assert out["trainer_tflops_per_gpu"] == pytest.approx(7872.0 * 1000.0 / 1e12)
    assert out["mfu"] == pytest.approx(7872.0 * 1000.0 / 1e9)
    assert sb.model_flops_utilization(1000.0, 5.0, TINY_DENSE, peak_flops=None)["mfu"] is None  # no CUDA
    assert set(sb.model_flops_utilization(1000.0, 5.0, None, 1e9).values()) == {None}  # no config.json


def _write_run(run_dir: Path, checkpoint: Path, records: list[dict[str, Any]]) -> None:
    run_dir.mkdir()
    cfg = {"hf_checkpoint": str(checkpoint), "trainer_world_size": 1, "num_rollout_workers": 1}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_of_a_run_dir_keeps_the_old_keys_and_adds_the_new(tmp_path: Path) -> None:
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(TINY_DENSE))
    records = [
        step_record(i, 10.0 * i, **{
            "perf/tokens_per_gpu_per_sec": 500.0, "rollout/num_samples": 7.0 / 0.7, "perf/rollout_tokens_total": 100.0 * i,
            "perf/rollout_fetch_s_total": 0.1 * i, "perf/rollout_load_s_total": 0.2 * i,
            "perf/rollout_paused_s_total": 0.3 * i, "perf/rollout_update_bytes_total": 2e9 * i,
        })
        for i in range(5)
    ]  # fmt: skip
    records.append({"step": 2, "weight_version": 2, "eval/arith/pass@1": 0.5})  # an eval line, not a step
    _write_run(tmp_path / "run", checkpoint, records)
    out = sb.report(tmp_path / "run", staleness=2, peak_flops=1e12)
    old_keys = {
        "max_staleness", "reward_first5", "reward_last5", "steps_measured", "window_s", "step_time_s",
        "trainer_wait_for_batch_s", "trainer_train_s", "trainer_weight_publish_s", "generation_busy_s_per_step",
        "reward_busy_s_per_step", "rollout_weight_update_s_per_step", "rollout_idle_fraction", "staleness_mean",
        "logprob_abs_diff_mean", "steps_per_s",
    }  # fmt: skip
    assert old_keys <= set(out)
    assert out["steps_measured"] == 4
    assert out["rollout_tokens_per_s"] == pytest.approx(400.0 / 40.0)
    assert out["trainer_seq_len_mean"] == pytest.approx(500.0 * 0.7 / 10.0)
    assert out["mfu"] == pytest.approx(500.0 * training_flops_per_token(TINY_DENSE, 35.0) / 1e12)
    assert out["peak_tflops"] == 1.0
    assert out["weight_updates"] == 4
    assert out["engine_update_gb_per_update"] == pytest.approx(2.0)
    assert out["engine_update_paused_s_per_gb"] == pytest.approx(0.15)
    json.dumps(out, allow_nan=False)  # every new figure is a number or null

    (checkpoint / "config.json").unlink()  # a checkpoint dir without config.json: figures without FLOPs
    without_config = sb.report(tmp_path / "run", staleness=2, peak_flops=1e12)
    assert without_config["mfu"] is None and without_config["model_flops_per_token"] is None
    assert without_config["rollout_tokens_per_s"] == out["rollout_tokens_per_s"]
    assert not math.isnan(without_config["trainer_tokens_per_gpu_per_s"])
