"""The SFT recipe on 2 gloo ranks: dp x cp composition, and the HF export of the trained model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _packing_workers import run_packed_sft_without_dense_masks
from _recipes_workers import run_sft_on_rank
from _runs import TinyRun
from train_recipes.data.demo import DemoSplit

PROBE = [[3, 23, 24, 17, 25, 35, 5, 4], [3, 30, 31, 17, 22, 22, 35, 5]]


def _two_shard_run(split: DemoSplit, out: Path) -> TinyRun:
    """12 steps of unshuffled micro-batches of 8 from two logical shards: dp=2 and dp=1 x cp=2
    (accumulation 2) see the same global batches."""
    return TinyRun(
        data=split, out=out, steps=12, micro_batch_size=8, logical_shards=2, shuffle=False
    )


@pytest.mark.timeout(300)
def test_ddp_fsdp2_and_cp_reach_the_same_losses_and_export_matches(
    rank_pool: object, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """dp=2,cp=1 (accumulation 1) and dp=1,cp=2 (accumulation 2) see the same global batches
    (two logical loader shards), so with the token-sum loss they must follow the same losses;
    so must FSDP2 at dp=2. The HF exports reproduce the trained models' logits."""

    def run(name: str, **fields: object) -> dict:
        argv = _two_shard_run(demo_data, tmp_path / name).but(**fields).overrides()
        return rank_pool.run(2, run_sft_on_rank, argv, PROBE, timeout_s=240)[0]  # type: ignore[attr-defined]

    dp_run = run("dp2", cp=1, export=True)
    cp_run = run("cp2", cp=2, accumulation=2, export=False)
    fsdp_run = run("fsdp2", cp=1, data_parallel="fsdp2", export=True)
    dp_losses, cp_losses = dp_run["losses"], cp_run["losses"]
    assert sorted(dp_losses) == sorted(cp_losses) == list(range(1, 13))
    steps = sorted(dp_losses)
    a = torch.tensor([dp_losses[s] for s in steps], dtype=torch.float64)
    b = torch.tensor([cp_losses[s] for s in steps], dtype=torch.float64)
    torch.testing.assert_close(
        a, b, rtol=2e-4, atol=2e-5, msg=lambda m: f"dp vs cp losses\n{a}\n{b}\n{m}"
    )
    assert a[-1] < a[0], f"loss did not go down: {a.tolist()}"
    c = torch.tensor([fsdp_run["losses"][s] for s in steps], dtype=torch.float64)
    torch.testing.assert_close(
        a, c, rtol=2e-4, atol=2e-5, msg=lambda m: f"DDP vs FSDP2\n{a}\n{c}\n{m}"
    )

    # The exported folder loads with from_pretrained and reproduces the trained model's logits.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for run in (dp_run, fsdp_run):  # DDP, and FSDP2 (shards consolidated on export)
        export = Path(run["export_dir"])
        assert (export / "model.safetensors").is_file()
        model = AutoModelForCausalLM.from_pretrained(export).eval()
        tokenizer = AutoTokenizer.from_pretrained(export)
        assert tokenizer.chat_template
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(PROBE)).logits
        torch.testing.assert_close(logits, run["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
def test_vlm_demo_trains_on_two_ranks(
    rank_pool: object, shapes_data: DemoSplit, tmp_path: Path
) -> None:
    """The tiny Qwen2.5-VL-style model learns from generated pictures through the same
    loader, Engine and loss; the export holds the image-text model."""
    run = rank_pool.run(  # type: ignore[attr-defined]
        2,
        run_sft_on_rank,
        TinyRun(
            data=shapes_data,
            out=tmp_path / "vlm",
            steps=30,
            eval_samples=16,
            micro_batch_size=8,
            extra=("data.model_family=qwen2_5_vl",),
        ).overrides(),
        [[3, 101, 102, 102, 102, 102, 103, 30, 5, 4]],
        timeout_s=280,
    )[0]
    losses = [run["losses"][s] for s in sorted(run["losses"])]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert run["accuracy_before"] is not None and run["accuracy_after"] is not None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(run["export_dir"])
    assert config.model_type == "qwen2_5_vl"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_with_activation_checkpointing_matches_dp(
    rank_pool: object, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """tp=2 shards the whole model (heads, MLP, the tied embedding and output projection over
    an odd vocabulary: uneven shards; sequence-parallel norms) on the (dp=1, tp=2) mesh under
    FSDP2, with activation checkpointing on, and the loss runs on the vocab-sharded logits; it
    must follow the dp=2 losses (FSDP2, no checkpointing), and the export must give the
    trained logits."""

    def run(name: str) -> TinyRun:
        return _two_shard_run(demo_data, tmp_path / name).but(data_parallel="fsdp2", export=True)

    dp_run = rank_pool.run(  # type: ignore[attr-defined]
        2, run_sft_on_rank, run("dp2").but(tp=1).overrides(), PROBE, timeout_s=240
    )[0]
    tp_run = rank_pool.run(  # type: ignore[attr-defined]
        2,
        run_sft_on_rank,
        run("tp2")
        .but(
            "parallel.sequence_parallel=true",
            "model.activation_checkpointing=true",
            tp=2,
            accumulation=2,
        )
        .overrides(),
        PROBE,
        timeout_s=240,
    )[0]
    steps = sorted(dp_run["losses"])
    assert steps == sorted(tp_run["losses"]) == list(range(1, 13))
    a = torch.tensor([dp_run["losses"][s] for s in steps], dtype=torch.float64)
    b = torch.tensor([tp_run["losses"][s] for s in steps], dtype=torch.float64)
    torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=lambda m: f"dp vs tp\n{a}\n{b}\n{m}")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tp_run["export_dir"]).eval()
    assert model.config.tie_word_embeddings
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROBE)).logits
    torch.testing.assert_close(logits, tp_run["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["text", "vlm"])
def test_packed_runs_at_cp2_follow_the_cp1_losses(
    rank_pool: object, demo_data: DemoSplit, shapes_data: DemoSplit, tmp_path: Path, kind: str
) -> None:
    """Packed rows (energon-sft THD batches) at dp=1, cp=2 (accumulation 2) see the same global
    batches as dp=2, cp=1 (two logical loader shards): the same losses, in fp32. Text and the
    tiny Qwen2.5-VL (image tokens, M-RoPE ids and labels sharded alike). Both runs train with
    transformers' mask builders and cp-sharder's dense mask made to raise."""
    split = demo_data if kind == "text" else shapes_data
    extra = ["data.packing=true", "data.max_length=96"]
    if kind == "vlm":
        extra.append("data.model_family=qwen2_5_vl")
    runs = {}
    for cp, accumulation in ((1, 1), (2, 2)):
        run = _two_shard_run(split, tmp_path / f"{kind}-cp{cp}").but(
            *extra, micro_batch_size=2, steps=4, cp=cp, accumulation=accumulation, export=False
        )
        runs[cp] = rank_pool.run(  # type: ignore[attr-defined]
            2,
            run_packed_sft_without_dense_masks,
            run.overrides(),
            96,  # max_length: no mask wider than one packed row
            timeout_s=300,
        )[0]
    steps = sorted(runs[1])
    assert steps == sorted(runs[2]) == [1, 2, 3, 4]
    a = torch.tensor([runs[1][s] for s in steps], dtype=torch.float64)
    b = torch.tensor([runs[2][s] for s in steps], dtype=torch.float64)
    torch.testing.assert_close(
        a, b, rtol=2e-4, atol=2e-5, msg=lambda m: f"{kind} cp=1 vs cp=2\n{a}\n{b}\n{m}"
    )
    summary = (tmp_path / f"{kind}-cp2" / "summary.json").read_text()
    assert "THD context parallelism (cp=2)" in summary
