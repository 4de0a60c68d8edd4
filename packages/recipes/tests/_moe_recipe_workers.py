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
    from train_recipes.export.command import export_checkpoint

    return str(export_checkpoint(checkpoint, out_dir))


def export_after_build_on_rank(
    rank: int, world_size: int, model_dir: str, out_root: str, layouts: list[tuple[str, int]]
) -> dict[str, list[str]]:
    """Build ``model_dir`` for training under each (data_parallel, ep) of ``layouts``, move every
    live weight by +0.5 (so the export must come from the distributed model, not the folder),
    and export it at once (collective). Rank 0 returns, per layout, the keys whose exported
    weights (loaded with from_pretrained) differ from the folder's weights + 0.5."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train_recipes.config import SFTConfig, load_config
    from train_recipes.export.hf import export_hf
    from train_recipes.model.parallelize import build_parallel_model
    from train_recipes.run.process_group import init_distributed

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    want = {
        k: v + 0.5 for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()
    }
    mismatches: dict[str, list[str]] = {}
    for data_parallel, ep in layouts:
        overrides = [
            f"model.path={model_dir}",
            f"parallel.data_parallel={data_parallel}",
            f"parallel.ep={ep}",
            "train.device=cpu",
        ]
        config = load_config(SFTConfig, None, overrides)
        ctx = init_distributed(device_preference="cpu", cp=1)
        torch.manual_seed(0)
        model = build_parallel_model(config, tokenizer, ctx)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)  # a DTensor or an ep shard moves its local part: the whole moves
        name = f"{data_parallel}-ep{ep}"
        written = export_hf(model, tokenizer, Path(out_root) / name, is_main=ctx.is_main)
        if written is None:
            continue
        got = AutoModelForCausalLM.from_pretrained(written).state_dict()
        mismatches[name] = sorted(
            k
            for k in want.keys() | got.keys()
            if k not in got or k not in want or not torch.equal(got[k], want[k])
        )
    return mismatches if rank == 0 else {}
