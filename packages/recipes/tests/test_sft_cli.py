"""`train-recipes sft` end to end through the console script and torch's elastic launcher.

Kills and resumes through the same launcher are test_run_safety.py's.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from _recipes_workers import metric_rows
from conftest import CLI, assert_quiet, cli_env, data_overrides, sft_args
from train_recipes.data.demo import DemoSplit


def _losses(run: Path) -> dict[int, float]:
    rows = metric_rows(run)
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


# 20 steps take the loss well under 0.8x (about 0.7x) and leave a middle checkpoint (step 10) to
# export; 8 held-out questions exercise the same exact-match path as more.
STEPS = 20


def _args(split: DemoSplit, out: Path) -> list[str]:
    sets = [
        *data_overrides(split),
        f"train.steps={STEPS}",
        "train.log_every=1",
        "train.checkpoint_every=10",
        "train.keep_checkpoints=3",
        "train.eval_samples=8",
        "train.device=cpu",
        "train.export=true",
        "data.micro_batch_size=16",
    ]
    return sft_args(out, sets, nproc=2)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_loss_decreases_and_a_middle_checkpoint_exports(
    demo_data: DemoSplit, tmp_path: Path
) -> None:
    # 1. The uninterrupted run: the loss goes down.
    ref = tmp_path / "ref"
    done = subprocess.run(
        [*CLI, *_args(demo_data, ref)], env=cli_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert_quiet(done.stdout + done.stderr)
    ref_losses = _losses(ref)
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    first = sum(ref_losses[s] for s in range(1, 6)) / 5
    last = sum(ref_losses[s] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert last < 0.8 * first, f"loss did not go down: {first:.3f} -> {last:.3f}"
    assert (ref / "loss.png").stat().st_size > 1000
    assert "exact match" in done.stdout

    # 2. `train-recipes export` turns a middle checkpoint into a loadable HF model folder.
    #    (A SIGKILL of launcher and ranks, then --resume to the uninterrupted run's losses and
    #    final weights bit for bit, is test_run_safety.py's test_sigkill_at_any_point_....)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    final_ref = load_file(ref / "hf_model" / "model.safetensors")
    out = tmp_path / "export-step10"
    exp = subprocess.run(
        [*CLI, "export", str(ref / "checkpoints" / "step_000010"), "--out", str(out)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert exp.returncode == 0, exp.stderr[-4000:]
    step10 = load_file(out / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(out)
    state = model.state_dict()
    for key, value in step10.items():
        assert torch.equal(state[key], value), key
    # Step 10's weights are the checkpoint's: neither the initial nor the final ones.
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(step10[name], final_ref[name])
