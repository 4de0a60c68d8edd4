"""Converted Hugging Face MoE blocks compute the same function as the originals (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from _moe_dispatch_hf import build_block
from moe_dispatch import RouterReplay, convert_hf_moe, from_hf_moe_block
from train_testing.tiny_hf import tiny_model


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_converted_block_matches_forward_and_backward(kind: str) -> None:
    block = build_block(kind, seed=1)
    moe = from_hf_moe_block(block, layer_id=0)
    x = torch.randn(3, 7, 16)
    outs, grads = [], []
    for module in (block, moe):
        xi = x.clone().requires_grad_()
        out = module(xi)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        outs.append(out)
        grads.append(xi.grad)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    hf: dict[str, torch.Tensor | None] = {
        "router": block.gate.weight.grad,
        "gate_up": block.experts.gate_up_proj.grad,
        "down": block.experts.down_proj.grad,
    }
    ours = {
        "router": moe.router.weight.grad,
        "gate_up": moe.experts.gate_up_proj.grad,
        "down": moe.experts.down_proj.grad,
    }
    for name, want in hf.items():
        got = ours[name]
        assert want is not None and got is not None, name
        torch.testing.assert_close(
            got, want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


class _LegacyExpert(nn.Module):
    """transformers 4.x Mixtral expert: w1 gate, w3 up, w2 down."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.w1 = nn.Linear(gate.shape[1], gate.shape[0], bias=False)
        self.w3 = nn.Linear(up.shape[1], up.shape[0], bias=False)
        self.w2 = nn.Linear(down.shape[1], down.shape[0], bias=False)
        with torch.no_grad():
            self.w1.weight.copy_(gate)
            self.w3.weight.copy_(up)
            self.w2.weight.copy_(down)
        self.act_fn = nn.SiLU()


class _LegacyMixtralSparseMoeBlock(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        weight = block.gate.weight
        self.gate = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(weight)
        self.top_k = block.gate.top_k
        ffn = block.experts.down_proj.shape[2]
        self.experts = nn.ModuleList(
            _LegacyExpert(gu[:ffn], gu[ffn:], d)
            for gu, d in zip(block.experts.gate_up_proj, block.experts.down_proj, strict=True)
        )


def test_legacy_per_expert_modules_convert_too() -> None:
    block = build_block("mixtral", seed=2)
    legacy = from_hf_moe_block(_LegacyMixtralSparseMoeBlock(block))
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(legacy(x), block(x), rtol=1e-5, atol=1e-6)


def test_convert_whole_model_and_bind_replay() -> None:
    # Three layers, the middle one a dense MLP; vocabulary 40.
    model = tiny_model("qwen3_moe", vocab_size=40, num_hidden_layers=3, mlp_only_layers=[1])
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    ids = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    assert convert_hf_moe(model) == [0, 2]  # layer 1 is a dense MLP
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    replay = RouterReplay()
    assert replay.bind(model) == [0, 2]
    with replay.record(), torch.no_grad():
        model(ids)
    assert sorted(replay.routes) == [0, 2] and replay.routes[2].shape == (18, 2)
