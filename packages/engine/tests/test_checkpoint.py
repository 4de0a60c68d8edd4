"""Checkpoints: bitwise resume after SIGKILL (2 gloo ranks, FSDP2), atomic saves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import _engine_workers as w
from _engine_models import IGNORE, global_batch, make_model, token_loss_mean
from train_engine import Engine, latest_checkpoint
from train_testing import RankError, run_on_ranks

TOTAL, KILL_AT = 8, 5


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigkill_resume_is_bitwise_identical(rank_pool, tmp_path: Path) -> None:
    straight = rank_pool.run(2, w.resume_run, str(tmp_path / "straight"), TOTAL, None, False)
    root = tmp_path / "killed"
    with pytest.raises(RankError) as info:
        run_on_ranks(2, w.resume_run, str(root), TOTAL, KILL_AT, False, timeout_s=240)
    assert all(f.kind in ("died", "blocked") for f in info.value.failures), info.value
    assert any(f.kind == "died" for f in info.value.failures), info.value
    assert latest_checkpoint(root) == root / "step_4"
    resumed = rank_pool.run(2, w.resume_run, str(root), TOTAL, None, True)
    for rank in range(2):
        assert resumed[rank]["start"] == 4
        expected = {s: v for s, v in straight[rank]["losses"].items() if s >= 4}
        assert resumed[rank]["losses"] == expected, f"rank {rank}: losses after resume differ"
        for name, value in straight[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], value), f"rank {rank}: {name}"
    # The run must actually learn and be random enough for the check to mean something:
    # dropout and data differ per rank, so the two ranks' losses differ.
    assert straight[0]["losses"] != straight[1]["losses"]


def _local_engine(seed: int = 0) -> Engine:
    model = make_model(seed, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return Engine(model, opt, sched, gradient_accumulation_steps=2)


def _train(engine: Engine, steps: int, seed: int) -> None:
    for step in range(steps):
        for mb in range(2):
            ids, labels = global_batch(seed + 10 * step + mb, 2)
            engine.backward(token_loss_mean(engine(ids), labels))
            engine.step()


def _params(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _kill_when_renaming(monkeypatch: pytest.MonkeyPatch, name: str, why: str) -> None:
    """``Path.rename`` of a path named ``name`` raises KeyboardInterrupt, as a kill would."""
    real_rename = Path.rename

    def crash(self: Path, target: Path) -> Path:
        if self.name == name:
            raise KeyboardInterrupt(why)
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", crash)


def _save_then_kill_next_save(
    monkeypatch: pytest.MonkeyPatch,
    ckpt: Path,
    first: object,
    second: object,
    *,
    steps: int,
    seeds: tuple[int, int],
    renaming: str,
) -> tuple[Engine, dict[str, torch.Tensor], float]:
    """Train ``steps`` and save ``first`` to ``ckpt``; train one step more, then kill the save
    of ``second`` into the same directory when it renames the entry called ``renaming``.

    Returns:
        The engine, and its parameters and learning rate as saved in the first checkpoint.
    """
    engine = _local_engine()
    _train(engine, steps, seed=seeds[0])
    engine.save_checkpoint(ckpt, extra_state=first)
    saved = _params(engine)
    saved_lr = engine.optimizer.param_groups[0]["lr"]
    _train(engine, 1, seed=seeds[1])
    _kill_when_renaming(monkeypatch, renaming, f"simulated kill renaming {renaming}")
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(ckpt, extra_state=second)
    monkeypatch.undo()
    return engine, saved, saved_lr


def test_interrupted_save_leaves_previous_checkpoint_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "latest"
    # Interrupt the next save into the same directory when the swap starts: its files are all
    # written to latest.tmp, the previous checkpoint is not yet moved aside.
    engine, saved, saved_lr = _save_then_kill_next_save(
        monkeypatch,
        ckpt,
        {"position": 2},
        {"position": 3},
        steps=2,
        seeds=(1, 2),
        renaming="latest",
    )
    assert (tmp_path / "latest.tmp").exists() and not (tmp_path / "latest.old").exists()
    assert ckpt.exists()
    assert latest_checkpoint(tmp_path) is not None

    fresh = _local_engine(seed=5)
    extra = fresh.load_checkpoint(latest_checkpoint(tmp_path))
    assert extra == {"position": 2}
    assert fresh.optimizer_steps == 2
    assert fresh.optimizer.param_groups[0]["lr"] == saved_lr
    for k, v in _params(fresh).items():
        assert torch.equal(v, saved[k]), k

    # A later complete save replaces both the old checkpoint and the leftover .tmp.
    engine.save_checkpoint(ckpt, extra_state={"position": 3})
    assert not (tmp_path / "latest.tmp").exists()
    assert _local_engine().load_checkpoint(ckpt) == {"position": 3}


def test_crash_between_renames_falls_back_to_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    # The old checkpoint was already moved aside when the new one's rename is killed.
    _save_then_kill_next_save(
        monkeypatch, ckpt, "first", "second", steps=1, seeds=(3, 4), renaming="ckpt.tmp"
    )
    assert not ckpt.exists() and (tmp_path / "ckpt.old").exists()
    assert latest_checkpoint(tmp_path) == ckpt
    fresh = _local_engine()
    assert fresh.load_checkpoint(ckpt) == "first"
    assert fresh.optimizer_steps == 1


def test_load_errors_name_the_problem(tmp_path: Path) -> None:
    engine = _local_engine()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        engine.load_checkpoint(tmp_path / "missing")
    assert latest_checkpoint(tmp_path / "missing") is None
    ids, labels = global_batch(0, 2)
    engine.backward(token_loss_mean(engine(ids), labels))
    with pytest.raises(RuntimeError, match="middle of a window"):
        engine.save_checkpoint(tmp_path / "x")
    engine.step()
    assert (labels != IGNORE).any()


def test_local_resume_restores_rng_and_scheduler(tmp_path: Path) -> None:
    """Single process: save, continue; load into a fresh Engine, continue; bitwise equal."""
    a = _local_engine()
    _train(a, 2, seed=7)
    a.save_checkpoint(tmp_path / "c")
    _train(a, 2, seed=9)
    b = _local_engine(seed=3)
    torch.manual_seed(12345)  # scramble the RNG: dropout must come from the checkpoint
    b.load_checkpoint(tmp_path / "c")
    _train(b, 2, seed=9)
    for k, v in _params(a).items():
        assert torch.equal(v, _params(b)[k]), k
    assert a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"]
    assert a.state_dict() == b.state_dict()
