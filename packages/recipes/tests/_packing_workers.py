"""Rank functions and builders for the packed-row tests (a light module: ranks re-import it).

Packed rows are built the way the loader builds them: hand-made energon-sft ``EncodedSample``
documents, packed with ``pack_samples`` and collated with ``collate`` (M-RoPE ids from the
family adapter, as in the loader workers), then reduced to the model's keys by the recipe's
``batch_tensors``. The loss is the recipe's ``token_sum_loss``; the reference runs every
document alone through the unmodified Hugging Face model, in float64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch import Tensor

from _recipes_workers import logged_losses, metric_rows
from train_testing import tiny_hf

# B rows, S padded length, V vocabulary, D values per image patch.
VOCAB = tiny_hf.TEXT_SIZES["vocab_size"]
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123
PATCH_VALUES = 3 * 2 * 14 * 14  # channels * temporal patch * patch^2 (Qwen2.5-VL's vision input)
MERGE = tiny_hf.VISION_SIZES["spatial_merge_size"]

# Row 0: three documents (lengths 5, 11 and 3: none divisible by 2*cp=4, 11 longer than one
# cp=2 chunk of the flattened stream), then one padding token; row 1: one document of 13,
# then 7 padding tokens. Both rows padded to a multiple of 2*cp = 4: S = 20.
TEXT_ROWS = [[5, 11, 3], [13]]
# VLM: (text tokens before the image, image grid (t, h, w) or None, text tokens after).
VLM_ROWS = [
    [(3, (1, 4, 4), 4), (2, None, 5), (1, (1, 2, 4), 3)],
    [(4, (1, 4, 2), 9)],
]


def tiny_model(family: str) -> torch.nn.Module:
    """A random-init float64 model of the family (seeded), attention "sdpa"."""
    if family not in ("llama", "qwen3", "qwen2_5_vl"):
        raise ValueError(f"unknown test family {family!r}")
    tokens = {
        "image_token_id": IMAGE,
        "video_token_id": VIDEO,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
    }
    fields = tokens if family == "qwen2_5_vl" else {}
    return tiny_hf.tiny_model(family, dtype=torch.float64, max_position_embeddings=128, **fields)


def _text_doc(n: int, g: torch.Generator) -> dict[str, Tensor]:
    ids = torch.randint(0, IMAGE, (n,), generator=g)
    return {"input_ids": ids, "image_mask": torch.zeros(n, dtype=torch.bool)}


def _vlm_doc(
    before: int, grid: tuple[int, int, int] | None, after: int, g: torch.Generator
) -> dict[str, Any]:
    parts = [torch.randint(0, IMAGE, (before,), generator=g)]
    mask = [torch.zeros(before, dtype=torch.bool)]
    pixels, grids = None, torch.zeros((0, 3), dtype=torch.int64)
    if grid is not None:
        t, h, w = grid
        n = t * h * w // (MERGE * MERGE)
        parts += [torch.tensor([VISION_START]), torch.full((n,), IMAGE), torch.tensor([VISION_END])]
        mask += [torch.zeros(1, dtype=torch.bool), torch.ones(n, dtype=torch.bool)]
        mask += [torch.zeros(1, dtype=torch.bool)]
        pixels = torch.randn(t * h * w, PATCH_VALUES, generator=g, dtype=torch.float64)
        grids = torch.tensor([grid])
    parts.append(torch.randint(0, IMAGE, (after,), generator=g))
    mask.append(torch.zeros(after, dtype=torch.bool))
    return {
        "input_ids": torch.cat(parts),
        "image_mask": torch.cat(mask),
        "pixel_values": pixels,
        "image_grid_thw": grids,
    }


class _Processor:
    """What energon-sft's Qwen2.5-VL adapter reads from a processor to build M-RoPE ids."""

    class image_processor:
        merge_size = MERGE


