"""HF <-> Megatron name/shape mapping (pure torch: runs on CPU) and the parallel-layout checks.

The Megatron model itself needs CUDA: `tests/test_megatron_backend.py` and `bench/megatron_gpu_check.py`
cover it on the GPU machine.
"""

from __future__ import annotations

import types

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from vime.demo.model_factory import make_tiny_qwen3, make_tiny_qwen3_moe
from vime.trainer.megatron.hf_mapping import (
    ModelLayout,
    hf_checkpoint_names,
    hf_to_megatron,
    megatron_to_hf,
    rule_for,
)
from vime.trainer.megatron.parallel import MegatronParallelConfig


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        path = make_tiny_qwen3(out / "m", num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
    else:
        path = make_tiny_qwen3_moe(out / "m", num_experts=8, num_experts_per_tok=2, dtype="float32")
    return str(path)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_round_trip_is_exact_and_covers_every_checkpoint_tensor(checkpoint):
    layout = ModelLayout.from_hf_config(AutoConfig.from_pretrained(checkpoint))
    hf = _tensors(checkpoint)
    assert set(hf_checkpoint_names(layout)) == set(hf)
    back: dict[str, torch.Tensor] = {}
    for name in layout.megatron_names():
        full = hf_to_megatron(name, hf.__getitem__, layout)
        for hf_name, t in megatron_to_hf(name, full, layout):
            back[hf_name] = t
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_transformer_engine_names_map_to_the_same_checkpoint_tensors(checkpoint):
    # TE fuses the input norm into linear_qkv and a dense layer's pre-MLP norm into linear_fc1: other
    # Megatron names, the same HF tensors, each exactly once
    layout = ModelLayout.from_hf_config(AutoConfig.from_pretrained(checkpoint))
    local, fused = layout.megatron_names(), layout.megatron_names("transformer_engine")
    assert len(local) == len(fused) and set(local) != set(fused)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in fused
    assert not any(n.endswith("input_layernorm.weight") for n in fused)
    hf_names = [n for name in fused for n in rule_for(name, layout).hf_names]
    assert sorted(hf_names) == sorted(hf_checkpoint_names(layout)) == sorted(set(hf_names))
    moe_norms = [n for n in fused if n.endswith("pre_mlp_layernorm.weight")]
    assert len(moe_norms) == len(layout.moe_layers)  # an MoE layer keeps its own pre-MLP norm


def test_megatron_shapes(checkpoint):
    layout = ModelLayout.from_hf_config(AutoConfig.from_pretrained(checkpoint))
    hf = _tensors(checkpoint)
    qkv = hf_to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", hf.__getitem__, layout)
    assert qkv.shape == ((layout.num_attention_heads + 2 * layout.num_key_value_heads) * layout.head_dim,
                         layout.hidden_size)  # fmt: skip
    if layout.is_moe:
        fc1 = hf_to_megatron("decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight", hf.__getitem__, layout)
        assert fc1.shape == (2 * layout.moe_intermediate_size, layout.hidden_size)
        assert layout.moe_layers == tuple(range(layout.num_layers))
    else:
        fc1 = hf_to_megatron("decoder.layers.1.mlp.linear_fc1.weight", hf.__getitem__, layout)
        assert fc1.shape == (2 * layout.intermediate_size, layout.hidden_size)


def test_qkv_is_grouped_query_heads_then_key_then_value():
    """Hand-built case: 4 query heads, 2 groups, head_dim 1, hidden 1. Megatron's fused QKV holds per
    group: its 2 query heads, its key head, its value head."""
    layout = ModelLayout(family="qwen3", num_layers=1, hidden_size=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=1, intermediate_size=1, vocab_size=1, tie_word_embeddings=True, rms_norm_eps=1e-6,
                         rope_theta=1e4, max_position_embeddings=8)  # fmt: skip
    src = {
        "model.layers.0.self_attn.q_proj.weight": torch.tensor([[1.0], [2.0], [3.0], [4.0]]),
        "model.layers.0.self_attn.k_proj.weight": torch.tensor([[10.0], [20.0]]),
        "model.layers.0.self_attn.v_proj.weight": torch.tensor([[100.0], [200.0]]),
    }
    qkv = hf_to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", src.__getitem__, layout)
    assert qkv.flatten().tolist() == [1, 2, 10, 100, 3, 4, 20, 200]
    gate_up = rule_for("decoder.layers.0.mlp.linear_fc1.weight", layout)
    assert gate_up.hf_names == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]


