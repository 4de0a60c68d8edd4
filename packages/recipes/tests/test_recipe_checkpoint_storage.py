"""Checkpoint storage (issue 37, issue 43 item 7): the size check before launch, a full disk at
the final checkpoint (one line, the partial save removed, the previous checkpoint kept and not
pruned, the weights kept instead), a resume from weights without optimizer state.

A full disk is fault injection, not a full filesystem: before launch the free-space reading is
replaced in-process; in a CLI run, a ``sitecustomize`` on the ranks' PYTHONPATH makes rank 1's
DCP file writer raise ENOSPC once, after writing its data.
"""

from __future__ import annotations

import errno
import json
import math
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

import train_engine
from _recipes_workers import logged_losses, metric_rows
from conftest import CLI, cli_env
from test_run_safety import _cmd, _main, _one_line_error
from train_recipes.config.loader import ConfigError, load_config
from train_recipes.config.sft import SFTConfig
from train_recipes.data.demo import DemoSplit

# Imported by every Python process whose PYTHONPATH starts with its folder: on rank 1 of a run
# with FULL_DISK_AT set, the first DCP write into that checkpoint raises ENOSPC after writing.
_INJECT = """
import os

if os.environ.get("RANK") == "1" and os.environ.get("FULL_DISK_AT"):
    import errno
    from pathlib import Path

    from torch.distributed.checkpoint import FileSystemWriter

    _write = FileSystemWriter.write_data

    def _full_once(self, plan, planner):
        result = _write(self, plan, planner)
        flag = Path(os.environ["FULL_DISK_FLAG"])
        if os.environ["FULL_DISK_AT"] in str(self.path) and not flag.exists():
            flag.touch()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return result

    FileSystemWriter.write_data = _full_once
"""


def _header_only_safetensors(folder: Path, shapes: dict[str, list[int]], *, tied: bool) -> None:
    """A model folder whose safetensors file has the header of ``shapes`` and no data (the
    estimate reads headers only)."""
    folder.mkdir()
    header = {
        name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
        for name, shape in shapes.items()
    }
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llama", "tie_word_embeddings": tied})
    )


def _llama_8b(vocab: int = 128256, hidden: int = 4096, inner: int = 14336) -> dict[str, list[int]]:
    shapes = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden]}
    for i in range(32):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": [hidden, hidden],
            p + "self_attn.k_proj.weight": [1024, hidden],
            p + "self_attn.v_proj.weight": [1024, hidden],
            p + "self_attn.o_proj.weight": [hidden, hidden],
            p + "mlp.gate_proj.weight": [inner, hidden],
            p + "mlp.up_proj.weight": [inner, hidden],
            p + "mlp.down_proj.weight": [hidden, inner],
            p + "input_layernorm.weight": [hidden],
            p + "post_attention_layernorm.weight": [hidden],
        }
    return shapes


