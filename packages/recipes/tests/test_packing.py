"""Packed rows: the recipe's token-sum loss equals the sum over the samples computed alone."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from conftest import data_overrides
from train_recipes import _integrations as data_api
from train_recipes.config import SFTConfig, load_config
from train_recipes.demo import DemoSplit, build_char_tokenizer
from train_recipes.modeling import build_model, load_processor, tokenizer_of
from train_recipes.sft import token_sum_loss


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
    loader = data_api.build_loader(
        split.energon_dir,
        encoder=encoder,
        batch_size=2,
        dp_rank=0,
        dp_world_size=1,
        num_workers=0,
        seed=0,
        shuffle=False,
        num_logical_shards=None,
    )
    return next(iter(loader))


@pytest.mark.timeout(120)
def test_packed_loss_equals_per_sample_reference(demo_data: DemoSplit) -> None:
    tokenizer = build_char_tokenizer()
    config = load_config(SFTConfig, None, ["data.max_length=64"])
    torch.manual_seed(0)
    model = build_model(config, tokenizer).double().eval()
    raw = _first_batch(demo_data, tokenizer, model_family="text", max_length=64, packing=True)
    batch = data_api.batch_tensors(raw, torch.device("cpu"))
    pos = batch["position_ids"]
    starts = [(r, c) for r in range(pos.shape[0]) for c in range(pos.shape[1]) if pos[r, c] == 0]
    assert len(starts) > 2 * pos.shape[0], "rows are not packed"
    with torch.no_grad():
        packed = token_sum_loss(model, batch)
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
    merge = int(processor.image_processor.merge_size)
    batch = data_api.batch_tensors(raw, torch.device("cpu"), spatial_merge_size=merge)
    batch["image_mask"] = raw.image_mask
    return model, processor.image_processor, batch


@pytest.mark.timeout(180)
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
def test_packed_vlm_loss_equals_per_sample_reference(shapes_data: DemoSplit) -> None:
    model, _, batch = _vlm_setup(shapes_data, packing=True)
    pos = batch["position_ids"]
    starts = [(r, c) for r in range(pos.shape[0]) for c in range(pos.shape[1]) if pos[r, c] == 0]
    assert len(starts) > 2 * pos.shape[0], "rows are not packed"
    patches = [int(g.prod()) for g in batch["image_grid_thw"]]
    pixel_rows = list(itertools.accumulate(patches, initial=0))
    with torch.no_grad():
        packed = token_sum_loss(model, batch, vlm=True)
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
