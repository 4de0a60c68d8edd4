"""Rank functions for the fused-loss tests: the recipe's token-sum loss through the fused
linear cross-entropy under FSDP2 and under tensor parallelism (spawned ranks import this)."""

from __future__ import annotations

from typing import Any

import torch

from _scale_workers import batch_for, full_grads, tiny_hf_model


def fused_loss(
    model: Any, batch: dict[str, Any], *, chunk_tokens: int | None = None
) -> torch.Tensor:
    """The recipe's loss hook; asserts that it took the fused path (no logits built)."""
    from train_recipes.loss.fused_loss import fused_head, token_sum_loss_of

    assert fused_head(model) is not None, "the fused path was not taken"
    inputs = dict(batch)
    labels = inputs.pop("labels")
    return token_sum_loss_of(model, inputs, labels, chunk_tokens=chunk_tokens)


def fused_under_fsdp2(rank: int, world_size: int, reshard: bool | None) -> dict[str, Any]:
    """One forward and backward of a tiny Llama under FSDP2 (float64), each rank its own batch;
    ``reshard``: FSDP2Config.reshard_after_forward (True: the root too)."""
    from torch.distributed.device_mesh import init_device_mesh

    from train_engine import FSDP2Config, apply_data_parallel

    torch.manual_seed(0)
    model = apply_data_parallel(
        tiny_hf_model("llama"),
        mesh=init_device_mesh("cpu", (world_size,)),
        config=FSDP2Config(reshard_after_forward=reshard),
    )
    loss = fused_loss(model, batch_for("llama", seed=10 + rank))
    loss.backward()
    return {"loss": float(loss.detach()), "grads": full_grads(model)}


def fused_under_tp(rank: int, world_size: int, kind: str, model_dir: str) -> dict[str, Any]:
    """The saved model (float64) over tp=world: the head's weight is a Shard(0) DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from train_recipes.model.tensor_parallel import apply_tensor_parallel

    auto = AutoModelForImageTextToText if kind == "qwen2_5_vl" else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float64)
    apply_tensor_parallel(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
    loss = fused_loss(model, batch_for(kind))
    loss.backward()
    return {"loss": float(loss.detach()), "grads": full_grads(model)}
