"""Router replay per micro-batch: recordings kept per micro-batch under accumulation, the
checkpoint recompute bitwise equal to the recorded forward, external [T, L, K] routes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from moe_dispatch import ExpertParallelMoE, MoEConfig, RouterReplay, collect_routing

E, K, H = 8, 2, 12


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            ExpertParallelMoE(
                MoEConfig(hidden_size=H, intermediate_size=10, num_experts=E, top_k=K, layer_id=i)
            )
            for i in (3, 5)
        )
        self.outputs: list[torch.Tensor] = []  # every layer output, forward and recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # No early stop: the recompute runs each layer to its end, so its output is recorded.
        with set_checkpoint_early_stop(False):
            for layer in self.layers:
                x = x + checkpoint(self._run, layer, x, use_reentrant=False)
        return x

    def _run(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = layer(x)
        self.outputs.append(out.detach().clone())
        return out


def _perturb(model: nn.Module) -> None:
    with torch.no_grad():
        for layer in model.layers:
            layer.router.weight.add_(torch.randn_like(layer.router.weight) * 2.0)


def test_recorded_micro_batches_replay_bitwise_with_recompute() -> None:
    model = TwoLayers()
    replay = RouterReplay()
    assert replay.bind(model) == [3, 5]
    micro = [torch.randn(9, H), torch.randn(4, H)]  # accumulation window of 2, unequal tokens
    for x in micro:
        model.outputs.clear()
        with replay.record():
            model(x).pow(2).sum().backward()
        # Forward then the backward recompute of each checkpointed layer: equal bit for bit.
        forward, recompute = model.outputs[:2], model.outputs[2:]
        assert len(recompute) == 2
        for a, b in zip(forward, recompute[::-1], strict=True):
            assert torch.equal(a, b)
    history = replay.history
    assert len(history) == 2 and history[1][5].shape == (4, K)
    _perturb(model)  # live routing would now differ
    for x, routes in zip(micro, history, strict=True):
        model.outputs.clear()
        with replay.replay(routes), collect_routing(model) as routing:
            model(x).pow(2).sum().backward()
        assert len(routing) == 2  # the recompute is not collected again
        assert torch.equal(routing[0].topk_ids, routes[3])
        assert torch.equal(routing[1].topk_ids, routes[5])
        forward, recompute = model.outputs[:2], model.outputs[2:]
        for a, b in zip(forward, recompute[::-1], strict=True):
            assert torch.equal(a, b)  # recompute replays the same routes
    replay.clear_history()
    assert replay.history == []


def test_external_stacked_routes_reproduce_their_choice() -> None:
    model = TwoLayers()
    replay = RouterReplay()
    replay.bind(model)
    tokens = 6
    g = torch.Generator().manual_seed(1)
    routes = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens * 2)]).reshape(
        tokens, 2, K
    )
    with replay.replay_stacked(routes, num_tokens=tokens), collect_routing(model) as routing:
        model(torch.randn(tokens, H)).sum().backward()
    assert torch.equal(routing[0].topk_ids, routes[:, 0])
    assert torch.equal(routing[1].topk_ids, routes[:, 1])
    assert model.layers[0].router.weight.grad is not None  # weights stay live


@pytest.mark.parametrize(
    ("shape", "bad_id", "kwargs", "message"),
    [
        ((6, 3, K), None, {}, r"expected \[T, L=2, K=2\]"),
        ((6, 2, K + 1), None, {}, r"expected \[T, L=2"),
        ((5, 2, K), None, {"num_tokens": 6}, "hold 5 tokens, the batch has 6"),
        ((6, 2, K), E, {}, r"distinct expert ids in \[0, 8\)"),
    ],
)
def test_wrong_external_routes_are_rejected_by_the_first_layer(
    shape: tuple[int, int, int], bad_id: int | None, kwargs: dict, message: str
) -> None:
    model = TwoLayers()
    replay = RouterReplay()
    replay.bind(model)
    routes = torch.stack([torch.arange(K) + i % (E - K) for i in range(shape[0] * shape[1])])
    routes = (
        routes[:, : shape[2]] if shape[2] <= K else torch.cat([routes, routes[:, :1] + K], dim=1)
    )
    routes = routes.reshape(shape).clone()
    if bad_id is not None:
        routes[2, 1, 0] = bad_id
    calls: list[int] = []
    model.layers[0].experts.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match=message), replay.replay_stacked(routes, **kwargs):
        model(torch.randn(shape[0], H))
    assert calls == []  # raised by the first layer's router, before any expert ran
    assert replay.mode == "off"
