"""The loader-vs-step benchmark's model-FLOP count (``bench/_vlm_flops.py``) against torch's own
FlopCounterMode on one forward and backward of a tiny Qwen2.5-VL (windowed and full-attention
vision blocks, a packed text row of two documents)."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from train_recipes.patch_embed import use_linear_patch_embed
from train_recipes.vision_attention import use_varlen_vision_attention
from train_testing.tiny_hf import tiny_model

BENCH = Path(__file__).parents[1] / "bench" / "_vlm_flops.py"
_VISION = {"depth": 3, "num_heads": 2, "window_size": 56, "fullatt_block_indexes": [2]}
_TOKENS = {"image_token_id": 98, "vision_start_token_id": 99, "vision_end_token_id": 100}


def _flops_module() -> Any:
    if not BENCH.is_file():
        pytest.skip(f"bench module not shipped here ({BENCH}); the scripts live in the repository")
    spec = importlib.util.spec_from_file_location("_vlm_flops_under_test", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_flops_match_torch_flop_counter() -> None:
    flops = _flops_module()
    torch.manual_seed(0)
    model = tiny_model("qwen2_5_vl", vision=_VISION, vocab_size=101, **_TOKENS)
    use_varlen_vision_attention(model)
    use_linear_patch_embed(model)  # counted as an mm (the Conv3d would be a convolution)
    # An 8x12-patch image (6 windows, 24 placeholder tokens) in the first of two documents.
    docs = [30, 10]
    grid = torch.tensor([[1, 8, 12]])
    ids = torch.randint(0, 90, (1, sum(docs)))
    ids[0, 1], ids[0, 2:26], ids[0, 26] = 99, 98, 100
    pixels = torch.randn(96, 3 * 2 * 14 * 14)
    batch = types.SimpleNamespace(
        seq_lens=torch.tensor([docs]), image_grid_thw=grid, attention_mask=torch.ones(1, 40)
    )
    counts = flops.model_counts(model)
    flops.check_windows(grid.tolist(), model.config.vision_config, counts)
    parts = flops.batch_flops(counts, batch)

    # Each document alone (what the packed path computes), so the counter sees its attention.
    counter = FlopCounterMode(display=False)
    with counter:
        start, image = 0, True
        for n in docs:
            inputs: dict[str, Any] = {"input_ids": ids[:, start : start + n], "use_cache": False}
            if image:
                inputs |= {"pixel_values": pixels, "image_grid_thw": grid}
            model(**inputs).logits.float().sum().backward()
            start, image = start + n, False
    by_op = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    matmul = by_op.pop("aten.mm", 0) + by_op.pop("aten.addmm", 0)
    # The counter's backward has no gradient for the pixel values (they need none): 6 -> 4 x the
    # patch embedding's weights x patches.
    patch_weights = model.model.visual.patch_embed.proj.weight.numel()  # type: ignore[union-attr]
    expected = parts["text matmul"] + parts["vision matmul"] - 2 * patch_weights * 96
    assert matmul == pytest.approx(expected, rel=1e-9), (matmul, parts)
    # Attention: the counter has 1 (forward) + 2.5 (backward, with flash's recomputed scores)
    # x the forward's 4 d per attended pair, and no causal discount.
    fwd = sum(v for k, v in by_op.items() if "attention" in k and "backward" not in k)
    bwd = sum(v for k, v in by_op.items() if "attention" in k and "backward" in k)
    assert by_op and all("attention" in k for k in by_op), by_op  # nothing else was counted
    assert bwd == pytest.approx(2.5 * fwd, rel=1e-9)
    tcfg = model.config.text_config  # type: ignore[union-attr]
    full_text = 4 * tcfg.hidden_size * tcfg.num_hidden_layers * sum(n * n for n in docs)
    vision_fwd = parts["vision attention"] / 3
    assert fwd == pytest.approx(full_text + vision_fwd, rel=1e-9), (fwd, parts)
    causal_text = 4 * tcfg.hidden_size * tcfg.num_hidden_layers * sum(n * (n + 1) / 2 for n in docs)
    assert parts["text attention"] == pytest.approx(3 * causal_text, rel=1e-12)
