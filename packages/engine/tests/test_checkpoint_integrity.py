"""Corrupt checkpoints are detected before any state changes (issue 17 item 5)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import _integrity_workers as iw
from _engine_models import global_batch, make_model, token_loss_mean
from train_engine import CheckpointCorruptError, Engine, complete_checkpoints, latest_checkpoint

DISTCP = Path("model_optim") / "__0_0.distcp"


def _engine(seed: int = 0) -> Engine:
    model = make_model(seed, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return Engine(model, opt, sched)


def _train(engine: Engine, steps: int, seed: int) -> None:
    for step in range(steps):
        ids, labels = global_batch(seed + step, 2)
        engine.backward(token_loss_mean(engine(ids), labels))
        engine.step()


def _snapshot(engine: Engine) -> dict:
    return {
        "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "optim": [{k: v.clone() for k, v in s.items()} for s in engine.optimizer.state.values()],
        "lr": engine.optimizer.param_groups[0]["lr"],
        "sched": engine.lr_scheduler.state_dict(),  # type: ignore[union-attr]
        "engine": engine.state_dict(),
        "rng": torch.get_rng_state(),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), f"parameter {k} changed"
    assert len(a["optim"]) == len(b["optim"])
    for x, y in zip(a["optim"], b["optim"], strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x), "optimizer state changed"
    assert (a["lr"], a["sched"], a["engine"]) == (b["lr"], b["sched"], b["engine"])
    assert torch.equal(a["rng"], b["rng"]), "RNG state changed"


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Engine, Path]:
    engine = _engine()
    _train(engine, 2, seed=1)
    ckpt = tmp_path / "step_2"
    engine.save_checkpoint(ckpt, extra_state={"at": 2})
    return engine, ckpt


def _expect_corrupt(ckpt: Path, file: Path) -> CheckpointCorruptError:
    fresh = _engine(seed=5)
    _train(fresh, 1, seed=9)  # some optimizer state to keep
    before = _snapshot(fresh)
    with pytest.raises(CheckpointCorruptError) as info:
        fresh.load_checkpoint(ckpt)
    message = str(info.value)
    assert str(ckpt) in message and str(file) in message, message
    assert info.value.checkpoint == ckpt
    _assert_same(before, _snapshot(fresh))
    return info.value


def test_checksums_are_recorded_per_file(saved) -> None:
    _, ckpt = saved
    marker = json.loads((ckpt / "COMPLETE").read_text())
    assert marker["format"] == 2 and marker["checksum"] == "crc32"
    files = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    assert set(marker["files"]) == files - {"COMPLETE"}
    for name, entry in marker["files"].items():
        assert entry["size"] == (ckpt / name).stat().st_size
        assert len(entry["crc32"]) == 8


def test_flipped_bytes_in_a_distcp_file_are_detected(saved) -> None:
    _, ckpt = saved
    target = ckpt / DISTCP
    data = bytearray(target.read_bytes())
    for offset in (17, len(data) // 2, len(data) - 5):
        data[offset] ^= 0x5A
    target.write_bytes(bytes(data))
    error = _expect_corrupt(ckpt, target)
    assert "crc32" in str(error) and len(error.problems) == 1


def test_a_weight_rewritten_to_1e30_is_detected(saved) -> None:
    engine, ckpt = saved
    bias = engine.module.head.bias.detach()  # type: ignore[union-attr]
    target = ckpt / DISTCP
    data = target.read_bytes()
    at = data.find(bias.numpy().tobytes())
    assert at >= 0, "the bias's bytes are not stored raw: update this test's rewrite"
    target.write_bytes(data[:at] + struct.pack("<f", 1e30) + data[at + 4 :])
    _expect_corrupt(ckpt, target)
    # Unverified, the same file loads silently with the poisoned weight (what the check stops).
    unverified = _engine(seed=5)
    from train_engine.checkpoint import load_checkpoint

    load_checkpoint(
        ckpt,
        model=unverified.module,
        optimizer=unverified.optimizer,
        lr_scheduler=unverified.lr_scheduler,
        verify=False,
    )
    assert float(unverified.module.head.bias.detach()[0]) == pytest.approx(1e30)  # type: ignore[index]


@pytest.mark.parametrize("name", [str(DISTCP), "meta.pt", "rank_00000.pt"])
def test_truncated_files_are_named(saved, name: str) -> None:
    _, ckpt = saved
    target = ckpt / name
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 3])
    error = _expect_corrupt(ckpt, target)
    assert "truncated" in str(error)


def test_a_missing_file_and_a_garbled_marker_are_named(saved, tmp_path: Path) -> None:
    _, ckpt = saved
    (ckpt / "meta.pt").unlink()
    _expect_corrupt(ckpt, ckpt / "meta.pt")
    (ckpt / "COMPLETE").write_text('{"files": ')
    _expect_corrupt(ckpt, ckpt / "COMPLETE")


def _as_format_1(ckpt: Path) -> None:
    """Rewrite a checkpoint as the previous version wrote it (no checksums)."""
    marker = json.loads((ckpt / "COMPLETE").read_text())
    for key in ("format", "checksum", "files"):
        marker.pop(key)
    (ckpt / "COMPLETE").write_text(json.dumps(marker))
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    torch.save({**meta, "format": 1}, ckpt / "meta.pt")


def test_old_checkpoints_without_checksums_still_load(saved) -> None:
    engine, ckpt = saved
    _as_format_1(ckpt)
    fresh = _engine(seed=5)
    assert fresh.load_checkpoint(ckpt) == {"at": 2}
    for k, v in engine.module.state_dict().items():
        assert torch.equal(fresh.module.state_dict()[k], v), k
    # Unverified, a truncated small file still names itself (read before any state changes).
    (ckpt / "rank_00000.pt").write_bytes((ckpt / "rank_00000.pt").read_bytes()[:50])
    _expect_corrupt(ckpt, ckpt / "rank_00000.pt")


def test_complete_checkpoints_newest_first_and_fallback(tmp_path: Path) -> None:
    engine = _engine()
    for step in (1, 2, 3):
        _train(engine, 1, seed=step)
        engine.save_checkpoint(tmp_path / f"step_{step}", extra_state=step)
    (tmp_path / "step_4.tmp").mkdir()  # an interrupted save: not listed
    listed = complete_checkpoints(tmp_path)
    assert listed == [tmp_path / "step_3", tmp_path / "step_2", tmp_path / "step_1"]
    assert latest_checkpoint(tmp_path) == listed[0]
    assert complete_checkpoints(tmp_path / "nowhere") == []
    newest = tmp_path / "step_3" / DISTCP
    data = newest.read_bytes()
    newest.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    fresh = _engine(seed=5)
    loaded, skipped = None, []
    for path in complete_checkpoints(tmp_path):  # the README's fallback loop
        try:
            loaded = fresh.load_checkpoint(path)
            break
        except CheckpointCorruptError as err:
            skipped.append(err.checkpoint)
    assert skipped == [tmp_path / "step_3"] and loaded == 2
    assert fresh.optimizer_steps == 2


@pytest.mark.timeout(200)
@pytest.mark.parametrize("damage", ["flip", "truncate", "none"])
def test_two_ranks_agree_on_a_corrupt_checkpoint(rank_pool, tmp_path: Path, damage: str) -> None:
    results = rank_pool.run(2, iw.corrupt_then_load, str(tmp_path), damage, timeout_s=150)
    if damage == "none":
        assert [r["raised"] for r in results] == [None, None]
        assert [r["extra"] for r in results] == [{"rank": 0}, {"rank": 1}]
        assert all(r["optimizer_steps"] == 1 for r in results)
        return
    bad = "__1_0.distcp" if damage == "flip" else "rank_00001.pt"
    messages = [r["raised"] for r in results]
    assert all(m is not None and bad in m for m in messages), messages
    assert messages[0] == messages[1], "the ranks raised different errors"
    for rank, r in enumerate(results):
        assert r["unchanged"] and r["rng_unchanged"], f"rank {rank} changed state: {r}"
        assert r["optimizer_steps"] == 0


def test_an_unknown_format_is_refused_with_a_value_error(saved) -> None:
    _, ckpt = saved
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    torch.save({**meta, "format": 99}, ckpt / "meta.pt")
    fresh = _engine(seed=5)
    with pytest.raises(ValueError, match=r"checkpoint format 99 .* not one of the supported"):
        fresh.load_checkpoint(ckpt, verify=False)


@pytest.mark.timeout(120)
def test_two_ranks_refuse_saving_onto_a_file_together(rank_pool, tmp_path: Path) -> None:
    messages = rank_pool.run(2, iw.save_onto_a_file, str(tmp_path), timeout_s=90)
    assert all(m is not None and "notes.txt is a file" in m for m in messages), messages
    assert (tmp_path / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
