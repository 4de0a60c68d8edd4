"""Rank functions of the MoE recipe tests (a light module: ranks re-import it)."""

from __future__ import annotations

from typing import Any

import torch

from _recipes_workers import run_sft_on_rank


def run_moe_sft_on_rank(rank: int, world_size: int, *sft_args: Any) -> dict[str, Any]:
    """:func:`run_sft_on_rank` with the same arguments (``overrides``, ``probe``, ``resume``),
    also returning (on every rank) the token count of each MoE layer call in training forwards,
    to show that the ep ranks dispatch unequal numbers of tokens."""
    from moe_dispatch import ExpertParallelMoE

    tokens: list[int] = []

    def record(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if isinstance(module, ExpertParallelMoE) and module.training and args:
            tokens.append(int(args[0].shape[:-1].numel()))

    hook = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        result = run_sft_on_rank(rank, world_size, *sft_args)
    finally:
        hook.remove()
    return {**result, "moe_tokens": tokens}


def export_on_rank(rank: int, world_size: int, checkpoint: str, out_dir: str) -> str:
    """``train-recipes export`` of ``checkpoint`` (one process, all experts) into ``out_dir``."""
    from train_recipes.export import export_checkpoint

    return str(export_checkpoint(checkpoint, out_dir))
