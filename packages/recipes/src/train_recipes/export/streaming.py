"""Hugging Face export without gathering the whole model on one rank.

The state dict is cut, in order, into safetensors shards of at most ``max_shard_bytes``;
shard ``i`` is written by rank ``i % world``. Tensors are gathered one at a time (each
``full_tensor()`` is a collective every rank joins in the same order) and kept only by the
rank that writes them, which frees its shard once written. So a rank holds at most one shard
plus one tensor, instead of rank 0 holding the whole model, and the writes are spread over
the ranks. Rank 0 writes ``config.json`` (and ``generation_config.json``) and, for several
shards, ``model.safetensors.index.json``; a single shard is ``model.safetensors``, as
``save_pretrained`` names it. A weight tied to another (the output projection sharing the
embedding) is written once, under the first name, as transformers does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["export_streaming"]

logger = logging.getLogger(__name__)

# transformers' default shard size for save_pretrained.
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def _plan(
    entries: list[tuple[str, torch.Tensor]], max_shard_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive entries grouped into shards of at most ``max_shard_bytes``.

    A larger tensor gets a shard of its own. Depends only on names, shapes and dtypes: the same
    on every rank.
    """
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in entries:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    return shards


@torch.no_grad()
def export_streaming(
    model: nn.Module,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write ``model`` (plain, DDP-unwrapped, FSDP2 and/or TP) as a transformers folder.

    Collective when a process group is initialised: every rank must call it.

    Args:
        model: a transformers model; DTensor parameters are gathered tensor by tensor.
        out_dir: the folder (created); the caller adds the tokenizer.
        max_shard_bytes: the largest safetensors file, before a new shard starts.

    Returns:
        ``out_dir``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    entries = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue  # a tied alias: transformers writes the weight once
        seen.add(id(tensor))
        entries.append((name, tensor))
    shards = _plan(entries, max_shard_bytes)
    count = len(shards)
    names = (
        ["model.safetensors"]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    if dist.is_initialized():
        dist.barrier()  # the folder exists before any rank writes into it
    weight_map: dict[str, str] = {}
    total = 0
    for index, shard in enumerate(shards):
        writer = index % world
        kept: dict[str, torch.Tensor] = {}
        for name, tensor in shard:
            value: Any = tensor.detach()
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()  # collective: every rank, same order
            if rank == writer:
                kept[name] = value.to("cpu").contiguous()
            weight_map[name] = names[index]
            total += value.numel() * value.element_size()
        if rank == writer:
            save_file(kept, str(out / names[index]), metadata={"format": "pt"})
        del kept
    if rank == 0:
        config: Any = getattr(model, "config", None)
        if config is not None:
            config.architectures = [type(model).__name__]
            config.save_pretrained(out)
        generation: Any = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(out)
        if count > 1:
            index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    if dist.is_initialized():
        dist.barrier()  # the folder is complete on return
    logger.info("exported %d tensors in %d shard(s) to %s", len(entries), count, out)
    return out
