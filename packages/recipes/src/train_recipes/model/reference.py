"""A frozen reference model built like the policy: the KL / DPO anchor of preference and RL recipes.

The reference is the policy's starting point: the same build (``model.path``, or the tiny
random-init model under the same seed), on the same device, sharded like the policy where that
is cheap (tensor parallelism; FSDP2 shards its weights over the same gradient mesh), with no
gradient and in eval mode. It is never wrapped by DDP (nothing to synchronise) and never gets
LoRA adapters (the reference is the base model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from train_recipes.model.build import build_model, unwrap
from train_recipes.model.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from train_recipes.config.sft import SFTConfig
    from train_recipes.run.process_group import RankContext

__all__ = ["build_reference_model", "check_same_vocabulary"]


def build_reference_model(
    config: SFTConfig,
    tokenizer: PreTrainedTokenizerBase,
    ctx: RankContext,
    *,
    init_seed: int | None = None,
) -> nn.Module:
    """The frozen reference copy of the policy that ``config`` builds.

    Args:
        config: the policy's (validated) config; ``model``, ``parallel`` are read, ``lora`` is
            not (the reference is the base model).
        tokenizer: the run's tokenizer (a random-init model takes its vocabulary size).
        ctx: this rank's process groups and device.
        init_seed: for a random-init model (``model.path`` None): its weights come from
            ``torch.manual_seed(init_seed)``, which equals a policy built right after the same
            seeding; the global RNG is left as it was. None draws from the global RNG.

    Returns:
        The model on ``ctx.device``, tensor-parallel like the policy, FSDP2-sharded under
        ``parallel.data_parallel: fsdp2``, ``requires_grad`` False everywhere, in eval mode.

    Raises:
        ValueError: ``model.backend`` is "megatron" (no reference build for it).
    """
    if config.model.backend != "hf":
        raise ValueError(
            f"model.backend={config.model.backend!r} has no frozen reference build; use "
            "model.backend=hf, or give the reference log-probs as columns"
        )
    with torch.random.fork_rng(devices=[]):  # the tiny model is drawn on the CPU
        if init_seed is not None:
            torch.manual_seed(init_seed)
        model = build_model(config, tokenizer)
    model.requires_grad_(False)
    model = model.to(ctx.device)
    if ctx.tp_size > 1:
        model = apply_tensor_parallel(
            model, ctx.mesh["tp"], sequence_parallel=config.parallel.sequence_parallel
        )
    if config.parallel.data_parallel == "fsdp2":
        from train_engine import apply_data_parallel

        # Sharded weights, gathered per block in forward; frozen parameters get no reduce.
        model = apply_data_parallel(
            model, mesh=ctx.grad_mesh(), config=config.parallel.data_parallel_config()
        )
    model.eval()
    return model


def check_same_vocabulary(policy: nn.Module, reference: nn.Module) -> None:
    """Refuse a reference whose output vocabulary differs from the policy's.

    Raises:
        ValueError: naming both sizes.
    """
    sizes = []
    for model in (policy, reference):
        inner = unwrap(getattr(model, "module", model))
        get_base = getattr(inner, "get_base_model", None)  # peft
        base = get_base() if callable(get_base) else inner
        get_head = getattr(base, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        # A DTensor's shape is the global one: tensor-parallel heads compare whole.
        weight = getattr(head, "weight", None)
        sizes.append(int(weight.shape[0]) if isinstance(weight, torch.Tensor) else -1)
    if sizes[0] != sizes[1]:
        raise ValueError(
            f"the reference model's vocabulary has {sizes[1]} entries, the policy's {sizes[0]}; "
            "build both from the same model.path and tokenizer"
        )
