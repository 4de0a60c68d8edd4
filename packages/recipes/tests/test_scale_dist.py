"""Tensor parallelism composed with the other parallelisms through the SFT recipe (losses from
metrics.jsonl): cp x tp on the (dp, cp, tp) mesh and dp x tp on 4 gloo ranks (slow: 4 ranks on
a 2-core machine), and packed rows (cp-sharder's variable-length attention) under tp=2 with
sequence-parallel norms and activation checkpointing on 2 ranks.

Every run sees the same global batches (two logical loader shards, the accumulation making up
for a smaller dp), so under the token-sum loss all must follow the same losses, in fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _recipes_workers import run_sft_on_rank
from _runs import TinyRun
from conftest import unshuffled_cpu_run
from train_recipes.data.demo import DemoSplit


def _fsdp2_run(split: DemoSplit, out: Path, steps: int) -> TinyRun:
    return unshuffled_cpu_run(split, out, steps).but(data_parallel="fsdp2")


def _losses(
    rank_pool: Any, world: int, overrides: list[str], steps: int, timeout_s: float
) -> torch.Tensor:
    run = rank_pool.run(world, run_sft_on_rank, overrides, [[3, 5, 4, 4]], timeout_s=timeout_s)[0]
    assert sorted(run["losses"]) == list(range(1, steps + 1)), run["losses"]
    return torch.tensor([run["losses"][s] for s in range(1, steps + 1)], dtype=torch.float64)


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=lambda m: f"{what}\n{a}\n{b}\n{m}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cp2_x_tp2_and_dp2_x_tp2_on_four_ranks_follow_the_dp_losses(
    rank_pool: Any, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """dp=2 (cp=1, tp=1) on 2 ranks against cp=2 x tp=2 (dp=1, accumulation 2: the portable
    cp attention on tp-local heads, the sequence split over cp and then over tp) and dp=2 x
    tp=2 (FSDP2 over dp on a 2-D mesh) on 4 ranks."""
    steps = 3
    base = _losses(
        rank_pool,
        2,
        _fsdp2_run(demo_data, tmp_path / "dp2", steps).overrides(),
        steps,
        timeout_s=400,
    )
    cp_tp = _losses(
        rank_pool,
        4,
        _fsdp2_run(demo_data, tmp_path / "cp2tp2", steps)
        .but(cp=2, tp=2, accumulation=2)
        .overrides(),
        steps,
        timeout_s=600,
    )
    _assert_same(base, cp_tp, "dp=2 vs cp=2 x tp=2")
    dp_tp = _losses(
        rank_pool,
        4,
        _fsdp2_run(demo_data, tmp_path / "dp2tp2", steps).but(tp=2).overrides(),
        steps,
        timeout_s=600,
    )
    _assert_same(base, dp_tp, "dp=2 vs dp=2 x tp=2")
    assert base[-1] < base[0], base.tolist()


@pytest.mark.timeout(600)
def test_packed_rows_under_tp2_with_sequence_parallel_follow_the_dp_losses(
    rank_pool: Any, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """Packed rows (variable-length attention at cp=1) on dp=2 against tp=2 with
    sequence-parallel norms and activation checkpointing (the recomputation re-enters the
    sharder's context), rows padded to 2*tp; and cp=2 x tp=1 with checkpointing."""
    steps = 3
    packed = ("data.packing=true", "data.max_length=96")

    def run(name: str) -> TinyRun:
        return _fsdp2_run(demo_data, tmp_path / name, steps).but(*packed, micro_batch_size=2)

    base = _losses(rank_pool, 2, run("dp2").overrides(), steps, timeout_s=400)
    for name, other_run in (
        ("tp=2+sp+ac", run("tp=2+sp+ac").but("parallel.sequence_parallel=true", tp=2)),
        ("cp=2+ac", run("cp=2+ac").but(cp=2)),
    ):
        other = _losses(
            rank_pool,
            2,
            other_run.but("model.activation_checkpointing=true", accumulation=2).overrides(),
            steps,
            timeout_s=400,
        )
        _assert_same(base, other, f"packed dp=2 vs {name}")


def _save_tiny_qwen3(directory: Path) -> Path:
    """An unmodified transformers Qwen3 (q/k norms, tied head) saved with the demo tokenizer."""
    from train_recipes.data.demo import build_char_tokenizer
    from train_testing.tiny_hf import save_tiny, tiny_model

    tokenizer = build_char_tokenizer()
    model = tiny_model(
        "qwen3",
        seed=0,
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return save_tiny(model, directory, tokenizer=tokenizer)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen3", "qwen2_5_vl"])
def test_tp2_follows_dp2_for_qwen3_and_the_qwen2_5_vl_language_model(
    rank_pool: Any, demo_data: DemoSplit, shapes_data: DemoSplit, tmp_path: Path, family: str
) -> None:
    """Through the recipe: tp=2 (whole-model plan, sequence-parallel norms, vocab-sharded loss)
    follows the dp=2 losses for a saved Qwen3 folder and for the Qwen2.5-VL demo model (its
    language model sharded, the vision tower replicated), on the same global batches."""
    steps = 4
    if family == "qwen3":
        split = demo_data
        family_run = {"model_path": _save_tiny_qwen3(tmp_path / "qwen3")}
    else:
        split = shapes_data
        family_run = {"extra": ("data.model_family=qwen2_5_vl",)}
    dp = _losses(
        rank_pool,
        2,
        _fsdp2_run(split, tmp_path / "dp2", steps).but(**family_run).overrides(),
        steps,
        timeout_s=400,
    )
    tp = _losses(
        rank_pool,
        2,
        _fsdp2_run(split, tmp_path / "tp2", steps)
        .but(**family_run, tp=2, accumulation=2)
        .overrides(),
        steps,
        timeout_s=400,
    )
    _assert_same(dp, tp, f"{family}: dp=2 vs tp=2")
