"""The GRPO recipe on gloo ranks: on-policy ratio, dp=2 against dp=1, resume, bad rollout files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _grpo_workers import QUIET_GRPO_RUN, run_grpo_on_rank, write_rollout_file
from train_recipes.cli.main import main


@pytest.mark.timeout(300)
def test_one_update_epoch_has_ratio_exactly_one(rank_pool: object, tmp_path: Path) -> None:
    """One update per rollout batch: the old log-probs are the detached current ones, so every
    trained token's ratio is exactly 1 and nothing is clipped, at every step."""
    argv = [*QUIET_GRPO_RUN, f"train.output_dir={tmp_path / 'run'}", "train.steps=2"]
    run = rank_pool.run(1, run_grpo_on_rank, argv, timeout_s=280)[0]  # type: ignore[attr-defined]
    for step in (1, 2):
        row = run["rows"][step]
        assert row["ratio_min"] == row["ratio_max"] == 1.0, row
        assert row["clip_fraction"] == 0.0, row
        assert row["loss_tokens"] > 0, row


@pytest.mark.timeout(400)
def test_two_ranks_follow_the_losses_of_one(rank_pool: object, tmp_path: Path) -> None:
    """The same rollout file at dp=2 and dp=1 (two update epochs of two minibatches, old
    log-probs computed before the first update, a k3 KL to the frozen reference and an entropy
    bonus): the token-sum contract makes the updates, and so the losses, the same."""
    rollouts = write_rollout_file(tmp_path / "rollouts.jsonl", groups=8, group_size=3)
    common = [
        *QUIET_GRPO_RUN,
        "rollout.source=file",
        f"rollout.path={rollouts}",
        "rollout.update_epochs=2",
        "rollout.minibatches=2",
        "loss.kl_coef=0.1",
        "loss.entropy_coef=0.01",
        "train.steps=6",
    ]

    def run(world: int, name: str) -> dict[int, float]:
        argv = [*common, f"train.output_dir={tmp_path / name}"]
        result = rank_pool.run(world, run_grpo_on_rank, argv, timeout_s=190)  # type: ignore[attr-defined]
        return result[0]["losses"]

    one, two = run(1, "dp1"), run(2, "dp2")
    assert sorted(one) == sorted(two) == list(range(1, 7))
    a = torch.tensor([one[s] for s in sorted(one)], dtype=torch.float64)
    b = torch.tensor([two[s] for s in sorted(two)], dtype=torch.float64)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{a}\n{b}\n{m}")
    assert len(set(a.tolist())) > 1, a  # the batches and updates differ from step to step


@pytest.mark.timeout(400)
def test_resume_reproduces_the_losses(rank_pool: object, tmp_path: Path) -> None:
    """Kill after step 3 (the checkpoints of steps 4 and 5 never written) and resume: step 4
    trains on the rollout buffer saved mid-batch, step 5 samples a new batch with the saved
    generator; the losses equal the uninterrupted run's."""
    out = tmp_path / "run"
    argv = [
        *QUIET_GRPO_RUN,
        f"train.output_dir={out}",
        "train.steps=5",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=0",
        "rollout.update_epochs=2",
        # The random-init policy answers nothing right (every advantage 0): the KL to the
        # frozen reference and the entropy bonus make each step's loss its own.
        "loss.kl_coef=0.1",
        "loss.entropy_coef=0.01",
    ]
    full = rank_pool.run(2, run_grpo_on_rank, argv, timeout_s=190)[0]["losses"]  # type: ignore[attr-defined]
    for step in (4, 5):
        shutil.rmtree(out / "checkpoints" / f"step_{step:06d}")
    resumed = rank_pool.run(2, run_grpo_on_rank, argv, True, timeout_s=190)[0]["losses"]  # type: ignore[attr-defined]
    assert full[4] != full[3] and full[5] != full[4], full
    for step in (4, 5):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), (full, resumed)


def _bad_row(tmp_path: Path, change: dict[str, object]) -> Path:
    good = write_rollout_file(tmp_path / "good.jsonl", groups=2, group_size=2)
    rows = [json.loads(line) for line in good.read_text().splitlines()]
    rows[2].update(change)
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"completion_ids": [5, 999]}, "outside the tokenizer's vocabulary"),
        ({"advantages": [0.5]}, "advantages has 1 entries, the completion"),
        ({"old_log_probs": [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]}, "old_log_probs has 6 entries"),
        ({"routes": [[0, 1]]}, "router replay of rollout routes is not supported"),
        ({"reward": None}, "needs a 'reward'"),
    ],
)
def test_bad_rollout_file_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, object], says: str
) -> None:
    path = _bad_row(tmp_path, change)
    argv = ["grpo", "--output-dir", str(tmp_path / "run")]
    argv += ["--set", "rollout.source=file", "--set", f"rollout.path={path}"]
    argv += ["--set", "rollout.groups_per_batch=2", "--set", "train.device=cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 3" in err and says in err, err
    assert not (tmp_path / "run").exists()  # refused before anything started
