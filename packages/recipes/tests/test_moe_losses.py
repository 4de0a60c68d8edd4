"""The recipe's MoE router losses against values computed by hand from the unmodified HF model,
with the accumulation/data-parallel scaling, and the routing metrics."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from train_recipes.config.sft import MoELossConfig
from train_recipes.model.moe import MoEGroups, RouterLosses, convert_model
from train_testing.tiny_hf import tiny_model


def _tiny_qwen3_moe() -> torch.nn.Module:
    """train_testing's tiny Qwen3-MoE (2 layers, 4 experts, top-2), weights from N(0, 0.3)."""
    return tiny_model("qwen3_moe", vocab_size=50, init_std=0.3)


def _hand_losses(hf_model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """Layer-mean Switch loss, layer-mean z-loss and the [L, E] loads, from the HF routers."""
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    gates = [m for m in hf_model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    handles = [
        g.register_forward_hook(lambda _m, _i, out: captured.append((out[0], out[2])))
        for g in gates
    ]
    with torch.no_grad():
        hf_model(ids)
    for h in handles:
        h.remove()
    aux, z, loads = [], [], []
    for logits, topk in captured:
        num_tokens, num_experts = logits.shape
        probs = torch.softmax(logits.double(), dim=-1)
        counts = torch.zeros(num_experts, dtype=torch.float64)
        for e in topk.reshape(-1).tolist():
            counts[e] += 1
        fraction = counts / (num_tokens * topk.shape[1])
        aux.append(float(num_experts * (fraction * probs.mean(0)).sum()))
        z.append(float((torch.logsumexp(logits.double(), dim=-1) ** 2).mean()))
        loads.append(counts)
    return sum(aux) / len(aux), sum(z) / len(z), torch.stack(loads)


def test_router_loss_term_matches_hand_computed_scaling() -> None:
    hf_model = _tiny_qwen3_moe()
    model = copy.deepcopy(hf_model)
    assert convert_model(model, MoEGroups(ep=1, ep_group=None, replica_group=None)) is None
    micro = [torch.randint(0, 50, (2, 5)), torch.randint(0, 50, (1, 7))]
    grad_ranks, window, num_tokens = 2, len(micro), 23.0
    weights = MoELossConfig(aux_loss_coef=0.1, z_loss_coef=0.01)
    losses = RouterLosses(model, weights, grad_ranks=grad_ranks, window=window)
    want_load = torch.zeros(2, 4, dtype=torch.float64)
    for ids in micro:
        with losses.collect():
            model(ids)
        term = losses.term(torch.tensor(num_tokens))
        aux, z, load = _hand_losses(hf_model, ids)
        want_load += load
        want = (0.1 * aux + 0.01 * z) * num_tokens / (grad_ranks * window)
        assert isinstance(term, torch.Tensor) and term.requires_grad
        # The Engine scales by G/N and the wrapper averages over G ranks: this micro-batch then
        # adds coef * loss / (G * window) to the objective, a mean over ranks and micro-batches.
        assert float(term.detach()) == pytest.approx(want, rel=1e-5)
    metrics = losses.metrics(torch.device("cpu"))
    assert metrics["moe/tokens_per_expert_min"] == float(want_load.min())
    assert metrics["moe/tokens_per_expert_max"] == float(want_load.max())
    cv = (want_load.std(dim=1, unbiased=False) / want_load.mean(dim=1)).mean()
    assert metrics["moe/tokens_per_expert_cv"] == pytest.approx(float(cv))
    assert metrics["moe/dropped_tokens"] == 0.0
    assert losses.metrics(torch.device("cpu"))["moe/tokens_per_expert_max"] == 0.0  # reset


def test_no_losses_without_coefficients_or_moe() -> None:
    model = _tiny_qwen3_moe()
    convert_model(model, MoEGroups(ep=1, ep_group=None, replica_group=None))
    losses = RouterLosses(model, MoELossConfig(), grad_ranks=1, window=1)
    with losses.collect():
        model(torch.randint(0, 50, (1, 4)))
    assert losses.term(4.0) == 0.0
    dense = RouterLosses(
        torch.nn.Linear(2, 2), MoELossConfig(aux_loss_coef=1.0), grad_ranks=1, window=1
    )
    assert not dense.active and dense.metrics(torch.device("cpu")) == {}


def test_deepseek_bias_update_after_step_follows_the_window_load() -> None:
    # 8 routed experts in 4 groups (2 kept), a shared expert, MoE from layer 1 on.
    model = tiny_model("deepseek_v3", vocab_size=50, init_std=0.3)
    convert_model(model, MoEGroups(ep=1, ep_group=None, replica_group=None))
    bias_only = MoELossConfig(bias_update_rate=0.01)  # no aux or z-loss
    losses = RouterLosses(model, bias_only, grad_ranks=1, window=2)
    router = losses.layers[0].router
    before = router.score_correction_bias.clone()
    load = torch.zeros(8)
    for _ in range(2):  # a window of two micro-batches
        with losses.collect(), torch.no_grad():
            model(torch.randint(0, 50, (2, 6)))
        ids = losses._routing[0].topk_ids
        load += torch.bincount(ids.reshape(-1), minlength=8).float()
        losses.term(12.0)
    losses.after_step(torch.device("cpu"))
    want = before + 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(router.score_correction_bias, want)
