"""Ranks of the checkpoint-integrity tests (spawned; keep imports light)."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _engine_models import full_state, global_batch, make_model, token_loss_mean
from train_engine import CheckpointCorruptError, Engine, FSDP2Config, apply_data_parallel


def _fsdp2_engine(seed: int) -> Engine:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = apply_data_parallel(make_model(seed), mesh=mesh, config=FSDP2Config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return Engine(model, opt, sched)


def corrupt_then_load(rank: int, world: int, root: str, damage: str) -> dict:
    """Save on all ranks, damage one file (rank 0), load on all ranks into other weights.

    ``damage``: "flip" a byte of rank 1's .distcp, "truncate" rank 1's RNG/extra file, or
    "none". Returns what the load raised on this rank and whether the state stayed as it was.
    """
    engine = _fsdp2_engine(seed=0)
    ids, labels = global_batch(rank, 2)
    engine.backward(token_loss_mean(engine(ids), labels))
    engine.step()
    ckpt = Path(root) / "step_1"
    engine.save_checkpoint(ckpt, extra_state={"rank": rank})
    if rank == 0:
        files = json.loads((ckpt / "COMPLETE").read_text())["files"]
        if damage == "flip":
            target = ckpt / "model_optim" / "__1_0.distcp"
            data = bytearray(target.read_bytes())
            data[len(data) // 2] ^= 0xFF
            target.write_bytes(bytes(data))
        elif damage == "truncate":
            target = ckpt / "rank_00001.pt"
            target.write_bytes(target.read_bytes()[:100])
        assert "model_optim/__1_0.distcp" in files and "rank_00001.pt" in files
    dist.barrier()
    fresh = _fsdp2_engine(seed=7)
    before = full_state(fresh.module)
    lr_before = fresh.optimizer.param_groups[0]["lr"]
    rng_before = torch.get_rng_state()
    raised = None
    try:
        extra = fresh.load_checkpoint(ckpt)
    except CheckpointCorruptError as err:
        raised = str(err)
        extra = None
    after = full_state(fresh.module)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {
        "raised": raised,
        "extra": extra,
        "unchanged": unchanged and fresh.optimizer.param_groups[0]["lr"] == lr_before,
        "rng_unchanged": torch.equal(rng_before, torch.get_rng_state()),
        "optimizer_steps": fresh.optimizer_steps,
    }


def save_onto_a_file(rank: int, world: int, root: str) -> str | None:
    """Every rank saves onto a path that is a user's file: all must refuse, none may hang."""
    engine = _fsdp2_engine(seed=0)
    target = Path(root) / "notes.txt"
    if rank == 0:
        target.write_text("precious")
    dist.barrier()
    try:
        engine.save_checkpoint(target)
    except FileExistsError as err:
        return str(err)
    return None


def full_disk_on_rank_1(rank: int, world: int, root: str, where: str) -> dict:
    """Save step_1, then step_2 with rank 1's writes failing with ENOSPC.

    ``where``: "dcp" (DCP's file writer, after writing) or "rank-file" (torch.save of the
    rank's own file, after DCP succeeded). Returns what the save raised on this rank.
    """
    from torch.distributed.checkpoint import FileSystemWriter

    from train_engine import CheckpointWriteError

    engine = _fsdp2_engine(seed=0)
    ids, labels = global_batch(rank, 2)
    engine.backward(token_loss_mean(engine(ids), labels))
    engine.step()
    engine.save_checkpoint(Path(root) / "step_1")
    full = OSError(errno.ENOSPC, "No space left on device")
    real_write, real_save = FileSystemWriter.write_data, torch.save

    def write_then_fail(self: FileSystemWriter, plan: object, planner: object) -> object:
        real_write(self, plan, planner)
        raise full

    def save_then_fail(obj: object, f: object, *args: object, **kwargs: object) -> None:
        real_save(obj, f, *args, **kwargs)
        if Path(str(f)).name.startswith("rank_"):
            raise full

    if rank == 1 and where == "dcp":
        FileSystemWriter.write_data = write_then_fail  # type: ignore[method-assign]
    if rank == 1 and where == "rank-file":
        torch.save = save_then_fail
    try:
        engine.save_checkpoint(Path(root) / "step_2")
    except CheckpointWriteError as err:
        return {"raised": str(err), "errno": err.errno}
    finally:
        FileSystemWriter.write_data = real_write  # type: ignore[method-assign]
        torch.save = real_save
    return {"raised": None, "errno": None}
