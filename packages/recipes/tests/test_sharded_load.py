"""Meta-device init + sharded safetensors load: bit-identical to from_pretrained (weights,
rotary buffers, tied embeddings, logits) under FSDP2 and under tp=2, and each rank reads and
holds about its shard, not the whole model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _scale_workers import save_medium_llama, save_tiny, sharded_load_on_rank

PROBE = [[5, 17, 33, 2, 90, 41, 7, 11]]


def _eager(kind: str, folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if kind == "qwen2_5_vl" else AutoModelForCausalLM
    return auto.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("kind", "layout"), [("qwen3", "fsdp2"), ("llama", "tp"), ("qwen2_5_vl", "tp+sp")]
)
def test_sharded_load_equals_from_pretrained_bitwise(
    rank_pool: Any, kind: str, layout: str, tmp_path: Path
) -> None:
    """qwen3 is tied (lm_head absent from the file), the VLM has text and vision rotary
    tables (and sequence-parallel norms: replicated DTensors); llama is untied with an odd
    vocabulary (uneven shards)."""
    folder = save_tiny(kind, tmp_path / kind)
    results = rank_pool.run(
        2, sharded_load_on_rank, kind, str(folder), layout, PROBE, timeout_s=240
    )
    eager = _eager(kind, folder)
    got = results[0]
    expected_state = eager.state_dict()
    assert got["state"].keys() == expected_state.keys()
    for name, value in expected_state.items():
        assert torch.equal(got["state"][name], value), name
    expected_buffers = dict(eager.named_buffers())
    assert got["buffers"].keys() == expected_buffers.keys()
    for name, value in expected_buffers.items():
        assert torch.equal(got["buffers"][name], value), name
    with torch.no_grad():
        logits = eager(input_ids=torch.tensor(PROBE)).logits
    if layout == "fsdp2":  # the same arithmetic as the eager model: the same bits
        assert torch.equal(got["logits"], logits)
    else:  # row-parallel projections sum partial products in another order
        torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
def test_each_rank_reads_and_holds_about_its_shard(rank_pool: Any, tmp_path: Path) -> None:
    folder = save_medium_llama(tmp_path / "medium")
    results = rank_pool.run(
        2, sharded_load_on_rank, "llama", str(folder), "fsdp2", PROBE, timeout_s=240
    )
    full = results[0]["file_bytes"]
    assert full > 100e6
    for rank, result in enumerate(results):
        # FSDP2 over 2 ranks: each rank reads its half of every tensor.
        assert result["bytes_read"] < 0.55 * full, (rank, result["bytes_read"], full)
        # Peak host memory growth during the load (VmHWM): its shard, not a full copy.
        assert result["peak_growth"] < 0.7 * full, (rank, result["peak_growth"], full)


def test_bfloat16_checkpoint_loads_bitwise_in_one_process(tmp_path: Path) -> None:
    """No process group, no DTensor: every tensor is read whole; bf16 on disk and in memory."""
    from _scale_workers import tiny_hf_model
    from train_recipes.model.loading import build_on_meta, load_sharded_safetensors

    torch.manual_seed(0)
    saved: Any = tiny_hf_model("qwen3", dtype=torch.bfloat16)
    saved.generation_config.max_length = 77  # not the default: must come from the folder
    saved.save_pretrained(tmp_path / "bf16")
    model = build_on_meta(
        tmp_path / "bf16", dtype=torch.bfloat16, attn_implementation="sdpa", image_text=False
    )
    stats = load_sharded_safetensors(model, tmp_path / "bf16", device=torch.device("cpu"))
    assert stats.bytes_read == stats.file_bytes  # one rank holds everything
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    for name, value in eager.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    for name, value in eager.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], value), name
    generation: Any = model
    assert generation.generation_config.max_length == 77


def test_missing_tensor_names_the_key_and_the_fix(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from train_recipes.model.loading import build_on_meta, load_sharded_safetensors

    folder = save_tiny("llama", tmp_path / "llama")
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    model = build_on_meta(folder, dtype=torch.float32, attn_implementation="sdpa", image_text=False)
    with pytest.raises(KeyError, match=r"model\.norm\.weight.*model\.sharded_load=false"):
        load_sharded_safetensors(model, folder, device=torch.device("cpu"))


@pytest.mark.timeout(300)
def test_recipe_with_sharded_load_matches_from_pretrained(
    rank_pool: Any, demo_data: Any, tmp_path: Path
) -> None:
    """The recipe on a model folder under FSDP2 (dp=2): the default sharded load and
    from_pretrained on every rank train to the same losses."""
    from _recipes_workers import run_sft_on_rank
    from conftest import QUIET_CPU_RUN, data_overrides
    from train_recipes.data.demo import build_char_tokenizer
    from train_testing import tiny_hf

    tokenizer = build_char_tokenizer()
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    sizes = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128}
    model = tiny_hf.tiny_model(
        "llama", tie_word_embeddings=True, bos_token_id=None, **sizes, **special
    )
    folder = tiny_hf.save_tiny(model, tmp_path / "model", tokenizer=tokenizer)
    common = [
        *data_overrides(demo_data),
        f"model.path={folder}",
        "parallel.data_parallel=fsdp2",
        "train.steps=6",
        *QUIET_CPU_RUN,
        "train.export=false",
        "data.micro_batch_size=8",
        "data.shuffle=false",
    ]
    runs = [
        rank_pool.run(
            2,
            run_sft_on_rank,
            [*common, f"train.output_dir={tmp_path / name}", f"model.sharded_load={flag}"],
            PROBE,
            timeout_s=240,
        )[0]
        for name, flag in (("sharded", "null"), ("eager", "false"))
    ]
    sharded, eager = ([r["losses"][s] for s in sorted(r["losses"])] for r in runs)
    assert len(sharded) == 6
    assert sharded == pytest.approx(eager, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(runs[0]["logits"], runs[1]["logits"], rtol=1e-5, atol=1e-6)
