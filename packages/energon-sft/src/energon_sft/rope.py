"""3-D (M-RoPE) position ids of Qwen2-VL-style batches, restarting for every packed part.

# B rows, S tokens per row, N images in the batch, (t, h, w) an image's grid in patches, m the
# spatial merge size (one placeholder token per m x m patches)

Qwen2-VL and Qwen2.5-VL rotate queries and keys by three position ids per token (time, height,
width). A text token has the same id in all three; the tokens of an image get (start + time
index, start + row, start + column) over its merged (t, h/m, w/m) grid; the next text token
continues at start + max(h, w) / m. The model's own ``get_rope_index`` sees each row as one
sequence, so for packed rows (several samples per row) the ids are built here per part: a part
starts where the 1-D position ids restart at 0. The encoder calls this once per sample in the
loader workers (through the family adapter), so batches arrive with the ids.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _runs(mask: Tensor) -> list[tuple[int, int]]:
    """[start, stop) of every run of True in a 1-D bool tensor."""
    edges = torch.diff(mask.to(torch.int8), prepend=mask.new_zeros(1, dtype=torch.int8))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    stops = torch.nonzero(edges == -1).flatten().tolist()
    if len(stops) < len(starts):
        stops.append(mask.numel())
    return list(zip(starts, stops, strict=True))


def mrope_position_ids(
    position_ids: Tensor,
    image_mask: Tensor,
    image_grid_thw: Tensor,
    *,
    spatial_merge_size: int,
) -> Tensor:
    """The (time, height, width) position ids of every token, per packed part.

    Args:
        position_ids: [B, S] int64 1-D ids, 0 where a part starts, as in :class:`SFTBatch`
            (whose trailing padding continues the last part).
        image_mask: [B, S] bool, True on image placeholder tokens.
        image_grid_thw: [N, 3] int64 (t, h, w) patch grid of every image, in the order the
            images appear in the rows (row 0 first).
        spatial_merge_size: m; an image has t * h * w / m^2 placeholder tokens.

    Returns:
        [3, B, S] int64 on the device of ``position_ids``. Text tokens (and padding) carry their
        1-D id shifted by the images before them in their part; prepend ``position_ids`` to get
        the [4, B, S] form that transformers' Qwen2-VL models take for packed rows.

    Raises:
        ValueError: when the image tokens and the grids disagree (a run of image tokens that
            no sequence of grids fills exactly, or grids left over).
    """
    if position_ids.shape != image_mask.shape or position_ids.ndim != 2:
        raise ValueError(
            f"position_ids {tuple(position_ids.shape)} and image_mask "
            f"{tuple(image_mask.shape)} must both be [B, S]"
        )
    if spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size must be >= 1, got {spatial_merge_size}")
    out = position_ids.unsqueeze(0).repeat(3, 1, 1)
    grids = image_grid_thw.reshape(-1, 3).tolist()
    merge2 = spatial_merge_size * spatial_merge_size
    next_grid = 0
    for row in range(position_ids.shape[0]):
        restarts = torch.nonzero(position_ids[row] == 0).flatten().tolist()
        for start, stop in _runs(image_mask[row].bool()):
            # Consecutive images with no text between them form one run: split it by grids.
            at = start
            while at < stop:
                if next_grid >= len(grids):
                    raise ValueError(
                        f"row {row} has image tokens at [{at}, {stop}) but all {len(grids)} "
                        f"grids of image_grid_thw are used; pass the grids of every image"
                    )
                t, h, w = grids[next_grid]
                tokens = t * h * w // merge2
                if tokens < 1 or at + tokens > stop:
                    raise ValueError(
                        f"image {next_grid} (grid {(t, h, w)}, merge {spatial_merge_size}) has "
                        f"{tokens} tokens, but row {row} has {stop - at} image tokens left at "
                        f"[{at}, {stop}); the image_mask and image_grid_thw do not match"
                    )
                base = int(out[0, row, at])
                ht, wd = h // spatial_merge_size, w // spatial_merge_size
                time = torch.arange(t).view(t, 1, 1).expand(t, ht, wd)
                height = torch.arange(ht).view(1, ht, 1).expand(t, ht, wd)
                width = torch.arange(wd).view(1, 1, wd).expand(t, ht, wd)
                grid = torch.stack([time, height, width]).reshape(3, -1) + base
                out[:, row, at : at + tokens] = grid.to(out.device)
                # Text after the image continues at base + max(h, w) / m instead of
                # base + tokens, up to the end of this part.
                part_end = next((r for r in restarts if r > at), position_ids.shape[1])
                out[:, row, at + tokens : part_end] += max(ht, wd) - tokens
                at += tokens
                next_grid += 1
    if next_grid != len(grids):
        raise ValueError(
            f"image_grid_thw has {len(grids)} grids but the rows hold image tokens for "
            f"{next_grid}; every grid needs its placeholder tokens"
        )
    return out