def _encoded(doc: dict[str, Any], *, vlm: bool, key: str) -> Any:
    """One energon-sft document: shifted labels (the first two tokens untrained, image and
    marker tokens never), position ids from 0, M-RoPE ids from the family adapter."""
    from energon_sft import EncodedSample, get_model_family

    ids = doc["input_ids"]
    n = ids.numel()
    trained = torch.ones(n, dtype=torch.bool)
    trained[:2] = False
    trained &= ids < IMAGE  # image tokens and vision markers are no targets
    labels = torch.full((n,), -100, dtype=torch.int64)
    labels[:-1] = torch.where(trained[1:], ids[1:], -100)
    positions = torch.arange(n)
    grids = doc.get("image_grid_thw", torch.zeros((0, 3), dtype=torch.int64))
    mrope = None
    if vlm:
        mrope = get_model_family("qwen2_5_vl").mrope_position_ids(
            _Processor(), positions, doc["image_mask"], grids
        )
    return EncodedSample(
        __key__=key,
        __restore_key__=(),
        input_ids=ids,
        labels=labels,
        position_ids=positions,
        image_mask=doc["image_mask"],
        mrope_position_ids=mrope,
        pixel_values=doc.get("pixel_values"),
        image_grid_thw=grids,
        seq_lens=[n],
        sample_weights=[1.0],
        source_ids=[key],
    )


def packed_batch(
    family: str, *, seed: int = 0, pad_to_multiple_of: int = 4
) -> tuple[dict[str, Any], list[Any]]:
    """(the recipe's model batch, the documents row by row) of the test's packed rows."""
    from energon_sft import EncodedSample
    from energon_sft.batch import collate, pack_samples
    from train_recipes.data import energon_api as data_api

    vlm = family == "qwen2_5_vl"
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r, spec in enumerate(VLM_ROWS if vlm else TEXT_ROWS):
        docs = [
            _encoded(_vlm_doc(*d, g) if vlm else _text_doc(d, g), vlm=vlm, key=f"r{r}d{i}")
            for i, d in enumerate(spec)
        ]
        rows.append(docs)
    packs = [
        EncodedSample.derive_from(docs[0], __restore_key__=(), **pack_samples(docs))
        if len(docs) > 1
        else docs[0]
        for docs in rows
    ]
    fields = collate(packs, pad_token_id=0, pad_to_multiple_of=pad_to_multiple_of, qkv_format="thd")
    return data_api.batch_tensors(fields, vlm=vlm), rows


def reference_loss(model: torch.nn.Module, rows: list[list[Any]], *, vlm: bool) -> Tensor:
    """Sum of -log p(label) over every document run alone (float64, no packing, no sharder;
    a VLM document through the model's own M-RoPE builder from ``mm_token_type_ids``)."""
    total = torch.zeros((), dtype=torch.float64)
    for docs in rows:
        for doc in docs:
            extra: dict[str, Any] = {}
            if vlm and doc.pixel_values is not None:
                extra = {
                    "pixel_values": doc.pixel_values,
                    "image_grid_thw": doc.image_grid_thw,
                    "mm_token_type_ids": doc.image_mask[None].int(),
                }
            logits = model(input_ids=doc.input_ids[None], use_cache=False, **extra).logits[0]
            logp = torch.log_softmax(logits.double(), -1)
            keep = doc.labels != -100
            total = total - logp[keep].gather(-1, doc.labels[keep][:, None]).sum()
    return total


@contextlib.contextmanager
def forbid_dense_masks(max_mask_side: int) -> Iterator[None]:
    """Raise wherever a dense attention mask would be built on the training path.

    Patches transformers' mask builders (every registered one), cp-sharder's portable mask
    (``MaskSpec.mask``), and SDPA calls whose mask is wider than ``max_mask_side`` keys (the
    longest segment of the batch: a per-document kernel never needs more).
    """
    from transformers.masking_utils import AttentionMaskInterface

    # Imported before SDPA is patched: these modules bind the real SDPA at import, and a first
    # import under the patch would keep this guard (and its max_mask_side) for the process's
    # later tests (the rank pool reuses its processes).
    from cp_sharder.attention import portable, varlen  # noqa: F401

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a dense attention mask was built on the packed training path")

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def checked_sdpa(*args: Any, **kwargs: Any) -> Tensor:
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        if mask is not None and mask.shape[-1] > max_mask_side:
            raise AssertionError(
                f"SDPA got a {tuple(mask.shape)} mask, wider than the longest segment "
                f"({max_mask_side}): a dense mask on the packed training path"
            )
        return sdpa(*args, **kwargs)

    builders = dict.fromkeys(AttentionMaskInterface._global_mapping, refuse)
    with (
        mock.patch.dict(AttentionMaskInterface._global_mapping, builders),
        mock.patch.object(portable.MaskSpec, "mask", refuse),
        mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", checked_sdpa),
    ):
        yield


