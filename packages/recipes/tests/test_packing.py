"""Packed rows: the recipe's token-sum loss and its gradients equal every document run alone,
at cp=1 and cp=2, with no dense attention mask on the way; "is this a VLM?" asks the family."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from _packing_workers import (
    dense_mask_path_is_refused,
    model_kwargs_are_the_sharders_output,
    packed_loss_matches_documents_alone,
    packed_token_sum_loss,
)
from conftest import data_overrides
from train_recipes.config import ConfigError, SFTConfig, load_config, validate_sft
from train_recipes.data import energon_api as data_api
from train_recipes.data.demo import DemoSplit, build_char_tokenizer
from train_recipes.data.energon_api import is_vlm
from train_recipes.data.processors import load_processor, tokenizer_of
from train_recipes.model.build import build_model


def _first_batch(
    split: DemoSplit, processor: Any, *, model_family: str, max_length: int, packing: bool
) -> Any:
    """The first energon-sft batch (2 rows) of a demo split, in order."""
    encoder = data_api.build_encoder(
        processor,
        model_family=model_family,
        max_length=max_length,
        train_on="all_assistant",
        pad_to_multiple_of=1,
        packing=packing,
    )
    one_rank = {"dp_rank": 0, "dp_world_size": 1, "num_workers": 0}
    in_order = {"seed": 0, "shuffle": False, "num_logical_shards": None}
    loader = data_api.build_loader(
        split.energon_dir, encoder=encoder, batch_size=2, **one_rank, **in_order
    )
    return next(iter(loader))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2_5_vl"])
def test_packed_loss_and_gradients_equal_documents_alone(rank_pool: Any, family: str) -> None:
    """Rows of several documents (lengths not divisible by 2*cp, one longer than a cp chunk),
    a single-document row and padding; float64; transformers' mask builders and cp-sharder's
    dense mask raise if called."""
    for cp in (1, 2):
        out = rank_pool.run(2, packed_loss_matches_documents_alone, family, cp, timeout_s=200)[0]
        # The model runs in float64; vocab-parallel's log-probs come out in float32.
        torch.testing.assert_close(out["loss"].double(), out["ref_loss"], rtol=1e-6, atol=1e-6)
        assert out["grads"].keys() == out["ref_grads"].keys()
        for name, grad in out["grads"].items():
            torch.testing.assert_close(
                grad,
                out["ref_grads"][name],
                rtol=1e-5,
                atol=2e-6,
                msg=lambda m, cp=cp, name=name: f"cp={cp} {name}: {m}",
            )


def test_the_dense_mask_guard_catches_the_old_packed_path(rank_pool: Any) -> None:
    message = rank_pool.run(1, dense_mask_path_is_refused)[0]
    assert "dense attention mask" in message, message


def test_vlm_is_decided_by_the_family_adapter() -> None:
    """qwen2_vl (registered in energon-sft with the Qwen2-VL adapter) takes the image path;
    before, only the name qwen2_5_vl did and qwen2_vl trained as text."""
    for family, vision in (("qwen2_vl", True), ("qwen2_5_vl", True), ("text", False)):
        config = load_config(SFTConfig, None, [f"data.model_family={family}"])
        assert is_vlm(config) is vision, family
    shapes = load_config(SFTConfig, None, ["data.demo=shapes", "data.model_family=qwen2_vl"])
    validate_sft(shapes, world_size=2)
    with pytest.raises(ConfigError, match=r"data\.model_family"):
        validate_sft(load_config(SFTConfig, None, ["data.demo=shapes"]), world_size=2)


@pytest.mark.timeout(120)
def test_packed_loss_equals_per_sample_reference(rank_pool: Any, demo_data: DemoSplit) -> None:
    tokenizer = build_char_tokenizer()
    config = load_config(SFTConfig, None, ["data.max_length=64"])
    torch.manual_seed(0)
    model = build_model(config, tokenizer).double().eval()
    raw = _first_batch(demo_data, tokenizer, model_family="text", max_length=64, packing=True)
    batch = data_api.batch_tensors(raw)
    assert batch["qkv_format"] == "thd"
    pos = batch["position_ids"]
    starts = [(r, c) for r in range(pos.shape[0]) for c in range(pos.shape[1]) if pos[r, c] == 0]
    assert len(starts) > pos.shape[0], "rows are not packed"
    packed = rank_pool.run(1, packed_token_sum_loss, model, batch, False)[0]
    with torch.no_grad():
        # Reference: cut every row at its position restarts and run each real sample alone
        # (float64, plain log_softmax), summing -log p over its trained labels.
        ref = torch.zeros((), dtype=torch.float64)
        for r in range(pos.shape[0]):
            cuts = [c for c in range(pos.shape[1]) if pos[r, c] == 0] + [pos.shape[1]]
            for a, b in itertools.pairwise(cuts):
                ids = batch["input_ids"][r, a:b]
                labels = batch["labels"][r, a:b]
                if not batch["attention_mask"][r, a:b].any() or (labels == -100).all():
                    continue
                logits = model(input_ids=ids[None]).logits[0].double()
                logp = torch.log_softmax(logits, -1)
                keep = labels != -100
                ref -= logp[keep].gather(-1, labels[keep][:, None]).sum()
    torch.testing.assert_close(packed.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(240)
def test_the_model_receives_the_sharders_output_unchanged(
    rank_pool: Any, demo_data: DemoSplit
) -> None:
    """The training path's one batch form (ARCHITECTURE.md, "One micro-batch"): the tensors
    cp-sharder returns are the objects the model's forward receives, labels aside (the loss
    takes them), with nothing rebuilt or added between but ``use_cache``."""
    tokenizer = build_char_tokenizer()
    config = load_config(SFTConfig, None, ["data.max_length=64"])
    torch.manual_seed(0)
    model = build_model(config, tokenizer)
    raw = _first_batch(demo_data, tokenizer, model_family="text", max_length=64, packing=True)
    batch = data_api.batch_tensors(raw)
    out = rank_pool.run(1, model_kwargs_are_the_sharders_output, model, batch)[0]
    passed = [k for k in out["local"] if k != "labels"]
    assert passed and "input_ids" in passed, out
    assert out["same_objects"] == passed, out
    assert out["received"] == sorted([*passed, "use_cache"]), out


def _vlm_setup(shapes_data: DemoSplit, *, packing: bool) -> tuple[Any, Any, dict[str, Any]]:
    """(model in float64, image processor, one host batch) for the tiny Qwen2.5-VL demo."""
    config = load_config(
        SFTConfig,
        None,
        [*data_overrides(shapes_data), "data.model_family=qwen2_5_vl", "data.max_length=128"],
    )
    processor = load_processor(config)
    torch.manual_seed(0)
    model = build_model(config, tokenizer_of(processor)).double().eval()
    raw = _first_batch(
        shapes_data, processor, model_family="qwen2_5_vl", max_length=128, packing=packing
    )
    batch = data_api.batch_tensors(raw, vlm=True)
    batch["image_mask"] = raw.image_mask
    return model, processor.image_processor, batch


@pytest.mark.timeout(180)
@pytest.mark.slow  # a processor and a VLM build (~20 s): tests-recipes runs it
def test_the_tiny_vlm_keeps_fp32_rotary_tables_in_bf16(shapes_data: DemoSplit) -> None:
    # from_pretrained(dtype=bf16) keeps the rotary frequencies in fp32; rounding them to bf16
    # moves long positions by radians. The tiny demo VLM must be built the same way.
    overrides = [
        *data_overrides(shapes_data),
        "data.model_family=qwen2_5_vl",
        "model.dtype=bfloat16",
    ]
    config = load_config(SFTConfig, None, overrides)
    model = build_model(config, tokenizer_of(load_processor(config)))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tables = {name: b for name, b in model.named_buffers() if name.endswith("inv_freq")}
    assert len(tables) >= 2, sorted(tables)  # the text and the vision rotary tables
    for name, table in tables.items():
        assert table.dtype == torch.float32, name


def test_mrope_ids_of_unpacked_rows_match_the_models_own(shapes_data: DemoSplit) -> None:
    model, _, batch = _vlm_setup(shapes_data, packing=False)
    # transformers' builder, on whole rows with the padding mask (its documented use).
    reference, _ = model.model.get_rope_index(
        batch["input_ids"],
        mm_token_type_ids=batch["image_mask"].int(),
        image_grid_thw=batch["image_grid_thw"],
        attention_mask=batch["attention_mask"],
    )
    real = batch["attention_mask"].bool()
    assert batch["image_mask"].any(), "no image tokens in the batch"
    ours = batch["mrope_position_ids"]
    assert torch.equal(ours[:, real], reference[:, real])
    # The test has teeth: after an image, M-RoPE ids differ from the 1-D ids.
    assert not torch.equal(ours[0][real], batch["position_ids"][real])


@pytest.mark.timeout(240)
def test_packed_vlm_loss_equals_per_sample_reference(
    rank_pool: Any, shapes_data: DemoSplit
) -> None:
    model, _, batch = _vlm_setup(shapes_data, packing=True)
    pos = batch["position_ids"]
    starts = [(r, c) for r in range(pos.shape[0]) for c in range(pos.shape[1]) if pos[r, c] == 0]
    assert len(starts) > pos.shape[0], "rows are not packed"
    patches = [int(g.prod()) for g in batch["image_grid_thw"]]
    pixel_rows = list(itertools.accumulate(patches, initial=0))
    model_batch = {k: v for k, v in batch.items() if k != "image_mask"}
    packed = rank_pool.run(1, packed_token_sum_loss, model, model_batch, True)[0]
    with torch.no_grad():
        # Reference: every sample alone through transformers' own path (its M-RoPE builder
        # from mm_token_type_ids, no packing), float64 log_softmax over its trained labels.
        ref = torch.zeros((), dtype=torch.float64)
        image = 0
        for r in range(pos.shape[0]):
            cuts = [c for c in range(pos.shape[1]) if pos[r, c] == 0] + [pos.shape[1]]
            for a, b in itertools.pairwise(cuts):
                ids = batch["input_ids"][r, a:b]
                labels = batch["labels"][r, a:b]
                mask = batch["image_mask"][r, a:b]
                n_images = len(_image_runs(mask))
                images = range(image, image + n_images)
                image += n_images
                if not batch["attention_mask"][r, a:b].any() or (labels == -100).all():
                    continue
                extra: dict[str, Any] = {}
                if n_images:
                    extra["pixel_values"] = batch["pixel_values"][
                        pixel_rows[images.start] : pixel_rows[images.stop]
                    ]
                    extra["image_grid_thw"] = batch["image_grid_thw"][images.start : images.stop]
                    extra["mm_token_type_ids"] = mask[None].int()
                logits = model(input_ids=ids[None], use_cache=False, **extra).logits[0]
                logp = torch.log_softmax(logits.double(), -1)
                keep = labels != -100
                ref -= logp[keep].gather(-1, labels[keep][:, None]).sum()
    assert image == len(patches)
    torch.testing.assert_close(packed.double(), ref, rtol=1e-6, atol=1e-6)


def _image_runs(mask: torch.Tensor) -> list[int]:
    """Start index of every run of image tokens (one image each in the demo data)."""
    return [i for i in range(mask.numel()) if mask[i] and (i == 0 or not mask[i - 1])]


def test_rows_that_do_not_fit_the_cp_chunks_name_the_fix() -> None:
    from _packing_workers import packed_batch

    batch, _ = packed_batch("llama", pad_to_multiple_of=1)  # S = 19: padded for no cp
    assert batch["input_ids"].shape[1] == 19
    with pytest.raises(ValueError, match=r"rows of 19 tokens .* 2\*cp=4 .* pad_to_multiple_of=4"):
        data_api.batch_tensors(batch, cp=2)
    # Padded for cp=2 (a multiple of 4): accepted, with the packed layout keys.
    fitted, _ = packed_batch("llama", pad_to_multiple_of=4)
    assert data_api.batch_tensors(fitted, cp=2)["seq_lens"].tolist() == [[5, 11, 3], [13, -1, -1]]
