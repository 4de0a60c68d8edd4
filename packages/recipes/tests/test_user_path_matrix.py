"""The user-path matrix on CPU: knobs that must not change the numbers, combined as users
combine them, each run compared with its reference run without the knobs (2 gloo ranks, fp32).

The GPU side of the matrix is ``benchmarks/gpu_user_path.py``. Pairs already compared
elsewhere on 2-4 gloo ranks through the recipe: dp vs cp, ddp vs fsdp2 (test_sft_dist.py),
packed cp=2 vs cp=1 for text and the VLM (test_sft_dist.py), tp=2 with checkpointing vs dp
(test_sft_dist.py), cp x tp and packed tp (test_scale_dist.py), ep=2 vs ep=1
(test_moe_recipe_dist.py), LoRA under FSDP2 (test_lora_fsdp2.py), Ray vs SPMD
(test_ray_controller.py), master weights (test_master_weights_recipe.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _recipes_workers import run_sft_on_rank
from conftest import QUIET_CPU_RUN, data_overrides
from train_recipes.data.demo import DemoSplit

PROBE = [[3, 23, 24, 17, 25, 35, 5, 4]]
STEPS = 4
# aot_eager runs the compiled graphs' ATen ops eagerly, in the order traced: fp32 sums may
# associate differently from the uncompiled module's, nothing more.
RTOL, ATOL = 1e-5, 1e-6


def _run(rank_pool: object, split: DemoSplit, out: Path, knobs: list[str]) -> dict[int, float]:
    overrides = [
        *data_overrides(split),
        f"train.output_dir={out}",
        f"train.steps={STEPS}",
        *QUIET_CPU_RUN,
        "train.export=false",
        "data.num_logical_shards=2",
        "data.shuffle=false",
        *knobs,
    ]
    result = rank_pool.run(2, run_sft_on_rank, overrides, PROBE, timeout_s=300)[0]  # type: ignore[attr-defined]
    return dict(result["losses"])


def _same_losses(reference: dict[int, float], got: dict[int, float], what: str) -> None:
    assert sorted(reference) == sorted(got) == list(range(1, STEPS + 1)), what
    a = torch.tensor([reference[s] for s in sorted(reference)], dtype=torch.float64)
    b = torch.tensor([got[s] for s in sorted(got)], dtype=torch.float64)
    torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}\n{a}\n{b}\n{m}")
    assert b[-1] < b[0], f"{what}: the loss did not fall {b.tolist()}"


COMPILED = ["model.compile=true", "model.compile_backend=aot_eager"]
PACKED = ["data.packing=true", "data.max_length=96", "data.micro_batch_size=2"]


@pytest.mark.timeout(600)
def test_packed_rows_with_checkpointing_and_compile_follow_the_plain_run(
    rank_pool: object, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """The shipped GPU config's combination (packing + compiled layers) with checkpointing on
    every layer: crashed at the first backward ("a different number of tensors was saved");
    now the same losses as without checkpointing and compile."""
    reference = _run(rank_pool, demo_data, tmp_path / "plain", PACKED)
    knobs = [*PACKED, *COMPILED, "model.activation_checkpointing=true"]
    _same_losses(reference, _run(rank_pool, demo_data, tmp_path / "ac-compile", knobs), "packed")


@pytest.mark.timeout(600)
def test_lora_with_checkpointing_every_second_layer_and_compile_follows_plain_lora(
    rank_pool: object, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """Unpacked rows (torchtitan's nesting: the checkpoint traced inside the compiled layer),
    LoRA's frozen base, FSDP2, checkpointing every second layer: the plain LoRA run's losses."""
    lora = ["lora.enabled=true", "optim.lr=1e-2", "parallel.data_parallel=fsdp2"]
    lora += ["data.micro_batch_size=8"]
    reference = _run(rank_pool, demo_data, tmp_path / "lora", lora)
    knobs = [
        *lora,
        *COMPILED,
        "model.activation_checkpointing=true",
        "model.activation_checkpointing_every=2",
    ]
    got = _run(rank_pool, demo_data, tmp_path / "lora-ac2-compile", knobs)
    _same_losses(reference, got, "lora + fsdp2")