def packed_loss_matches_documents_alone(
    rank: int, world_size: int, family: str, cp: int
) -> dict[str, Any]:
    """The recipe's token-sum loss and every gradient on the packed rows at ``cp`` (the cp ranks'
    gradients summed, as DDP/FSDP over the replica would), and the per-document reference."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cp_sharder import ContextParallelSharder
    from train_recipes.sft.run import token_sum_loss

    vlm = family == "qwen2_5_vl"
    batch, rows = packed_batch(family)
    mesh = init_device_mesh("cpu", (world_size // cp, cp), mesh_dim_names=("dp", "cp"))
    model = tiny_model(family)
    sharder = ContextParallelSharder(model, mesh["cp"], padding_token_id=0)
    longest = int(max(n for row in batch["seq_lens"].tolist() for n in row))
    with forbid_dense_masks(max(longest, batch["input_ids"].shape[1])):
        loss = token_sum_loss(model, batch, sharder=sharder, vlm=vlm)
        loss.backward()
    total = loss.detach().clone()
    if cp > 1:
        group = mesh["cp"].get_group()
        dist.all_reduce(total, group=group)
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if rank != 0:
        return {}
    reference = tiny_model(family)
    ref_loss = reference_loss(reference, rows, vlm=vlm)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    return {"loss": total, "ref_loss": ref_loss.detach(), "grads": grads, "ref_grads": ref_grads}


def dense_mask_path_is_refused(rank: int, world_size: int) -> str:
    """The teeth of ``forbid_dense_masks``: the old packed path (restarting position ids,
    transformers' SDPA deriving a per-document mask) must trip it."""
    from train_recipes.sft.run import token_sum_loss

    batch, _ = packed_batch("llama")
    model = tiny_model("llama")
    old = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    try:
        with forbid_dense_masks(13):
            token_sum_loss(model, old)
    except AssertionError as err:
        return str(err)
    return "no error"


def packed_token_sum_loss(
    rank: int, world_size: int, model: torch.nn.Module, batch: dict[str, Any], vlm: bool
) -> Tensor:
    """``token_sum_loss`` of one batch through cp-sharder at cp=1 (one rank), no gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    from cp_sharder import ContextParallelSharder
    from train_recipes.sft.run import token_sum_loss

    sharder = ContextParallelSharder(model, init_device_mesh("cpu", (1,)), padding_token_id=0)
    with torch.no_grad():
        return token_sum_loss(model, batch, sharder=sharder, vlm=vlm)


def run_packed_sft_without_dense_masks(
    rank: int, world_size: int, overrides: list[str], max_mask_side: int
) -> dict[int, float]:
    """Run the SFT recipe with every dense-mask builder made to raise; rank 0 returns the
    logged losses by step."""

    from train_recipes.config import SFTConfig, load_config, validate_sft
    from train_recipes.sft.run import run_sft

    config = load_config(SFTConfig, None, overrides)
    validate_sft(config, world_size=world_size)
    with forbid_dense_masks(max_mask_side):
        run_sft(config)
    if rank != 0:
        return {}
    return logged_losses(metric_rows(config.train.output_dir))


def model_kwargs_are_the_sharders_output(
    rank: int, world_size: int, model: torch.nn.Module, batch: dict[str, Any]
) -> dict[str, Any]:
    """One training loss (gradients on: the fused path) through the run's ``TokenSumLoss`` at
    cp=1: which of the sharder's local tensors reached the model's forward as the very same
    objects, and which keyword inputs the forward got."""
    from torch.distributed.device_mesh import init_device_mesh

    from cp_sharder import ContextParallelSharder
    from train_recipes.loss.token_loss import TokenSumLoss

    sharder = ContextParallelSharder(model, init_device_mesh("cpu", (1,)), padding_token_id=0)
    shard = sharder.shard
    outputs: list[dict[str, Any]] = []

    def spy_shard(inputs: dict[str, Any]) -> Any:
        train_ctx, local = shard(inputs)
        outputs.append(dict(local))  # before the loss pops the labels
        return train_ctx, local

    received: list[dict[str, Any]] = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: received.append(dict(kwargs)), with_kwargs=True
    )
    sharder.shard = spy_shard  # type: ignore[method-assign]
    TokenSumLoss.for_model(model, sharder=sharder)(model, batch).backward()
    (local,), (kwargs,) = outputs, received
    return {
        "local": sorted(local),
        "received": sorted(kwargs),
        "same_objects": sorted(k for k in local if k in kwargs and kwargs[k] is local[k]),
    }
