"""The model-FLOP count and MFU helpers (``train_recipes.loop.throughput``): by hand for tiny Llama,
Qwen3-MoE and LoRA models, against torch's FlopCounterMode on one forward and backward of a
tiny Qwen2.5-VL (windowed and full-attention vision blocks, a packed text row of two
documents), the attention term of packed documents, the GPU peak table and the meter's clock."""

from __future__ import annotations

import time
import types
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from train_recipes.loop.metrics import TokenMeter
from train_recipes.loop.throughput import (
    attention_flops,
    check_windows,
    detected_peak_tflops,
    document_lengths,
    model_counts,
    peak_memory_gib,
    rate_fields,
    resolve_peak_tflops,
)
from train_recipes.model.patch_embed import use_linear_patch_embed
from train_recipes.model.vision_attention import use_varlen_vision_attention
from train_testing.tiny_hf import TEXT_SIZES, tiny_model

_VISION = {"depth": 3, "num_heads": 2, "window_size": 56, "fullatt_block_indexes": [2]}
_TOKENS = {"image_token_id": 98, "vision_start_token_id": 99, "vision_end_token_id": 100}
H, FFN, V = TEXT_SIZES["hidden_size"], TEXT_SIZES["intermediate_size"], TEXT_SIZES["vocab_size"]
LAYERS, HEADS = TEXT_SIZES["num_hidden_layers"], TEXT_SIZES["num_attention_heads"]
KV = TEXT_SIZES["num_key_value_heads"]


def _llama_weights(head_dim: int) -> int:
    """Weights per token of the tiny Llama by hand: q, k, v, o, gate, up, down; the head."""
    attention = H * HEADS * head_dim + 2 * H * KV * head_dim + HEADS * head_dim * H
    return LAYERS * (attention + 3 * H * FFN) + V * H


@pytest.mark.parametrize("tied", [False, True])
def test_llama_count_by_hand_and_by_flop_counter(tied: bool) -> None:
    model = tiny_model("llama", tie_word_embeddings=tied)
    counts = model_counts(model)
    n = _llama_weights(H // HEADS)  # the embedding is a lookup; a tied head counts once
    assert counts.per_token == 6 * n
    assert (counts.layers, counts.attn_dim) == (LAYERS, H)
    # The matmuls of one forward and backward, as torch counts them: 6 x weights x tokens.
    ids = torch.randint(0, V, (1, 12))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    by_op = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    matmul = by_op.get("aten.mm", 0) + by_op.get("aten.addmm", 0) + by_op.get("aten.bmm", 0)
    mask = {"attention_mask": torch.ones(1, 12)}
    assert matmul == counts.batch_flops(mask)["text matmul"] == 6 * n * 12


def test_moe_counts_the_experts_a_token_reaches() -> None:
    model = tiny_model("qwen3_moe")
    cfg = model.config
    experts, top_k, moe_i, head_dim = 4, 2, 16, 8
    attention = H * HEADS * head_dim + 2 * H * KV * head_dim + HEADS * head_dim * H
    router = experts * H
    per_layer = attention + router + top_k * 3 * H * moe_i  # K of E experts, the router whole
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        experts,
        top_k,
        moe_i,
    )
    counts = model_counts(model)
    assert counts.per_token == 6 * (LAYERS * per_layer + V * H)
    assert counts.attn_dim == HEADS * head_dim
    # Expert parallelism: a rank holding half of the experts counts the same per token.
    for layer in model.model.layers:
        bank = layer.mlp.experts
        bank.gate_up_proj = nn.Parameter(bank.gate_up_proj[:2].detach())
        bank.down_proj = nn.Parameter(bank.down_proj[:2].detach())
    assert model_counts(model).per_token == counts.per_token


def test_lora_base_costs_four_adapters_six() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    head_dim = H // HEADS
    adapters = LAYERS * (4 * H + HEADS * head_dim * 4 + 4 * H + KV * head_dim * 4)
    assert model_counts(model).per_token == 4 * _llama_weights(head_dim) + 6 * adapters


def test_packed_documents_attend_within_themselves() -> None:
    counts = model_counts(tiny_model("llama"))
    one = counts.batch_flops({"attention_mask": torch.ones(1, 40)})
    packed = counts.batch_flops(
        {"attention_mask": torch.ones(1, 40), "seq_lens": torch.tensor([[30, 10, -1]])}
    )
    assert packed["text matmul"] == one["text matmul"]
    # The pairs across the two documents (30 x 10) are the difference.
    assert one["text attention"] - packed["text attention"] == 12 * H * LAYERS * 30 * 10
    assert packed["text attention"] == 12 * H * LAYERS * (30 * 31 / 2 + 10 * 11 / 2)
    assert attention_flops([40], layers=LAYERS, dim=H) == one["text attention"]
    # Unpacked rows: each row's real tokens; an empty row adds nothing.
    mask = torch.zeros(3, 16)
    mask[0, :16], mask[1, :5] = 1, 1
    assert document_lengths({"attention_mask": mask}) == [16, 5]


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10G", None),
        ("Tesla T4", None),
    ],
)
def test_peak_table(name: str, peak: float | None) -> None:
    assert detected_peak_tflops(name) == peak


def test_peak_override_rates_and_memory_off_cuda() -> None:
    cpu = torch.device("cpu")
    assert resolve_peak_tflops(None, cpu) is None  # no MFU on CPU unless set
    assert resolve_peak_tflops(100.0, cpu) == 100.0
    assert peak_memory_gib(cpu) is None
    # 4000 tokens and 8e14 FLOPs in 2 s on 2 devices of 100 TFLOPS.
    fields = rate_fields(tokens=4000, flops=8e14, seconds=2.0, devices=2, peak_tflops=100.0)
    assert fields == pytest.approx({"tokens_per_s_per_gpu": 1000.0, "mfu": 2.0})
    no_peak = rate_fields(tokens=4000, flops=8e14, seconds=2.0, devices=2, peak_tflops=None)
    assert no_peak == {"tokens_per_s_per_gpu": 1000.0}


def test_meter_leaves_out_paused_time() -> None:
    meter = TokenMeter(duplicates=2)  # two ranks see these rows: each adds half
    meter.restart_clock()
    meter.add_inputs(torch.ones(2, 8), flops=100.0)
    with meter.paused(torch.device("cpu")):
        time.sleep(0.5)  # an evaluation or a checkpoint
    window = meter.read(torch.device("cpu"))
    assert (window.tokens, window.flops) == (8.0, 50.0)
    assert window.seconds < 0.4, window  # generous: the pause alone is 0.5 s
    assert meter.run_window() == window  # one read: the run's rate is that read
    meter.add_inputs(torch.ones(1, 4))
    later = meter.read(torch.device("cpu"))
    assert meter.run_window() == later  # the first read (warm-up) is left out
    meter.add_inputs(torch.ones(1, 6))
    third = meter.read(torch.device("cpu"))
    summed = meter.run_window()
    assert summed is not None and summed.tokens == later.tokens + third.tokens == 5.0
    assert summed.seconds == pytest.approx(later.seconds + third.seconds)


def test_vlm_count_matches_torch_flop_counter() -> None:
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
    counts = model_counts(model)
    check_windows(grid.tolist(), model.config.vision_config, counts)
    parts = counts.batch_flops(batch)

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
