"""The one place where the recipes touch energon-sft's data API.

Everything the recipes need from energon-sft goes through these functions, so an API change
there is a change here only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Required, TypeAlias, TypedDict, cast

import torch
from torch import Tensor

from train_recipes.config.loader import JSONValue

if TYPE_CHECKING:
    import torch.distributed as dist

    from energon_sft import SFTBatch, SFTLoader, SFTTaskEncoder, TopologyMapper
    from train_recipes.config.sft import SFTConfig

logger = logging.getLogger(__name__)

# What the model path takes from an energon-sft SFTBatch (the loader builds every value; here
# keys are only chosen): the token tensors of every batch, the document layout of packed
# (THD) batches, and the M-RoPE ids and images of vision families.
_TOKEN_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")
_IMAGE_KEYS = ("pixel_values", "image_grid_thw")
# Host-side keys: cp-sharder plans the packed layout from them on the host (and the megatron
# backend's PackedSeqParams from cu_seqlens/max_seqlen), and the recipe takes the loader's count
# of trained tokens (it owns that count: nobody recounts the labels), so they stay there (a
# device copy would have to be read back, stalling the GPU's queue).
HOST_KEYS = frozenset(
    {"qkv_format", "seq_lens", "cu_seqlens", "max_seqlen", "num_trainable_tokens"}
)


#: One chat row as a chat JSONL holds it: ``{"messages": [message, ...], "media": [paths]}``
#: (``media`` only with images).
ChatRow: TypeAlias = dict[str, JSONValue]
#: One message of a chat row: ``{"role": ..., "content": text or a list of parts}``.
ChatMessage: TypeAlias = dict[str, JSONValue]


class ModelBatch(TypedDict, total=False):
    """One micro-batch as the recipe's model path takes it (built by :func:`batch_tensors`).

    Every tensor is [B, S] unless noted; ``labels`` are already shifted (-100 untrained).
    """

    input_ids: Required[Tensor]
    labels: Required[Tensor]
    position_ids: Required[Tensor]
    attention_mask: Required[Tensor]  # int64, 1 on real tokens
    num_trainable_tokens: Required[int]  # the loader's count of labels != -100 (host)
    qkv_format: Literal["thd"]  # packed rows only (host)
    seq_lens: Tensor  # [B, N] document lengths, -1 past the last (host)
    cu_seqlens: Tensor  # [K + 1] int32 segment offsets into [B * S], packed only (host)
    max_seqlen: int  # the longest segment, packed only (host)
    mrope_position_ids: Tensor  # [3, B, S], VLM only
    pixel_values: Tensor  # [P, D], VLM batches with images
    image_grid_thw: Tensor  # [N, 3], VLM batches with images


def family_takes_images(model_family: str) -> bool:
    """Whether energon-sft's adapter for ``model_family`` encodes images (the VLM path).

    Raises:
        ValueError: an unknown family (the message lists the registered ones).
    """
    from energon_sft import get_model_family

    return bool(get_model_family(model_family).supports_images)


def is_vlm(config: SFTConfig) -> bool:
    """The image-text path: energon-sft's adapter for ``data.model_family`` takes images."""
    return family_takes_images(config.data.model_family)


def convert_chat_jsonl(jsonl: str | Path, out_dir: str | Path) -> Path:
    """Chat JSONL -> a prepared Energon dataset, through energon-sft's converter."""
    import energon_sft

    convert = getattr(energon_sft, "convert_jsonl", None)
    if convert is None:
        raise ImportError(
            "energon_sft does not export convert_jsonl (its documented JSONL -> Energon "
            f"converter); installed energon-sft {energon_sft.__version__} is not the tested version"
        )
    return Path(convert(jsonl, out_dir))


def build_encoder(
    tokenizer: object,
    *,
    model_family: str,
    max_length: int,
    train_on: str,
    pad_to_multiple_of: int,
    packing: bool,
    overlong: str = "truncate",
) -> SFTTaskEncoder:
    """energon-sft's SFTTaskEncoder for this recipe.

    Args:
        tokenizer: the tokenizer, or a processor with ``.tokenizer`` (VLM families).
        model_family: energon-sft's model-family adapter name.
        max_length: tokens per sample after the chat template.
        train_on: "all_assistant" turns or only the "final_assistant" one.
        pad_to_multiple_of: row padding (2 * cp, so rows split into the cp chunks).
        packing: pack several samples per row (a 64-sample packing buffer).
        overlong: a row over ``max_length``: "truncate" (weight 0), "skip" or "error".
    """
    from energon_sft import SFTTaskEncoder

    return SFTTaskEncoder(
        tokenizer,
        model_family=model_family,
        max_length=max_length,
        train_on=train_on,  # type: ignore[arg-type]
        pad_to_multiple_of=pad_to_multiple_of,
        packing_buffer_size=64 if packing else None,
        overlong=overlong,  # type: ignore[arg-type]
    )


def build_loader(
    path: str | Path,
    *,
    encoder: SFTTaskEncoder,
    batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    num_workers: int,
    seed: int,
    shuffle: bool,
    num_logical_shards: int | None,
) -> SFTLoader:
    """energon-sft's savable loader for one data-parallel replica (state_dict/load_state_dict)."""
    from energon_sft import build_sft_loader

    return build_sft_loader(
        str(path),
        encoder=encoder,
        batch_size=batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        num_workers=num_workers,
        seed=seed,
        shuffle=shuffle,
        num_logical_shards=num_logical_shards,
    )


