"""Exactness of each SFT-step variant against an fp32 reference (a module of sft_step.py).

The reference is the same random-init model in fp32, eager, with transformers' own loss (the
mean over the trained tokens) on the first batch, plain PyTorch: one forward and backward,
nothing wrapped or compiled. Each variant runs its own forward and backward on the same batch
from the same initial weights, before its first optimizer step; its loss per token and the
gradients of a few parameters spread over the model (the embedding, the first and last
decoder layers, the final norm, the head) are compared with the reference's. The variants
compute in bf16 on CUDA, so their errors sit at bf16's rounding (about 1e-2 for gradients),
the same for ours and for the peers; on the CPU they compute in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(kw_only=True, slots=True, frozen=True)
class Reference:
    """The fp32 reference: loss per trained token and the gradients of the checked parameters."""

    loss: float
    grads: dict[str, torch.Tensor]  # name -> fp32 gradient on the CPU


def checked_names(num_layers: int) -> tuple[str, ...]:
    """Parameters compared: one of each kind, from both ends of the model."""
    last = num_layers - 1
    return (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        f"model.layers.{last}.self_attn.o_proj.weight",
        f"model.layers.{last}.mlp.gate_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    )


#: The reference's attention in transformers' registry (registered on first use).
REFERENCE_ATTENTION = "fp32_reference_causal"


def _reference_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention, every query head given its own copy of its key/value head.

    Shapes: query [B, H, S, D], key/value [B, H_kv, S, D] -> output [B, S, H, D]. transformers'
    SDPA path passes ``enable_gqa`` for grouped heads, which only the math kernel takes in fp32:
    it materialises the [B, H, S, S] scores of every layer (over 100 GiB at 4 x 4096 for the
    1.5B model). Repeating the key/value heads first lets fp32 run the memory-efficient kernel.
    """
    del module, attention_mask, dropout, kwargs  # unpadded causal rows: no mask
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def reference(build_model: Callable[[], nn.Module], batch: dict[str, torch.Tensor]) -> Reference:
    """One fp32 eager forward and backward of the unwrapped model on ``batch``."""
    from transformers import AttentionInterface

    model = build_model().float()
    # transformers' registry is global; the name is this bench's own, selected only here.
    AttentionInterface.register(REFERENCE_ATTENTION, _reference_attention)
    model.config._attn_implementation = REFERENCE_ATTENTION
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    loss.backward()
    names = checked_names(model.config.num_hidden_layers)
    params = dict(model.named_parameters())
    grads = {name: params[name].grad.detach().float().cpu() for name in names}
    out = Reference(loss=float(loss.detach()), grads=grads)
    del model, params, loss
    return out


def _full(t: Any) -> torch.Tensor:
    """A plain tensor of a parameter or gradient (FSDP2 holds DTensors)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def errors(model: nn.Module, loss_per_token: torch.Tensor, ref: Reference) -> dict[str, float]:
    """Relative error of the loss and the worst relative error (norm-wise) of the gradients.

    Call after the variant's backward and before its optimizer step.

    Raises:
        RuntimeError: a checked parameter has no gradient (the variant did not reach it).
    """
    params = dict(model.named_parameters())
    worst = 0.0
    for name, want in ref.grads.items():
        grad = params[name].grad
        if grad is None:
            raise RuntimeError(f"{name} has no gradient after the variant's backward")
        got = _full(grad).detach().float().cpu()
        worst = max(worst, float((got - want).norm() / want.norm().clamp(min=1e-30)))
    loss = float(loss_per_token)
    return {"loss rel err": abs(loss - ref.loss) / abs(ref.loss), "grad rel err": worst}
