"""The local data plane (sample ids per step and replica) and its place in the checkpoint: a
save interrupted anywhere in the directory swap leaves the previous checkpoint, and its plane,
loadable."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from train_recipes.data.plane import DataPlane, PlaneMismatchError, sample_ids_of
from train_recipes.run.checkpoint_folder import checkpoint_dir, complete_checkpoints
from train_recipes.run.folder import publish_dir
from train_recipes.run.resume import load_newest


def _plane(steps: int, *, dp: int = 2, start: int = 1) -> DataPlane:
    plane = DataPlane(dp_size=dp)
    for step in range(start, start + steps):
        for replica in range(dp):
            plane.record(step, replica, [f"s{step}r{replica}a", f"s{step}r{replica}b"])
    return plane


def test_records_answer_list_sample_ids_and_survive_a_state_round_trip() -> None:
    plane = _plane(3)
    assert plane.steps() == [1, 2, 3]
    assert plane.list_sample_ids(2) == ["s2r0a", "s2r0b", "s2r1a", "s2r1b"]
    assert plane.list_sample_ids(2, replica=1) == ["s2r1a", "s2r1b"]
    # A cp/tp peer reporting the same batch is accepted; another batch is refused.
    plane.record(2, 1, ["s2r1a", "s2r1b"])
    with pytest.raises(PlaneMismatchError, match="step 2, replica 1"):
        plane.record(2, 1, ["x", "y"])
    with pytest.raises(KeyError, match=r"steps 1\.\.3"):
        plane.list_sample_ids(4)
    with pytest.raises(ValueError, match="replica=2"):
        plane.record(4, 2, ["z"])

    copy = DataPlane(dp_size=2)
    copy.load_state_dict(plane.state_dict())
    assert [copy.list_sample_ids(s) for s in copy.steps()] == [
        plane.list_sample_ids(s) for s in plane.steps()
    ]
    copy.truncate(1)
    assert copy.steps() == [1]

    # Replica-local planes (one per loader rank under SPMD) merge into the job's plane.
    left, right = DataPlane(dp_size=2), DataPlane(dp_size=2)
    left.record(1, 0, ["a"])
    right.record(1, 1, ["b"])
    merged = DataPlane(dp_size=2)
    merged.load_state_dict([left.state_dict(), right.state_dict()])
    assert merged.list_sample_ids(1) == ["a", "b"]
    with pytest.raises(PlaneMismatchError, match="not a data plane state"):
        merged.load_state_dict({"steps": []})


def test_sample_ids_come_from_energon_source_ids() -> None:
    assert sample_ids_of({"source_ids": [3, "k"]}) == ["3", "k"]
    with pytest.raises(ValueError, match="source_ids"):
        sample_ids_of({"input_ids": torch.zeros(1)})


def _engine(seed: int) -> object:
    from train_engine import Engine

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return Engine(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _train_one_step(engine: object, seed: int) -> None:
    torch.manual_seed(seed)
    loss = engine(torch.randn(3, 4)).pow(2).sum()  # type: ignore[operator]
    engine.backward(loss)  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]


@pytest.mark.parametrize("crash_at", ["before_swap", "between_renames", "removing_old"])
def test_a_save_interrupted_in_the_swap_leaves_the_previous_checkpoint_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_at: str
) -> None:
    """The recipe saves the plane in the Engine's per-rank extra state; a second save into the
    same checkpoint directory is killed at each point of the swap, and the recipe's loader
    (``complete_checkpoints`` + ``load_newest``) still gets the first save, plane included."""
    engine = _engine(0)
    _train_one_step(engine, 1)
    target = checkpoint_dir(tmp_path, 1)
    first = _plane(1)
    engine.save_checkpoint(target, extra_state={"data_plane": first.state_dict()})  # type: ignore[attr-defined]
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}  # type: ignore[attr-defined]
    _train_one_step(engine, 2)

    real_rename, real_rmtree = Path.rename, shutil.rmtree
    staged = target.with_name(target.name + ".tmp")  # the new save, written whole

    def rename(self: Path, dest: Path) -> Path:
        if crash_at == "before_swap" and self == target:  # about to move the old one aside
            raise KeyboardInterrupt("killed before the swap")
        if crash_at == "between_renames" and self == staged:
            assert not target.exists()  # the previous checkpoint was moved aside already
            raise KeyboardInterrupt("killed between the renames")
        return real_rename(self, dest)

    def rmtree(path: object, *args: object, **kwargs: object) -> None:
        if crash_at == "removing_old" and str(path).endswith(".old"):
            # Half of the old copy is gone when the kill comes.
            for f in sorted(Path(str(path)).rglob("*.pt"))[:1]:
                f.unlink()
            raise KeyboardInterrupt("killed while deleting the old copy")
        real_rmtree(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "rename", rename)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(target, extra_state={"data_plane": _plane(2).state_dict()})  # type: ignore[attr-defined]
    monkeypatch.undo()

    fresh = _engine(5)
    lines: list[str] = []
    loaded = load_newest(fresh, complete_checkpoints(tmp_path), say=lines.append)
    assert loaded is not None, f"no checkpoint loads after a crash {crash_at}: {lines}"
    path, extra = loaded
    assert path == target
    plane = DataPlane(dp_size=2)
    plane.load_state_dict(extra["data_plane"])
    if crash_at == "removing_old":  # the new save was complete before the old was deleted
        assert plane.steps() == [1, 2]
    else:
        assert plane.steps() == [1] and plane.list_sample_ids(1) == first.list_sample_ids(1)
        for name, value in fresh.module.state_dict().items():  # type: ignore[attr-defined]
            assert torch.equal(value, saved[name]), name


def _publish_killed_at_rename(
    monkeypatch: pytest.MonkeyPatch, staging: Path, target: Path, why: str
) -> None:
    """``publish_dir(staging, target)`` killed (KeyboardInterrupt) when it renames ``staging``:
    the renames before that one happen."""
    real_rename = Path.rename

    def rename(self: Path, dest: Path) -> Path:
        if self == staging:
            raise KeyboardInterrupt(why)
        return real_rename(self, dest)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        publish_dir(staging, target)
    monkeypatch.undo()


def test_publish_dir_keeps_the_only_copy_after_a_crash_between_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash between publish_dir's renames leaves ``<dir>.old`` as the only copy; the next
    publish must not delete it before the new folder is in place."""
    target = tmp_path / "tokenizer"
    for version in ("v1", "v2"):
        staging = tmp_path / f"stage-{version}"
        staging.mkdir()
        (staging / "version").write_text(version)
        if version == "v1":
            publish_dir(staging, target)
            continue
        _publish_killed_at_rename(monkeypatch, staging, target, "killed between the renames")
    old = tmp_path / "tokenizer.old"
    assert not target.exists() and (old / "version").read_text() == "v1"

    # The next publish is killed right before its rename: v1 must still be there.
    staging = tmp_path / "stage-v3"
    staging.mkdir()
    (staging / "version").write_text("v3")
    _publish_killed_at_rename(monkeypatch, staging, target, "killed before the rename")
    assert (old / "version").read_text() == "v1", "the only copy was deleted"
    publish_dir(staging, target)
    assert (target / "version").read_text() == "v3" and not old.exists()
