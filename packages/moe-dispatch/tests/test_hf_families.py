"""Converted Qwen3-MoE, Mixtral and DeepSeek-V3 blocks equal the HF blocks in float64 (top-k ties,
an expert with no tokens), and the export back to the HF layout gives the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from _moe_dispatch_hf import build_block, tiny_causal_lm
from moe_dispatch import (
    TopKRouter,
    collect_routing,
    convert_hf_moe,
    expert_load,
    from_hf_moe_block,
    hf_state_dict,
    load_balancing_loss,
    update_score_correction_bias,
)

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3"]
SILENT, TWIN_A, TWIN_B = 7, 1, 2  # expert never chosen; two experts with identical scores


def _block_with_ties(kind: str) -> tuple[nn.Module, torch.Tensor]:
    block = build_block(kind, seed=3, dtype=torch.float64)
    router = block.gate.weight
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 9, router.shape[1], generator=g, dtype=torch.float64)
    x[..., 0] = 4.0 + x[..., 0].abs()  # a large positive first feature on every token
    with torch.no_grad():
        router[:, 0] = 0.0
        router[SILENT] = 0.0
        router[SILENT, 0] = -5.0  # logit <= -20: never in the top-k
        router[TWIN_B] = router[TWIN_A]  # equal logits for every token: top-k ties
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias[TWIN_B] = bias[TWIN_A]
            bias[SILENT] = 0.0
    return block, x


def _hf_routing(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = block.gate(x.reshape(-1, x.shape[-1]))
    return out[2]


@pytest.mark.parametrize("kind", FAMILIES)
def test_converted_block_equals_hf_float64(kind: str) -> None:
    block, x = _block_with_ties(kind)
    ids = _hf_routing(block, x)
    load = expert_load(ids, block.gate.weight.shape[0])
    assert load[SILENT] == 0, "the silent expert must receive no token"
    tie_rows = (ids == TWIN_A).any(1) ^ (ids == TWIN_B).any(1)
    assert bool(tie_rows.any()), "some token must pick one of two tied experts"
    moe = from_hf_moe_block(block, layer_id=0)
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=x.dtype)
    outs, grads = [], []
    for module in (block, moe):
        xi = x.clone().requires_grad_()
        out = module(xi)
        (out * weight).sum().backward()
        outs.append(out)
        grads.append(xi.grad)
    tol = {"rtol": 1e-9, "atol": 1e-10}
    torch.testing.assert_close(outs[1], outs[0], **tol)
    torch.testing.assert_close(grads[1], grads[0], **tol)
    hf_params = dict(block.named_parameters())
    ours = dict(moe.named_parameters())
    pairs = {"gate.weight": "router.weight"}
    for name in hf_params:
        if name.startswith(("shared_expert", "shared_experts")):
            pairs[name] = "shared_expert." + name.split(".", 1)[1]
            if name.startswith("shared_expert_gate"):
                pairs[name] = name
    for hf_name, our_name in pairs.items():
        want, got = hf_params[hf_name].grad, ours[our_name].grad
        assert want is not None and got is not None, hf_name
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=hf_name: f"{n}: {m}")
    for name in ("gate_up_proj", "down_proj"):
        want, got = hf_params[f"experts.{name}"].grad, ours[f"experts.{name}"].grad
        assert want is not None and got is not None
        torch.testing.assert_close(got, want, **tol)
        assert got[SILENT].abs().max() == 0  # no token, no gradient


def test_deepseek_routing_is_group_limited_with_bias() -> None:
    block, x = _block_with_ties("deepseek_v3")
    moe = from_hf_moe_block(block)
    router = moe.router
    assert router.score_func == "sigmoid" and router.num_groups == 4 and router.topk_group == 2
    assert router.score_correction_bias is not None
    flat = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        ours = router(flat)
    groups = ours.topk_ids // 2  # 8 experts in 4 groups of 2
    assert all(len(set(row.tolist())) <= 2 for row in groups)
    torch.testing.assert_close(ours.topk_ids.sort(1).values, _hf_routing(block, x).sort(1).values)
    # Aux-loss-free balancing: the most loaded expert's bias goes down, an idle one's up.
    before = router.score_correction_bias.clone()
    load = update_score_correction_bias(router, ours.topk_ids, rate=0.01)
    delta = router.score_correction_bias - before
    assert delta[int(load.argmax())] == pytest.approx(-0.01)
    assert delta[SILENT] == pytest.approx(0.01)
    assert router.score_correction_bias.grad is None
    assert not any("score_correction_bias" in name for name, _ in moe.named_parameters())


def test_softmax_router_rejects_groups() -> None:
    with pytest.raises(ValueError, match="score_func='sigmoid'"):
        TopKRouter(8, 8, 2, num_groups=2)
    with pytest.raises(ValueError, match="exceeds"):
        TopKRouter(8, 8, 6, score_func="sigmoid", num_groups=4, topk_group=2)


def _perturb(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("kind", FAMILIES)
def test_export_round_trip_gives_trained_logits(kind: str, tmp_path: Path) -> None:
    model = tiny_causal_lm(kind, seed=6)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(7))
    assert convert_hf_moe(model)
    _perturb(model, seed=8)  # "training" changed every weight, experts and routers included
    with torch.no_grad():
        want = model(ids).logits
    state = hf_state_dict(model)
    fresh = type(model)(model.config).eval()
    fresh.load_state_dict(state, strict=True)
    fresh.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        got = loaded(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_hf_state_dict_takes_the_given_experts_without_expert_parallelism() -> None:
    """With every expert on this rank, the experts come from the given (full) state like every
    other entry, never from the live module: under FSDP2 at ep=1 those are DTensor shards, which
    a rank-0-only writer would gather alone (a hang)."""
    model = tiny_causal_lm("qwen3_moe", seed=6)
    assert convert_hf_moe(model)
    given = {k: v + 1.0 for k, v in model.state_dict().items()}  # not the live weights
    state = hf_state_dict(model, given)
    for key, value in state.items():
        source = key.replace("mlp.gate.weight", "mlp.router.weight")
        assert torch.equal(value, given[source]), key
    assert any(".experts.gate_up_proj" in k for k in state)
    assert hf_state_dict(model, {}) == {}  # a rank that holds no tensors gets none


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("record_before_convert", [False, True])
def test_output_router_logits_equals_unconverted_model_float64(
    kind: str, record_before_convert: bool
) -> None:
    """transformers' router_logits, aux_loss and loss (with its load-balancing term) and their
    gradients are the same on the converted model as on the HF model with the same weights.
    Also after a recording forward before the conversion (transformers' hooks already in)."""
    import copy

    hf = tiny_causal_lm(kind, seed=9).double().train()
    hf.set_experts_implementation("eager")  # transformers' grouped_mm takes no float64
    converted = copy.deepcopy(hf)
    if record_before_convert:
        with torch.no_grad():
            converted(torch.zeros(1, 3, dtype=torch.long), output_router_logits=True)
    assert convert_hf_moe(converted)
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(0, 64, (2, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # padding stays out of transformers' load-balancing loss
    outs = []
    for model in (hf, converted):
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
        out.loss.backward()
        outs.append(out)
    want, got = outs
    assert len(got.router_logits) == len(want.router_logits) >= 1
    for w_logits, g_logits in zip(want.router_logits, got.router_logits, strict=True):
        assert g_logits.shape == w_logits.shape == (ids.numel(), w_logits.shape[-1])
        torch.testing.assert_close(g_logits, w_logits, rtol=1e-12, atol=1e-12)
    if getattr(want, "aux_loss", None) is not None:  # Qwen3-MoE, Mixtral (not DeepSeek-V3)
        assert float(want.aux_loss) > 0
        torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=1e-12)
    hf_gates = [m.gate.weight for m in hf.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    routers = [m.router.weight for m in converted.modules() if hasattr(m, "routing_sink")]
    assert len(hf_gates) == len(routers) >= 1
    for w_gate, g_router in zip(hf_gates, routers, strict=True):
        assert w_gate.grad is not None and g_router.grad is not None
        torch.testing.assert_close(g_router.grad, w_gate.grad, rtol=1e-10, atol=1e-12)
    # The package's own losses stay available without transformers' flag.
    with torch.no_grad(), collect_routing(converted) as routing:
        plain = converted(ids)
    assert getattr(plain, "router_logits", None) is None
    assert routing and all(r.topk_ids.shape[0] == ids.numel() for r in routing)
    assert torch.isfinite(
        torch.as_tensor(sum(load_balancing_loss(r.probs, r.topk_ids) for r in routing))
    )


def test_unsupported_moe_block_is_rejected() -> None:
    class FancySparseMoeBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(4, 4)
            self.experts = nn.ModuleList()

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].mlp = FancySparseMoeBlock()
    with pytest.raises(NotImplementedError, match="FancySparseMoeBlock"):
        convert_hf_moe(model)