def test_glm45_layout_reads_dense_prefix_shared_experts_and_router():
    cfg = types.SimpleNamespace(
        architectures=["Glm4MoeForCausalLM"], num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=100, tie_word_embeddings=False,
        rms_norm_eps=1e-5, rope_parameters={"rope_theta": 1e6, "partial_rotary_factor": 0.5},
        max_position_embeddings=128, attention_bias=True, use_qk_norm=False, first_k_dense_replace=1,
        n_routed_experts=8, moe_intermediate_size=32, num_experts_per_tok=2, norm_topk_prob=True, n_shared_experts=1,
        routed_scaling_factor=2.5, n_group=1, topk_group=1,
    )  # fmt: skip
    layout = ModelLayout.from_hf_config(cfg)
    assert layout.moe_layers == (1, 2, 3) and layout.partial_rotary_factor == 0.5 and not layout.qk_norm
    names = set(hf_checkpoint_names(layout))
    assert "model.layers.0.mlp.gate_proj.weight" in names  # dense first layer
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.2.self_attn.q_proj.bias" in names
    assert "lm_head.weight" in names and not any(".layers.4." in n for n in names)  # MTP layer not mapped


def test_unknown_architecture_and_unknown_name_are_named():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        ModelLayout.from_hf_config(types.SimpleNamespace(architectures=["LlamaForCausalLM"]))
    layout = ModelLayout(family="qwen3", num_layers=1, hidden_size=1, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=1, intermediate_size=1, vocab_size=1, tie_word_embeddings=True, rms_norm_eps=1e-6,
                         rope_theta=1e4, max_position_embeddings=8)  # fmt: skip
    with pytest.raises(KeyError, match="rotary"):
        rule_for("rotary_pos_emb.inv_freq", layout)
    with pytest.raises(KeyError, match="tied"):
        rule_for("output_layer.weight", layout)


@pytest.mark.parametrize(
    ("kwargs", "world", "message"),
    [
        (dict(tensor_model_parallel_size=3), 8, "not divisible"),
        (dict(sequence_parallel=True), 8, "sequence_parallel needs tensor"),
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), 8, "--transformer-impl transformer_engine"),
        (dict(tensor_model_parallel_size=2), 8, "MoE with tensor_model_parallel_size"),
        (dict(context_parallel_size=2), 8, "not split its micro-batches"),
        (dict(context_parallel_size=2, transformer_impl="transformer_engine"), 8, "context-parallel ranks"),
        (dict(pipeline_model_parallel_size=4), 4, "layers do not split"),
        (dict(expert_model_parallel_size=3), 3, "experts do not split"),
        (dict(recompute_granularity="full"), 1, "recompute_method"),
    ],
)
def test_parallel_layout_errors_name_the_problem(kwargs, world, message):
    with pytest.raises(ValueError, match=message):
        MegatronParallelConfig(**kwargs).validate(world, num_layers=6, num_experts=8)


def test_parallel_layout_accepts_a_seed_recipe_layout():
    # Qwen3-30B-A3B on 8 GPUs: EP 8 (48 layers, 128 experts); Qwen3-4B dense: TP 2 x DP 4
    cfg = MegatronParallelConfig(expert_model_parallel_size=8, recompute_granularity="full", recompute_method="uniform")
    cfg.validate(8, num_layers=48, num_experts=128)
    assert cfg.transformer_kwargs()["expert_model_parallel_size"] == 8
    MegatronParallelConfig(tensor_model_parallel_size=2).validate(8, num_layers=36, num_experts=0)
    # with TransformerEngine's layers, TP + sequence parallel is allowed for MoE
    te = MegatronParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, transformer_impl="transformer_engine")
    te.validate(8, num_layers=48, num_experts=128)
    assert te.transformer_kwargs()["transformer_impl"] == "transformer_engine"


def test_megatron_flags_are_checked_when_the_config_loads():
    from vime.config import ConfigError, load_config

    cfg = load_config(None, {"train_backend": "megatron", "trainer_world_size": 8, "tensor_model_parallel_size": 2,
                             "expert_model_parallel_size": 4})  # fmt: skip
    assert cfg.megatron_parallel().tensor_model_parallel_size == 2
    assert cfg.megatron_parallel().transformer_impl == "local"
    te = load_config(None, {"train_backend": "megatron", "transformer_impl": "transformer_engine"})
    assert te.megatron_parallel().transformer_impl == "transformer_engine"
    with pytest.raises(ConfigError, match="transformer_impl"):
        load_config(None, {"train_backend": "megatron", "transformer_impl": "apex"})
    with pytest.raises(ConfigError, match="not divisible by TP"):
        load_config(None, {"train_backend": "megatron", "trainer_world_size": 4, "tensor_model_parallel_size": 3})
    # the torch backend ignores the Megatron layout flags
    load_config(None, {"trainer_world_size": 4, "tensor_model_parallel_size": 3})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only machine gives")
def test_megatron_backend_without_gpu_or_megatron_core_says_why(checkpoint):
    from vime.config import load_config
    from vime.workers.trainer import build_trainer

    cfg = load_config(None, {"train_backend": "megatron", "hf_checkpoint": checkpoint})
    with pytest.raises(RuntimeError, match="megatron-core|CUDA"):
        build_trainer(cfg)
