"""Whole-model tensor parallelism: at tp=2 the loss and every gradient equal the single-process
float64 model's, for unmodified transformers models loaded from a save_pretrained folder; bad
configs and unknown architectures are rejected naming the key and the supported models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _scale_workers import batch_for, reference_token_sum_loss, save_tiny, tp_loss_and_grads
from train_recipes.config import ConfigError, SFTConfig, load_config, validate_sft
from train_recipes.model.tensor_parallel import SUPPORTED_ARCHITECTURES, plan_for


def _auto(kind: str) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if kind == "qwen2_5_vl" else AutoModelForCausalLM


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("kind", "sequence_parallel", "compiled"),
    [
        *[
            pytest.param(kind, sp, False, id=f"{kind}-{'tp+sp' if sp else 'tp'}")
            for kind in ("llama", "qwen2", "qwen3", "qwen2_5_vl")
            for sp in (False, True)
        ],
        # Compiled decoder layers holding the DTensor hooks (works with sequence parallel).
        pytest.param("llama", True, True, id="llama-tp+sp-compiled", marks=pytest.mark.slow),
    ],
)
def test_tp2_loss_and_gradients_equal_single_process(
    rank_pool: Any, kind: str, sequence_parallel: bool, compiled: bool, tmp_path: Path
) -> None:
    """Llama untied; Qwen2 with q/k/v biases; Qwen3 tied with per-head q/k norms; Qwen2.5-VL
    tied, with an image merged into the embeddings before the sequence is split; and Llama
    with sequence parallel and torch.compile'd decoder layers (aot_eager)."""
    model_dir = save_tiny(kind, tmp_path / kind)
    results = rank_pool.run(
        2,
        tp_loss_and_grads,
        kind,
        str(model_dir),
        sequence_parallel,
        compiled,
        timeout_s=240,
    )

    # Reference: the same folder in one process, float64, plain cross-entropy.
    reference = _auto(kind).from_pretrained(model_dir, dtype=torch.float64)
    loss = reference_token_sum_loss(reference, batch_for(kind))
    loss.backward()
    heads_rows = 4 * 16  # 4 query heads of 16
    for rank, result in enumerate(results):
        assert result["local_q_rows"] == heads_rows // 2, "q_proj is not sharded over heads"
        # Sequence parallel: each rank keeps half of the 12 positions between the blocks.
        assert result["residual_length"] == (6 if sequence_parallel else 12), result
        assert result["loss"] == pytest.approx(float(loss.detach()), rel=1e-6), rank
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        assert result["grads"].keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            # vocab-parallel's loss is float32 whatever the logits' dtype: ~1e-7 relative.
            scale = float(grad.abs().max())
            err = float((result["grads"][name] - grad).abs().max())
            assert err <= 1e-6 * scale + 1e-12, f"{kind} {name}: max error {err}, scale {scale}"


def test_unknown_architecture_names_the_supported_ones_and_the_fix() -> None:
    with pytest.raises(ValueError, match="no plan for GPT2LMHeadModel") as info:
        plan_for("GPT2LMHeadModel")
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(info.value)
    assert "_PLANS" in str(info.value)
    assert "Qwen2_5_VLForConditionalGeneration" in SUPPORTED_ARCHITECTURES


def _tp_config(*overrides: str) -> SFTConfig:
    return load_config(
        SFTConfig, None, ["parallel.tp=2", "parallel.data_parallel=fsdp2", *overrides]
    )


def test_tp_config_checks(tmp_path: Path) -> None:
    validate_sft(_tp_config(), world_size=2)  # the tied tiny default is fine
    with pytest.raises(ConfigError) as info:
        validate_sft(
            _tp_config("model.tiny.num_heads=2", "model.tiny.num_kv_heads=1"), world_size=2
        )
    assert info.value.key == "model.tiny.num_kv_heads"
    validate_sft(_tp_config("lora.enabled=true"), world_size=2)  # LoRA adapters shard too
    # Compiled layers work with the sequence-parallel plan (the default), not without it.
    validate_sft(_tp_config("model.compile=true"), world_size=2)
    with pytest.raises(ConfigError, match="sequence_parallel=false fail in backward") as info:
        validate_sft(
            _tp_config("model.compile=true", "parallel.sequence_parallel=false"), world_size=2
        )
    assert info.value.key == "model.compile"
    # A model folder: the architecture and the head counts come from its config.json.
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "num_attention_heads": 4})
    )
    with pytest.raises(ConfigError, match="no tensor-parallel plan for GPT2LMHeadModel"):
        validate_sft(_tp_config(f"model.path={folder}"), world_size=2)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                "text_config": {"num_attention_heads": 4, "num_key_value_heads": 1},
            }
        )
    )
    with pytest.raises(ConfigError, match=r"key/value heads 1") as info:
        validate_sft(_tp_config(f"model.path={folder}"), world_size=2)
    assert info.value.key == "parallel.tp"
