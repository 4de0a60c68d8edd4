"""Model FLOPs of one Qwen2.5-VL SFT step (forward + backward), for the loader-vs-step MFU.

# T text tokens, P vision patches, L a packed document's length, W a window's (or image's) length

Counted, per batch (training = 3 x the forward's matmul FLOPs: 2 per multiply-add forward, twice
that backward):

- text matmuls: 6 * N_text * T, N_text = the weights of every ``nn.Linear`` of the decoder
  (q, k, v, o, gate, up, down) plus the output projection (counted once when tied), T = the
  real (non-padding) tokens, image placeholders included;
- vision matmuls: 6 * N_vis * P, N_vis = the patch embedding (a matmul per patch) and every
  block's ``nn.Linear``; plus 6 * N_merger * P / merge^2 for the patch merger, which runs per
  merged token;
- text attention, causal per packed document (``seq_lens``): 6 * 2 * d * layers * sum L(L+1)/2,
  d = query heads x head dim (QK^T and PV: 2 FLOPs per multiply-add each, so 4 d per pair
  forward, 12 d trained);
- vision attention, non-causal per window in the windowed blocks and per image frame in the
  ``fullatt_block_indexes`` blocks: 12 * d_vis * sum W^2 per block, windows enumerated from
  ``image_grid_thw`` and the vision config (``window_size`` / merge / patch merged units a side;
  the last row and column of windows are partial), checked against transformers' own
  ``get_vision_window_index`` where it exists.

Not counted: norms, activations, rotary embeddings, the loss's softmax, the optimizer, padding
tokens, recomputation under activation checkpointing or in the attention backward (MFU, not
hardware FLOPs utilisation). ``tests/test_bench_vlm_flops.py`` checks the count against torch's
``FlopCounterMode`` on a tiny model: the matmuls agree exactly (less the pixel values' gradient,
which training never forms: 2 x patch weights x patches, 0.03% of the 3B preset's count), and so
does the attention once the counter's conventions (no causal discount, 2.5 x forward backward)
are applied.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def model_counts(model: Any) -> dict[str, Any]:
    """The matmul weight counts and attention shapes of a Qwen2.5-VL-style model (unwrapped)."""
    inner = model.model
    text, visual = inner.language_model, inner.visual
    tcfg, vcfg = model.config.text_config, model.config.vision_config
    head = model.get_output_embeddings()
    head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    patch = visual.patch_embed.proj.weight.numel()  # Conv3d weight: one [C*t*p*p -> H] matmul
    merger = _linear_weights(visual.merger)
    return {
        "text_matmul_params": _linear_weights(text) + head.weight.numel(),
        "vision_matmul_params": patch + _linear_weights(visual.blocks),
        "merger_matmul_params": merger,
        "text_layers": tcfg.num_hidden_layers,
        "text_attn_dim": tcfg.num_attention_heads * head_dim,
        "vision_depth": vcfg.depth,
        "vision_attn_dim": vcfg.hidden_size,
        "full_blocks": len(vcfg.fullatt_block_indexes),
        "merge": vcfg.spatial_merge_size,
        "window_units": vcfg.window_size // vcfg.spatial_merge_size // vcfg.patch_size,
    }


def _chunks(n: int, size: int) -> Iterator[int]:
    for start in range(0, n, size):
        yield min(size, n - start)


def window_lengths(grid_thw: list[list[int]], *, merge: int, units: int) -> list[int]:
    """Patches per attention window, in transformers' order (frame, window row, window column)."""
    out: list[int] = []
    for t, h, w in grid_thw:
        rows, cols = h // merge, w // merge
        per_frame = [
            r * c * merge * merge for r in _chunks(rows, units) for c in _chunks(cols, units)
        ]
        out.extend(per_frame * t)
    return out


def check_windows(grid_thw: list[list[int]], vision_config: Any, counts: dict[str, Any]) -> None:
    """Raise if :func:`window_lengths` disagrees with transformers' window index (when present)."""
    try:
        from transformers.vision_utils import get_vision_window_index
    except ImportError:  # older transformers: the tower computes windows itself
        return
    _, cu = get_vision_window_index(
        torch.tensor(grid_thw),
        spatial_merge_size=vision_config.spatial_merge_size,
        window_size=vision_config.window_size,
        patch_size=vision_config.patch_size,
    )
    theirs = [int(v) for v in (cu[1:] - cu[:-1]).tolist() if v > 0]
    ours = window_lengths(grid_thw, merge=counts["merge"], units=counts["window_units"])
    if ours != theirs:
        raise AssertionError(f"window lengths {ours} differ from transformers' {theirs}")


def batch_flops(counts: dict[str, Any], batch: Any) -> dict[str, float]:
    """Model FLOPs of one trained batch (an energon-sft batch: ``seq_lens``, ``image_grid_thw``).

    Returns:
        Per part ("text matmul", "text attention", "vision matmul", "vision attention") and
        "total", in FLOPs.
    """
    docs = [int(v) for v in batch.seq_lens.flatten().tolist() if v > 0]
    tokens = sum(docs)
    if tokens != int(batch.attention_mask.sum()):
        raise AssertionError(
            f"the documents' seq_lens sum to {tokens} tokens, the attention mask to "
            f"{int(batch.attention_mask.sum())}: the FLOP count would not match the batch"
        )
    grid = [[int(v) for v in row] for row in batch.image_grid_thw.tolist()]
    patches = sum(t * h * w for t, h, w in grid)
    merge = counts["merge"]
    windows = window_lengths(grid, merge=merge, units=counts["window_units"])
    frames = [h * w for t, h, w in grid for _ in range(t)]
    window_blocks = counts["vision_depth"] - counts["full_blocks"]
    vision_pairs = counts["full_blocks"] * sum(n * n for n in frames) + window_blocks * sum(
        n * n for n in windows
    )
    parts = {
        "text matmul": 6.0 * counts["text_matmul_params"] * tokens,
        "text attention": 12.0
        * counts["text_attn_dim"]
        * counts["text_layers"]
        * sum(n * (n + 1) / 2 for n in docs),
        "vision matmul": 6.0 * counts["vision_matmul_params"] * patches
        + 6.0 * counts["merger_matmul_params"] * patches / (merge * merge),
        "vision attention": 12.0 * counts["vision_attn_dim"] * vision_pairs,
    }
    parts["total"] = sum(parts.values())
    return parts