def test_the_8b_of_issue_37_is_refused_before_launch_and_fits_weights_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 weights with fp32 master weights: 14 bytes a parameter, 112 GB for 8.03B, on a
    64 GiB disk; the weights alone (16 GB) fit."""
    from train_recipes.cli import preflight
    from train_recipes.run import storage

    model = tmp_path / "llama-8b"
    shapes = _llama_8b() | {"lm_head.weight": [128256, 4096]}
    _header_only_safetensors(model, shapes, tied=False)
    params = sum(math.prod(s) for s in shapes.values())
    sets = [
        f"model.path={model}",
        "model.dtype=bfloat16",
        "train.steps=20",
        "train.checkpoint_every=0",
        "train.export=false",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    config = load_config(SFTConfig, None, sets)
    size = storage.checkpoint_size(config, world_size=1)
    assert size is not None and size.optimizer_name == "MasterWeightAdamW"
    assert size.weights == pytest.approx(2 * params, rel=1e-3)
    assert size.total == pytest.approx(14 * params, rel=1e-3)
    assert 112e9 < size.total < 113e9, size
    monkeypatch.setattr(train_engine, "free_disk_bytes", lambda path: 64 << 30)
    with pytest.raises(ConfigError) as info:
        preflight.check_storage(config, world_size=1)
    line = str(info.value)
    assert "\n" not in line and "config key 'train.output_dir'" in line, line
    assert "need 104.7 GiB free" in line and "has 64.0 GiB free" in line, line
    assert "1 checkpoint(s) of 104.7 GiB at once" in line, line
    assert "train.checkpoint_optimizer=false (weights only: 15.0 GiB)" in line, line
    weights_only = load_config(SFTConfig, None, [*sets, "train.checkpoint_optimizer=false"])
    assert preflight.check_storage(weights_only, world_size=1) is None

    # keep_checkpoints=2 of several saves: the new one is written before the oldest goes.
    several = load_config(SFTConfig, None, [*sets, "train.checkpoint_every=5"])
    need = storage.storage_need(several, size, checkpoint=size.total)
    assert need.at_peak == 3 and need.free_needed == 3 * size.total
    with pytest.raises(ConfigError, match=r"train.keep_checkpoints=1 \(209.4 GiB\)"):
        preflight.check_storage(several, world_size=1)
    # Tied embeddings are saved once by save_pretrained but twice by DCP: counted twice.
    tied = tmp_path / "tied"
    _header_only_safetensors(tied, _llama_8b(), tied=True)
    tied_size = storage.checkpoint_size(
        load_config(SFTConfig, None, [*sets, f"model.path={tied}"]), world_size=1
    )
    assert tied_size is not None and tied_size.weights == pytest.approx(size.weights, rel=1e-6)


def test_a_shortfall_is_one_line_before_any_rank_or_a_warning(
    demo_data: DemoSplit,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from train_recipes.cli.config_commands import load_recipe_config
    from train_recipes.cli.preflight import run_preflight

    monkeypatch.setattr(train_engine, "free_disk_bytes", lambda path: 100 << 10)
    run = tmp_path / "run"
    refused = _main(capsys, _cmd(demo_data, run))
    line = _one_line_error(refused, "has 100.0 KiB free", str(run), "train.storage_check=warn")
    # 7 steps saved at 5 and 7: two checkpoints at once, whatever keep_checkpoints=3 allows.
    assert "2 checkpoint(s) of" in line and "train.checkpoint_optimizer=false" in line, line
    assert not run.exists()
    sets = ["train.storage_check=warn", f"train.output_dir={run}"]
    _, config = load_recipe_config("sft", None, sets)
    warned = run_preflight(config, world_size=2, local_world_size=2)
    assert any("has 100.0 KiB free" in w for w in warned.warnings), warned.warnings
    _, config = load_recipe_config(
        "sft", None, ["train.storage_check=ignore", f"train.output_dir={run}"]
    )
    assert not any(
        "free" in w for w in run_preflight(config, world_size=2, local_world_size=2).warnings
    )


def _checksums_hold(checkpoint: Path) -> bool:
    """Every file the marker records has its recorded size and CRC-32 (train-engine's format)."""
    files = json.loads((checkpoint / "COMPLETE").read_text())["files"]
    for name, want in files.items():
        data = (checkpoint / name).read_bytes()
        if len(data) != want["size"] or f"{zlib.crc32(data):08x}" != want["crc32"]:
            return False
    return bool(files)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_full_disk_at_the_final_checkpoint_keeps_the_weights_and_a_resume_continues(
    demo_data: DemoSplit, tmp_path: Path
) -> None:
    import torch

    from train_recipes.run import storage

    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(_INJECT)
    env = cli_env() | {
        "PYTHONPATH": str(inject),
        "FULL_DISK_AT": "step_000004.tmp",
        "FULL_DISK_FLAG": str(tmp_path / "failed-once"),
    }
    run = tmp_path / "run"
    kept = {"checkpoint_every": 2, "keep_checkpoints": 1}
    args = _cmd(demo_data, run, nproc=2, steps=4, **kept)
    done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=400)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [
        x
        for x in done.stderr.splitlines()
        if x.startswith("train-recipes sft:") and ": warning: " not in x
    ]
    assert len(errors) == 1, done.stderr[-3000:]
    line = errors[0]
    for needle in (
        f"could not save checkpoint {run / 'checkpoints' / 'step_000004'}: ENOSPC",
        "[rank 1]",
        "written to step_000004.tmp",
        "free on its filesystem",
        "kept the final weights without optimizer state in step_000004",
        f"train-recipes export {run}",
    ):
        assert needle in line, (needle, line)
    # The partial save is gone, step 2 was not pruned (keep_checkpoints=1) and is intact.
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002", "step_000004"]
    assert _checksums_hold(checkpoints / "step_000002")
    meta = torch.load(checkpoints / "step_000004" / "meta.pt", weights_only=False)
    assert meta["optimizer_state"] is False and _checksums_hold(checkpoints / "step_000004")
    # The pre-launch estimate is close to what was written.
    config = load_config(SFTConfig, None, [a for a in args if "=" in a and not a.startswith("--")])
    estimate = storage.checkpoint_size(config, world_size=2)
    full = sum(f.stat().st_size for f in (checkpoints / "step_000002").rglob("*") if f.is_file())
    assert estimate is not None and 0.7 < estimate.total / full < 1.4, (estimate, full)

    # --resume from the weights alone (one line says AdamW restarts), and beside it the exact
    # continuation from step 2: the loss of step 5 depends on the weights after step 4 only.
    reference = tmp_path / "reference"
    shutil.copytree(run, reference, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(reference / "checkpoints" / "step_000004")
    jobs = [
        subprocess.Popen(
            [*CLI, *_cmd(demo_data, folder, *more, nproc=2, flags=("--resume",), steps=6, **kept)],
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for folder, more in ((run, ("train.checkpoint_optimizer=false",)), (reference, ()))
    ]
    outputs = [job.communicate(timeout=400) for job in jobs]
    for job, (out, err) in zip(jobs, outputs, strict=True):
        assert job.returncode == 0, (out[-2000:], err[-2000:])
    resumed = outputs[0][0]
    assert "step_000004 holds the weights without optimizer state" in resumed, resumed
    assert "AdamW restarts from zero moments" in resumed, resumed
    losses, exact = logged_losses(metric_rows(run)), logged_losses(metric_rows(reference))
    assert sorted(losses) == sorted(exact) == [1, 2, 3, 4, 5, 6], (losses, exact)
    assert losses[5] == pytest.approx(exact[5], rel=1e-6), (losses, exact)
    assert all(math.isfinite(v) for v in losses.values())
    # train.checkpoint_optimizer=false: the final checkpoint holds the weights only.
    meta = torch.load(checkpoints / "step_000006" / "meta.pt", weights_only=False)
    assert meta["optimizer_state"] is False


class _FullDiskEngine:
    """Stands for the Engine: each save raises CheckpointWriteError while ``fails`` > 0."""

    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.saves: list[bool] = []

    def save_checkpoint(self, target: Path, *, extra_state: dict, optimizer_state: bool) -> None:
        from train_engine import CheckpointWriteError

        self.saves.append(optimizer_state)
        assert extra_state["optimizer_state"] is optimizer_state
        if self.fails:
            self.fails -= 1
            raise CheckpointWriteError(
                f"could not save checkpoint {target}: ENOSPC (No space left on device)",
                errno=errno.ENOSPC,
                reason="ENOSPC (No space left on device)",
            )
        target.mkdir(parents=True)


@pytest.mark.parametrize(
    ("final", "optimizer_state", "fails", "saves", "said"),
    [
        (False, True, 1, [True], "none is complete: free space there"),  # no fallback mid-run
        (True, True, 2, [True, False], "the weights alone could not be saved either"),
        (True, False, 1, [False], "the final weights are lost"),  # nothing smaller to try
        (True, True, 1, [True, False], "kept the final weights without optimizer state"),
    ],
)
def test_what_a_failed_save_tries_and_says(
    tmp_path: Path, final: bool, optimizer_state: bool, fails: int, saves: list[bool], said: str
) -> None:
    from train_recipes.run.health import TrainingAborted
    from train_recipes.run.save_failure import save_or_abort

    engine = _FullDiskEngine(fails)
    target = tmp_path / "run" / "checkpoints" / "step_000004"
    with pytest.raises(TrainingAborted) as info:
        save_or_abort(
            engine,  # type: ignore[arg-type]
            target,
            extra_state={},
            optimizer_state=optimizer_state,
            final=final,
        )
    assert engine.saves == saves
    assert said in str(info.value) and "\n" not in str(info.value), str(info.value)
