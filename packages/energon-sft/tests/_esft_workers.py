"""Rank functions for energon-sft's distributed tests (spawned ranks import this module)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch.distributed as dist


def check_owner_broadcast(rank: int, world_size: int, ds: str) -> dict[str, Any]:
    """dp = world/2, tp=2: each replica's owner runs the loader and broadcasts to its tp peer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _esft_data import batch_digest, build_tokenizer
    from energon_sft import SFTTaskEncoder, TopologyMapper, broadcast_batch, build_sft_loader

    mapper = TopologyMapper(dp=world_size // 2, tp=2)
    group = mapper.new_replica_group()
    dp_rank = mapper.dp_rank(rank)
    digests = []
    batch = None
    it = None
    if mapper.is_loader_owner(rank):
        enc = SFTTaskEncoder(build_tokenizer(), model_family="text", max_length=128)
        loader = build_sft_loader(
            ds,
            encoder=enc,
            batch_size=2,
            dp_rank=dp_rank,
            dp_world_size=world_size // 2,
            num_workers=0,
            seed=5,
        )
        it = iter(loader)
    for _ in range(3):
        batch = next(it) if it is not None else None
        got = broadcast_batch(batch, mapper=mapper, group=group)
        digests.append(batch_digest(got))
    dist.destroy_process_group(group)
    return {
        "dp_rank": dp_rank,
        "owner": mapper.is_loader_owner(rank),
        "digests": digests,
        "hash": hashlib.sha256("".join(digests).encode()).hexdigest(),
        "placement": mapper.placement_hash(),
    }


def check_owner_failure_reaches_peers(rank: int, world_size: int) -> dict[str, Any]:
    """The owner's loader raises on the 2nd batch and ends after the 3rd: all ranks agree."""
    from energon_sft import TopologyMapper, broadcast_next

    mapper = TopologyMapper(dp=world_size // 2, tp=2)
    group = mapper.new_replica_group()

    def failing() -> Any:
        yield {"step": 0}
        raise ValueError("disk on fire")

    it = failing() if mapper.is_loader_owner(rank) else None
    first = broadcast_next(it, mapper=mapper, group=group)
    error = ""
    try:
        broadcast_next(it, mapper=mapper, group=group)
    except RuntimeError as exc:
        error = str(exc)
    ended = iter([{"step": 1}]) if mapper.is_loader_owner(rank) else None
    broadcast_next(ended, mapper=mapper, group=group)
    stopped = False
    try:
        broadcast_next(ended, mapper=mapper, group=group)
    except StopIteration:
        stopped = True
    no_iterator = ""  # the owner passes None by mistake: every rank raises, none waits
    try:
        broadcast_next(None, mapper=mapper, group=group)
    except RuntimeError as exc:
        no_iterator = str(exc)
    dist.destroy_process_group(group)
    return {"first": first, "error": error, "stopped": stopped, "no_iterator": no_iterator}


def check_restore_refusal_is_agreed(rank: int, world_size: int, ds: str) -> dict[str, Any]:
    """Rank 1 gets a state of another batch size; with group=, both ranks raise."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _esft_data import build_tokenizer
    from energon_sft import SFTTaskEncoder, StateMismatchError, build_sft_loader

    enc = SFTTaskEncoder(build_tokenizer(), model_family="text", max_length=128)

    def make(bs: int) -> Any:
        return build_sft_loader(
            ds, encoder=enc, batch_size=bs, dp_rank=rank, dp_world_size=world_size,
            num_workers=0, seed=0,
        )  # fmt: skip

    state = make(2 if rank == 0 else 3).state_dict()
    try:
        make(2).load_state_dict(state, group=dist.group.WORLD)
    except StateMismatchError as exc:
        return {"raised": True, "msg": str(exc)}
    return {"raised": False, "msg": ""}