def topology_mapper(*, dp: int, cp: int, tp: int, num_logical_shards: int | None) -> TopologyMapper:
    """Build energon-sft's ``TopologyMapper`` of the recipe's (dp, cp, tp) mesh.

    tp varies fastest, then cp, then dp: the order of ``_dist.init_distributed``'s mesh.
    """
    from energon_sft import TopologyMapper

    return TopologyMapper(dp=dp, cp=cp, tp=tp, num_logical_shards=num_logical_shards)


def broadcast_next(
    iterator: Iterator[SFTBatch] | None,
    *,
    mapper: TopologyMapper,
    group: dist.ProcessGroup | None,
) -> SFTBatch:
    """Give every replica rank the replica owner's next batch (energon-sft's ``broadcast_next``).

    StopIteration, or the owner's error, reaches all of them alike.
    """
    from energon_sft import broadcast_next as energon_broadcast_next

    return energon_broadcast_next(iterator, mapper=mapper, group=group)


def collate_chat_rows(
    encoder: SFTTaskEncoder,
    rows: Sequence[ChatRow],
    *,
    media_root: str | Path | None = None,
) -> SFTBatch:
    """Chat rows encoded and collated by energon-sft exactly as a training batch is.

    The rows are ``{"messages": [...], "media": [paths]}``, as in the held-out JSONL; Energon's
    loader is not involved.

    ``media`` paths are read relative to ``media_root`` and handed over inline.
    """
    import base64

    from energon_sft import cook_chat

    root = Path(media_root) if media_root is not None else Path(".")
    samples = []
    for i, row in enumerate(rows):
        media = [
            {"name": str(m), "b64": base64.b64encode((root / m).read_bytes()).decode()}
            for m in cast("list[str]", row.get("media", []))
        ]
        crude = {
            "json": {**row, "media": media},
            "__key__": f"held_out/{i}",
            "__restore_key__": (),
            "__sources__": (),
        }
        samples.append(encoder.encode_chat(cook_chat(crude)))
    return encoder.collate(samples)


def batch_tensors(
    batch: SFTBatch | dict[str, object], *, vlm: bool = False, cp: int = 1
) -> ModelBatch:
    """The keys of an energon-sft batch that the recipe's model path takes (host tensors).

    ``labels`` are already shifted (``labels[:, t]`` is the target of position t, -100 where
    untrained), which is what cp-sharder expects and what the token-sum loss uses directly;
    ``num_trainable_tokens`` (int) is the loader's count of them (``labels != -100``).
    Packed batches (``qkv_format == "thd"``) add ``qkv_format`` and ``seq_lens`` [B, N] (each
    row's document lengths, -1 past the last), the form cp-sharder's packed path reads. With
    ``vlm``, the dict also holds ``mrope_position_ids`` [3, B, S] (built by the loader
    workers, per packed document) and, when the batch has images, ``pixel_values`` [P, D] and
    ``image_grid_thw`` [N, 3].

    Raises:
        ValueError: a VLM batch without M-RoPE ids (the family adapter builds none), or rows
            whose padded length does not split into the 2*cp chunks of context parallelism.
    """

    def get(name: str) -> object:
        return batch.get(name) if isinstance(batch, dict) else getattr(batch, name, None)

    out: dict[str, Any] = {name: get(name) for name in _TOKEN_KEYS}
    out["num_trainable_tokens"] = int(cast("int | Tensor", get("num_trainable_tokens")))
    seq = int(out["input_ids"].shape[-1])
    if cp > 1 and seq % (2 * cp):
        # The recipe's loader pads for its own cp; a loader built (or resumed) for another
        # cp would leave the sharder to re-pad every batch.
        raise ValueError(
            f"rows of {seq} tokens do not split into 2*cp={2 * cp} chunks: the loader was built "
            f"for another cp; build it with energon-sft pad_to_multiple_of={2 * cp} (the recipe "
            f"passes 2 * parallel.cp)"
        )
    out["attention_mask"] = out["attention_mask"].to(torch.long)
    if get("qkv_format") == "thd":
        out["qkv_format"] = "thd"
        out["seq_lens"] = get("seq_lens")
        # The flat form of the same layout, for the megatron backend's PackedSeqParams.
        out["cu_seqlens"] = get("cu_seqlens")
        out["max_seqlen"] = get("max_seqlen")
    if vlm:
        mrope = get("mrope_position_ids")
        if mrope is None:
            raise ValueError(
                "the batch has no mrope_position_ids [3, B, S]; the recipe's VLM path needs a "
                "model family whose energon-sft adapter builds them (e.g. 'qwen2_5_vl')"
            )
        out["mrope_position_ids"] = mrope
        if get("pixel_values") is not None:  # a text-only batch has no images
            out.update({name: get(name) for name in _IMAGE_KEYS})
    return cast(ModelBatch, out)


def to_device(batch: ModelBatch, device: torch.device) -> ModelBatch:
    """Copy the model's tensors of ``batch`` to ``device``; the host keys stay on the host."""
    moved = {
        k: v if k in HOST_KEYS else cast(Tensor, v).to(device, non_blocking=True)
        for k, v in batch.items()
    }
    return cast(ModelBatch, moved)


def mrope_positions_for_prompts(
    input_ids: Tensor, image_mask: Tensor, image_grid_thw: Tensor, *, spatial_merge_size: int
) -> Tensor:
    """[4, B, S] position ids (1-D text ids, then M-RoPE) of unpacked, left-aligned rows."""
    from energon_sft import mrope_position_ids

    rows, width = input_ids.shape
    text = torch.arange(width).expand(rows, width)
    mrope = mrope_position_ids(
        text, image_mask.cpu(), image_grid_thw.cpu(), spatial_merge_size=spatial_merge_size
    )
    return torch.cat([text.unsqueeze(0), mrope]).to(input_ids.device)
