"""Checkpoint storage: a failed save is one line and leaves nothing behind; weights-only saves.

A full disk is simulated by fault injection (the DCP file writer, torch.save or a rename
raising), never by filling a real filesystem.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

import _integrity_workers as iw
from _engine_models import global_batch, make_model, token_loss_mean
from train_engine import (
    CheckpointWriteError,
    Engine,
    MasterWeightAdamW,
    complete_checkpoints,
    load_checkpoint,
)
from train_engine import _checkpoint_save as saving

# torch.save into a file reports a short write so, without an errno (inline_container.cc).
UNEXPECTED_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def _engine(seed: int = 0) -> Engine:
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Engine(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))


def _train(engine: Engine, steps: int, seed: int) -> None:
    for step in range(steps):
        ids, labels = global_batch(seed + step, 2)
        engine.backward(token_loss_mean(engine(ids), labels))
        engine.step()


def _params(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


@pytest.mark.parametrize(
    ("fault", "free", "code", "named"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), None, errno.ENOSPC, "ENOSPC"),
        # torch lost the errno: a full filesystem after the failure names it all the same.
        (RuntimeError(UNEXPECTED_POS), 4096, errno.ENOSPC, "the filesystem is full: ENOSPC"),
        (RuntimeError(UNEXPECTED_POS), 50 << 30, None, "unexpected pos 704 vs 598"),
    ],
    ids=["errno", "full-without-errno", "other-failure"],
)
def test_a_failed_save_is_one_line_removes_its_tmp_and_keeps_the_previous_checkpoint(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fault: Exception,
    free: int | None,
    code: int | None,
    named: str,
) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    engine = _engine()
    _train(engine, 1, seed=1)
    engine.save_checkpoint(tmp_path / "step_1", extra_state="one")
    saved = _params(engine)
    _train(engine, 1, seed=2)
    real_write = FileSystemWriter.write_data

    def write_then_fail(self: FileSystemWriter, plan: object, planner: object) -> object:
        real_write(self, plan, planner)  # the bytes reach the disk, then the error
        raise fault

    monkeypatch.setattr(FileSystemWriter, "write_data", write_then_fail)
    if free is not None:
        monkeypatch.setattr(saving, "free_disk_bytes", lambda path: free)
    for target in ("step_2", "step_1"):  # a new checkpoint, and replacing the previous one
        with pytest.raises(CheckpointWriteError) as info:
            engine.save_checkpoint(tmp_path / target, extra_state="two")
        message = str(info.value)
        assert "\n" not in message and "Traceback" not in message, message
        assert f"could not save checkpoint {tmp_path / target}: " in message, message
        assert named in message and "written to" in message and "free on" in message, message
        assert info.value.errno == code and info.value.bytes_written > 0, vars(info.value)
        assert not (tmp_path / f"{target}.tmp").exists(), "the partial save was left behind"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    monkeypatch.undo()
    fresh = _engine(seed=5)
    assert fresh.load_checkpoint(tmp_path / "step_1") == "one"
    assert all(torch.equal(v, saved[k]) for k, v in _params(fresh).items())


def test_a_failed_swap_puts_the_previous_checkpoint_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine()
    _train(engine, 1, seed=1)
    ckpt = tmp_path / "latest"
    engine.save_checkpoint(ckpt, extra_state="one")
    _train(engine, 1, seed=2)
    real_rename = Path.rename

    def fail_the_new_one(self: Path, target: Path) -> Path:
        if self.name == "latest.tmp":
            raise OSError(errno.EIO, "Input/output error")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", fail_the_new_one)
    with pytest.raises(CheckpointWriteError, match=r"EIO \(Input/output error\)"):
        engine.save_checkpoint(ckpt, extra_state="two")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    assert _engine(seed=5).load_checkpoint(ckpt) == "one"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where", ["dcp", "rank-file"])
def test_two_ranks_agree_when_one_rank_cannot_write(rank_pool, tmp_path: Path, where: str) -> None:
    """Rank 1 alone fails (in DCP's writer, or in its own file after DCP succeeded): both
    ranks raise the same error, none hangs, and only the previous checkpoint remains."""
    results = rank_pool.run(2, iw.full_disk_on_rank_1, str(tmp_path), where, timeout_s=120)
    messages = [r["raised"] for r in results]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert "ENOSPC" in messages[0] and "[rank 1]" in messages[0], messages[0]
    assert all(r["errno"] == errno.ENOSPC for r in results), results
    assert complete_checkpoints(tmp_path) == [tmp_path / "step_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_weights_only_checkpoint_restarts_the_optimizer_from_the_loaded_weights(
    tmp_path: Path,
) -> None:
    """optimizer_state=False: about a sixth of the size with master weights; the load takes
    the weights, and MasterWeightAdamW's next step starts from them (not its old masters)."""

    def bf16_engine(seed: int) -> Engine:
        model = make_model(seed, dtype=torch.bfloat16)
        return Engine(model, MasterWeightAdamW(model.parameters(), lr=1e-2, backend="torch"))

    engine = bf16_engine(0)
    _train(engine, 2, seed=1)
    engine.save_checkpoint(tmp_path / "full")
    engine.save_checkpoint(tmp_path / "weights", optimizer_state=False)
    size = {
        name: sum(f.stat().st_size for f in (tmp_path / name).rglob("*.distcp"))
        for name in ("full", "weights")
    }
    assert size["weights"] * 5 < size["full"], size
    probe = bf16_engine(3)
    for name, holds in (("full", True), ("weights", False)):
        loaded = load_checkpoint(tmp_path / name, model=probe.module, optimizer=probe.optimizer)
        assert loaded.optimizer_state is holds, name

    other = bf16_engine(4)
    _train(other, 1, seed=7)  # moments and master weights of another trajectory
    other.load_checkpoint(tmp_path / "weights")
    assert other.optimizer_steps == 2
    for p, q in zip(engine.module.parameters(), other.module.parameters(), strict=True):
        assert torch.equal(q.detach(), p.detach())
        state = other.optimizer.state[q]
        assert torch.equal(state["master_param"], p.detach().float())
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    # The next step is a fresh optimizer's first step on the loaded weights.
    reference = bf16_engine(9)
    reference.module.load_state_dict(engine.module.state_dict())
    reference = Engine(
        reference.module, MasterWeightAdamW(reference.module.parameters(), lr=1e-2, backend="torch")
    )
    _train(reference, 1, seed=3)
    _train(other, 1, seed=3)
    for p, q in zip(reference.module.parameters(), other.module.parameters(), strict=True):
        assert torch.equal(q.detach(), p.detach())
