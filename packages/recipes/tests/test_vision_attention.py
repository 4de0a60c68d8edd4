"""The VLM path's vision attention: one varlen call per block (cp-sharder) gives the output and
gradients of transformers' eager per-window attention (float64, tiny Qwen2.5-VL on the CPU);
the per-window loop is gone; compiled blocks (aot_eager) give the eager loss and gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from train_recipes.model import vision_attention
from train_recipes.model.vision_attention import (
    VISION_VARLEN_ATTENTION,
    use_varlen_vision_attention,
)
from train_testing.tiny_hf import tiny_model

# Two blocks: block 0 attends per window (56 px = 2x2 merged units = 4x4 patches), block 1 per
# image. An 8x10-patch image has 6 windows, two of them partial; a 4x4 one has one.
_VISION = {"depth": 2, "num_heads": 2, "window_size": 56, "fullatt_block_indexes": [1]}
_GRID = torch.tensor([[1, 8, 10], [1, 4, 4]])
_PATCH_DIM = 3 * 2 * 14 * 14


def _tiny_vlm(vision_attn: str) -> nn.Module:
    model = tiny_model("qwen2_5_vl", vision=_VISION, dtype=torch.float64, init_std=0.1)
    visual: Any = model.model.visual  # type: ignore[union-attr]
    visual.config._attn_implementation = vision_attn
    for block in visual.blocks:
        # Not the default 1/sqrt(D): a backend that ignored the module's scaling would differ.
        block.attn.scaling = 0.3
    return model


def _pixels() -> torch.Tensor:
    n = int(_GRID.prod(-1).sum())
    gen = torch.Generator().manual_seed(3)
    return torch.randn(n, _PATCH_DIM, generator=gen, dtype=torch.float64)


def _tower_run(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Merged output [N_tokens, H_text], d(sum of a fixed projection)/d pixels, weight grads."""
    visual: Any = model.model.visual  # type: ignore[union-attr]
    pixels = _pixels().requires_grad_(True)
    out = visual(pixels, grid_thw=_GRID)
    merged = out.pooler_output
    probe = torch.randn(
        merged.shape, generator=torch.Generator().manual_seed(4), dtype=merged.dtype
    )
    (merged * probe).sum().backward()
    assert pixels.grad is not None
    names = ("blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight", "blocks.1.attn.proj.weight")
    params = dict(visual.named_parameters())
    return merged.detach(), pixels.grad, {n: params[n].grad for n in names}  # type: ignore[misc]


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str) -> None:
    scale = float(expected.abs().max())
    err = float((actual - expected).abs().max())
    assert scale > 0 and err <= rtol * scale, f"{name}: max error {err}, scale {scale}"


@pytest.mark.parametrize(
    ("stock", "rtol"),
    # transformers' eager attention: matmuls in float64, its softmax in float32 (~1e-7);
    # its SDPA path: one float64 SDPA call per window.
    [("eager", 1e-5), ("sdpa", 1e-10)],
)
def test_varlen_vision_attention_equals_the_per_window_paths(stock: str, rtol: float) -> None:
    reference = _tiny_vlm(stock)
    model = _tiny_vlm("sdpa")
    model.load_state_dict(reference.state_dict())
    assert use_varlen_vision_attention(model)
    assert use_varlen_vision_attention(model)  # twice: harmless
    visual: Any = model.model.visual  # type: ignore[union-attr]
    assert visual.config._attn_implementation == VISION_VARLEN_ATTENTION
    # The text model keeps its attention.
    assert model.config.text_config._attn_implementation == "sdpa"  # type: ignore[union-attr]

    out, d_pixels, grads = _tower_run(model)
    ref_out, ref_pixels, ref_grads = _tower_run(reference)
    _close(out, ref_out, rtol, "output")
    _close(d_pixels, ref_pixels, rtol, "pixel_values grad")
    for name, grad in ref_grads.items():
        _close(grads[name], grad, rtol, name)


def test_one_varlen_call_per_block_and_no_per_window_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AttentionInterface

    from cp_sharder.attention import varlen

    model = _tiny_vlm("sdpa")
    assert use_varlen_vision_attention(model)
    segments: list[int] = []
    real = varlen.varlen_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        segments.append(args[3].cu_seqlens_q.numel() - 1)
        assert kwargs["causal"] is False and kwargs["scale"] == 0.3, kwargs
        return real(*args, **kwargs)

    def per_window(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the per-window SDPA path ran")

    monkeypatch.setattr(varlen, "varlen_attention", spy)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", per_window)
    _tower_run(model)
    # Block 0: 6 + 1 windows; block 1: the two images.
    assert segments == [7, 2], segments


def test_text_models_and_other_towers_keep_their_attention() -> None:
    llama = tiny_model("llama", dtype=torch.float64)
    assert not use_varlen_vision_attention(llama)
    assert llama.config._attn_implementation == "sdpa"  # type: ignore[union-attr]


def test_varlen_vision_attention_refuses_a_mask() -> None:
    q = torch.zeros(1, 2, 4, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="mask"):
        vision_attention.varlen_vision_attention(
            nn.Identity(),
            q,
            q,
            q,
            torch.zeros(1, 1, 4, 4),
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=4,
            max_length_k=4,
        )


def _compile_batch() -> dict[str, torch.Tensor]:
    """Two rows; row 0 holds a 4x8-patch image (2 windows in block 0, 8 placeholder tokens)."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 90, (2, 16), generator=gen)
    ids[0, 1], ids[0, 2:10], ids[0, 10] = 99, 98, 100  # vision start, image pads, vision end
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[(labels == 98) | (labels == 99)] = -100
    grid = torch.tensor([[1, 4, 8]])
    pixels = torch.randn(32, _PATCH_DIM, generator=gen, dtype=torch.float64)
    return {"input_ids": ids, "labels": labels, "pixel_values": pixels, "image_grid_thw": grid}


def _loss_and_grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, dict]:
    inputs = dict(batch)
    labels = inputs.pop("labels")
    logits = model(**inputs, use_cache=False).logits
    loss = nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_compiled_vlm_blocks_give_the_eager_loss_and_gradients() -> None:
    from train_recipes.model.build import compile_decoder_layers

    tokens = {"image_token_id": 98, "vision_start_token_id": 99, "vision_end_token_id": 100}
    models = [
        tiny_model("qwen2_5_vl", vision=_VISION, vocab_size=101, dtype=torch.float64, **tokens)
        for _ in range(2)
    ]
    eager, compiled = models
    compiled.load_state_dict(eager.state_dict())
    for model in models:
        assert use_varlen_vision_attention(model)
    text_layers = compiled.config.text_config.num_hidden_layers  # type: ignore[union-attr]
    try:
        n = compile_decoder_layers(compiled, backend="aot_eager")
        assert n == text_layers + _VISION["depth"], n
        batch = _compile_batch()
        ref_loss, ref_grads = _loss_and_grads(eager, batch)
        loss, grads = _loss_and_grads(compiled, batch)
    finally:
        torch._dynamo.reset()
    assert loss == pytest.approx(ref_loss, rel=1e-10)
    assert grads.keys() == ref_grads.keys()
    assert any("visual.blocks" in name for name in grads)
    for name, grad in ref_grads.items():
        _close(grads[name], grad, 1e-9, name)
