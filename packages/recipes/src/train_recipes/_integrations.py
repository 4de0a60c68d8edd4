"""The one place where the recipes touch energon-sft's data API.

Everything the recipes need from energon-sft goes through these functions, so an API change
there is a change here only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# The batch fields a causal LM forward (plus our loss) needs, in energon-sft's SFTBatch names.
_TEXT_FIELDS = ("input_ids", "labels", "attention_mask", "position_ids")


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
    tokenizer: Any,
    *,
    model_family: str,
    max_length: int,
    train_on: str,
    pad_to_multiple_of: int,
    packing: bool,
) -> Any:
    """energon-sft's SFTTaskEncoder for this recipe."""
    from energon_sft import SFTTaskEncoder

    return SFTTaskEncoder(
        tokenizer,
        model_family=model_family,
        max_length=max_length,
        train_on=train_on,  # type: ignore[arg-type]
        pad_to_multiple_of=pad_to_multiple_of,
        packing_buffer_size=64 if packing else None,
    )


def build_loader(
    path: str | Path,
    *,
    encoder: Any,
    batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    num_workers: int,
    seed: int,
    shuffle: bool,
    num_logical_shards: int | None,
) -> Any:
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


def collate_chat_rows(
    encoder: Any, rows: Sequence[dict[str, Any]], *, media_root: str | Path | None = None
) -> Any:
    """Chat rows (``{"messages": [...], "media": [paths]}``, as in the held-out JSONL) encoded
    and collated by energon-sft exactly as a training batch is, without Energon's loader.

    ``media`` paths are read relative to ``media_root`` and handed over inline.
    """
    import base64

    from energon_sft import cook_chat

    root = Path(media_root) if media_root is not None else Path(".")
    samples = []
    for i, row in enumerate(rows):
        media = [
            {"name": str(m), "b64": base64.b64encode((root / m).read_bytes()).decode()}
            for m in row.get("media", [])
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
    batch: Any, device: torch.device, *, spatial_merge_size: int | None = None
) -> dict[str, Tensor]:
    """The text fields of an energon-sft batch as a dict on ``device``.

    ``labels`` are already shifted (``labels[:, t]`` is the target of position t, -100 where
    untrained), which is what cp-sharder expects and what the token-sum loss uses directly.
    With ``spatial_merge_size`` (image-text models), the dict also holds
    ``mrope_position_ids`` [3, B, S]: Qwen2-VL's (time, height, width) ids, restarting for
    every packed part (computed on the host from the batch's image mask and grids).
    """

    def get(name: str) -> Any:
        return batch[name] if isinstance(batch, dict) else getattr(batch, name)

    out: dict[str, Tensor] = {name: get(name).to(device) for name in _TEXT_FIELDS}
    out["attention_mask"] = out["attention_mask"].to(torch.long)
    # Image batches: patches of all images concatenated [P, D] and one (t, h, w) grid per image.
    pixels = (
        batch.get("pixel_values")
        if isinstance(batch, dict)
        else getattr(batch, "pixel_values", None)
    )
    if pixels is not None:
        out["pixel_values"] = pixels.to(device)
        out["image_grid_thw"] = get("image_grid_thw").to(device)
    if spatial_merge_size is not None:
        from energon_sft import mrope_position_ids

        out["mrope_position_ids"] = mrope_position_ids(
            get("position_ids").cpu(),
            get("image_mask").cpu(),
            get("image_grid_thw").cpu(),
            spatial_merge_size=spatial_merge_size,
        ).to(device)
    return out


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
