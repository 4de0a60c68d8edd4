"""Router replay on one process: replayed ids, live weights, checkpoint recompute, validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_dispatch import (
    ExpertParallelMoE,
    MoEConfig,
    RouterReplay,
    stack_routes,
    unstack_routes,
    validate_routes,
)

E, K, H = 8, 2, 12


class TwoLayers(nn.Module):
    def __init__(self, first_layer_id: int = 0, *, use_checkpoint: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            ExpertParallelMoE(
                MoEConfig(
                    hidden_size=H,
                    intermediate_size=10,
                    num_experts=E,
                    top_k=K,
                    layer_id=first_layer_id + i,
                )
            )
            for i in range(2)
        )
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.use_checkpoint:
                x = x + checkpoint(layer, x, use_reentrant=False)
            else:
                x = x + layer(x)
        return x


def _model(seed: int = 0, **kwargs: bool) -> TwoLayers:
    torch.manual_seed(seed)
    return TwoLayers(**kwargs)


def _perturb_routers(model: TwoLayers) -> None:
    with torch.no_grad():
        for layer in model.layers:
            layer.router.weight.add_(torch.randn_like(layer.router.weight) * 2.0)


def _live_ids(model: TwoLayers, x: torch.Tensor) -> list[torch.Tensor]:
    ids = []
    with torch.no_grad():
        for layer in model.layers:
            _, routing = layer.forward_with_routing(x)
            ids.append(routing.topk_ids)
            x = x + layer(x)
    return ids


def test_replay_selects_recorded_experts_after_router_changes() -> None:
    model = _model()
    replay = RouterReplay()
    assert replay.bind(model) == [0, 1]
    x = torch.randn(20, H)
    with replay.record():
        model(x)
    routes = replay.routes
    assert sorted(routes) == [0, 1] and routes[0].shape == (20, K)
    _perturb_routers(model)
    live = _live_ids(model, x)
    assert not torch.equal(live[0], routes[0]), "perturbation too small to change routing"
    seen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(
            lambda m, args, out, i=i: seen.__setitem__(i, m.router(args[0]).topk_ids)
        )
    with replay.replay(routes):
        model(x)
    for i in range(2):
        assert torch.equal(seen[i], routes[i]), f"layer {i} did not replay its recorded experts"


def test_replay_weights_come_from_live_scores_and_reach_the_router() -> None:
    model = _model(1)
    replay = RouterReplay()
    replay.bind(model)
    layer = model.layers[0]
    x = torch.randn(16, H)
    with replay.record():
        layer(x)
    routes = replay.routes
    _perturb_routers(model)
    with replay.replay(routes, strict=False):
        out = layer(x)
        out.sum().backward()
    grad = layer.router.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    # float64 reference with the recorded ids fixed: weights gathered from the live softmax.
    w = layer.router.weight.detach().double().requires_grad_()
    probs = torch.softmax(x.double() @ w.t(), -1)
    weights = probs.gather(1, routes[0])
    weights = weights / weights.sum(-1, keepdim=True)
    gate_up = layer.experts.gate_up_proj.detach().double()
    down = layer.experts.down_proj.detach().double()
    ref = torch.zeros(16, H, dtype=torch.float64)
    for k in range(K):
        e = routes[0][:, k]
        gate, up = torch.einsum("th,tfh->tf", x.double(), gate_up[e]).chunk(2, -1)
        ref = ref + weights[:, k : k + 1] * torch.einsum("tf,thf->th", F.silu(gate) * up, down[e])
    ref.sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    assert w.grad is not None
    torch.testing.assert_close(grad.double(), w.grad, rtol=1e-4, atol=1e-5)


def test_checkpoint_recomputation_replays_recorded_ids() -> None:
    x = torch.randn(24, H)
    plain, ckpt = _model(2), _model(2, use_checkpoint=True)
    replay_plain, replay_ckpt = RouterReplay(), RouterReplay()
    replay_plain.bind(plain)
    replay_ckpt.bind(ckpt)
    with replay_plain.record():
        plain(x)
    routes = replay_plain.routes
    # New router weights: live routing now differs, so a recompute that routed live would give
    # different activations and gradients than the replayed forward.
    _perturb_routers(plain)
    ckpt.load_state_dict(plain.state_dict())
    assert not torch.equal(_live_ids(plain, x)[0], routes[0])
    calls: list[int] = []
    original = replay_ckpt.select

    def counting_select(layer_id: int | None, scores: torch.Tensor, top_k: int) -> torch.Tensor:
        calls.append(-1 if layer_id is None else layer_id)
        return original(layer_id, scores, top_k)

    replay_ckpt.select = counting_select  # type: ignore[method-assign]
    grads = []
    for model, replay in ((plain, replay_plain), (ckpt, replay_ckpt)):
        xi = x.clone().requires_grad_()
        with replay.replay(routes):
            model(xi).pow(2).sum().backward()
        grads.append([xi.grad, *(p.grad for p in model.parameters())])
    assert sorted(calls) == [0, 0, 1, 1], f"expected a forward and a recompute per layer: {calls}"
    for a, b in zip(grads[0], grads[1], strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_record_mode_recompute_reuses_the_first_forward() -> None:
    model = _model(3, use_checkpoint=True)
    replay = RouterReplay()
    replay.bind(model)
    x = torch.randn(10, H, requires_grad=True)
    with replay.record():
        out = model(x)
        first = replay.routes
        _perturb_routers(model)  # recompute would now pick other experts if it routed live
        out.sum().backward()
        after = replay.routes
    for i in range(2):
        assert torch.equal(first[i], after[i])
    # A second forward inside one record context would silently reuse stale ids: it raises.
    with replay.record():
        model(x)
        with pytest.raises(RuntimeError, match="already recorded"):
            model(x)


def test_minus_one_rows_route_live_and_sharded_routes_replay() -> None:
    model = _model(4)
    replay = RouterReplay()
    replay.bind(model)
    x = torch.randn(12, H)
    with replay.record():
        model(x)
    stacked = stack_routes(replay.routes, [0, 1])
    assert stacked.shape == (12, 2, K)
    _perturb_routers(model)
    live = _live_ids(model, x)
    stacked[8:] = -1  # e.g. padding or unrecorded tokens
    layer0 = model.layers[0]
    with replay.replay(unstack_routes(stacked, [0, 1])):
        ids = layer0.forward_with_routing(x)[1].topk_ids
    assert torch.equal(ids[:8], stacked[:8, 0])
    assert torch.equal(ids[8:], live[0][8:])
    # A context-parallel shard needs its own slice of the routes; the full table is rejected.
    with (
        pytest.raises(ValueError, match="expected"),
        replay.replay(unstack_routes(stacked, [0, 1])),
    ):
        layer0(x[4:10])
    shard_routes = unstack_routes(stacked[4:10], [0, 1])
    with replay.replay(shard_routes):
        shard = layer0.forward_with_routing(x[4:10])[1].topk_ids
    assert torch.equal(shard[:4], stacked[4:8, 0])
    assert torch.equal(shard[4:], live[0][8:10])


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        (torch.tensor([[0, 8]]), "distinct expert ids in"),
        (torch.tensor([[3, 3]]), "distinct expert ids in"),
        (torch.tensor([[2, -1]]), "all -1"),
        (torch.tensor([[0, 1, 2]]), "expected"),
        (torch.tensor([[0.0, 1.0]]), "integer"),
    ],
)
def test_invalid_recordings_are_rejected(routes: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_routes(routes, num_tokens=1, num_experts=E, top_k=K)
    model = _model(5)
    replay = RouterReplay()
    replay.bind(model)
    with pytest.raises(ValueError, match=message), replay.replay({0: routes, 1: routes}):
        model(torch.randn(1, H))
    assert replay.mode == "off", "state not restored after the error"


def test_missing_layers_nesting_and_binding_errors() -> None:
    model = _model(6)
    replay = RouterReplay()
    replay.bind(model)
    with (
        pytest.raises(KeyError, match="no recorded routes for layer 1"),
        replay.replay({0: torch.zeros(3, K, dtype=torch.long) + torch.tensor([0, 1])}),
    ):
        model(torch.randn(3, H))
    with replay.replay({}, strict=False):
        model(torch.randn(3, H))  # every layer routes live
    with replay.record(), pytest.raises(RuntimeError, match="do not nest"), replay.replay({}):
        pass
    assert replay.mode == "off"
    with pytest.raises(ValueError, match="share layer_id 0"):
        RouterReplay().bind(_model(7), _model(8))
    # Pipeline parts with distinct global ids bind together; a part without routers is fine.
    assert RouterReplay().bind(_model(7), TwoLayers(first_layer_id=2), nn.Linear(2, 2)) == [
        0,
        1,
        2,
        3,
    ]
    unnamed = ExpertParallelMoE(
        MoEConfig(hidden_size=H, intermediate_size=4, num_experts=E, top_k=K)
    )
    with pytest.raises(ValueError, match="has no layer_id"):
        RouterReplay().bind(unnamed)
