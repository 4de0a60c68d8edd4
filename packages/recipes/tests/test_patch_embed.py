"""The vision tower's patch embedding as a matmul: the Conv3d's output and gradients (float64,
tiny Qwen2.5-VL), the same parameters, and nothing switched on a text model."""

from __future__ import annotations

from typing import Any

import torch

from train_recipes.model.patch_embed import use_linear_patch_embed
from train_testing.tiny_hf import tiny_model


def _embed_run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    embed: Any = model.model.visual.patch_embed  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(2)
    k = 3 * 2 * 14 * 14
    pixels = torch.randn(24, k, generator=gen, dtype=torch.float64).requires_grad_(True)
    out = embed(pixels)
    probe = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    (out * probe).sum().backward()
    assert pixels.grad is not None and embed.proj.weight.grad is not None
    return out.detach(), pixels.grad, embed.proj.weight.grad


def test_linear_patch_embed_equals_the_conv3d_float64() -> None:
    reference = tiny_model("qwen2_5_vl", dtype=torch.float64, init_std=0.1)
    model = tiny_model("qwen2_5_vl", dtype=torch.float64, init_std=0.1)
    model.load_state_dict(reference.state_dict())
    names = [n for n, _ in model.named_parameters()]
    assert use_linear_patch_embed(model) == 1
    assert use_linear_patch_embed(model) == 1  # again: the same forward
    assert [n for n, _ in model.named_parameters()] == names
    switched: Any = model.model.visual.patch_embed  # type: ignore[union-attr]
    stock: Any = reference.model.visual.patch_embed  # type: ignore[union-attr]
    assert "forward" in vars(switched) and "forward" not in vars(stock)
    runs = zip(_embed_run(model), _embed_run(reference), ("out", "dx", "dw"), strict=True)
    for got, want, what in runs:
        err = float((got - want).abs().max())
        scale = float(want.abs().max())
        assert scale > 0 and err <= 1e-12 * scale, f"{what}: max error {err}, scale {scale}"


def test_text_models_keep_their_modules() -> None:
    assert use_linear_patch_embed(tiny_model("llama")) == 0
