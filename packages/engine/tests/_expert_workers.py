"""Expert-parallel Engine runs on gloo ranks (torch and train_engine only)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from train_engine import DDPConfig, Engine, ExpertShards, FSDP2Config, apply_data_parallel

HIDDEN, EXPERTS = 6, 4


class _GatherExperts(torch.autograd.Function):
    """All-gather along dim 0; backward sums every rank's gradient into the owner's slice."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.rows, ctx.group = local.shape[0], group
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Its own group: DDP's asynchronous bucket all-reduces run on the data-parallel group
        # meanwhile, and two collectives in flight on one gloo group can pair up wrongly.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.rows
        return grad[start : start + ctx.rows], None


class TinyExpertModel(nn.Module):
    """A dense layer plus E experts of which this rank holds E/W (a linear map each).

    Every token goes to every expert (weights from a dense softmax), so each expert's owner
    receives gradients from all ranks' tokens: the gradient flow of an all-to-all dispatcher,
    built from a differentiable all-gather of the expert weights.
    """

    def __init__(
        self,
        world: int,
        rank: int,
        weights: dict[str, torch.Tensor],
        group: dist.ProcessGroup | None = None,
        *,
        blocks: bool = True,
    ) -> None:
        super().__init__()
        per_rank = EXPERTS // world  # world: the ep size, rank: the ep rank
        self.dense = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        if blocks:  # FSDP2 blocks (the same modules under a second name)
            self.layers = nn.ModuleList([self.dense, self.router])
        self.experts = nn.Parameter(weights["experts"][rank * per_rank : (rank + 1) * per_rank])
        self.world = world
        self.group = group
        with torch.no_grad():
            self.dense.weight.copy_(weights["dense"])
            self.router.weight.copy_(weights["router"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.dense(x))
        if self.world > 1:
            experts = _GatherExperts.apply(self.experts, self.group)
        else:
            experts = self.experts
        probs = torch.softmax(self.router(h), dim=-1)  # [T, E]
        outs = torch.einsum("th,eoh->teo", h, experts)  # [T, E, H]
        return (probs.unsqueeze(-1) * outs).sum(1)


def make_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "dense": torch.randn(HIDDEN, HIDDEN, generator=g) * 0.5,
        "router": torch.randn(EXPERTS, HIDDEN, generator=g) * 0.5,
        "experts": torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g) * 0.5,
    }


def make_tokens(seed: int, counts: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, HIDDEN, generator=g) for n in counts]


def _groups(rank: int, world: int, ep: int) -> tuple[Any, Any]:
    """(ep group, replica group): ``ep`` consecutive ranks split the experts; ranks
    ``e, e+ep, ...`` hold the same ones."""
    ep_group = replica_group = None
    for block in range(world // ep):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(block * ep, (block + 1) * ep)))
        if block == rank // ep:
            ep_group = group
    for e in range(ep):
        members = list(range(e, world, ep))
        group = dist.new_group(members) if len(members) > 1 else None
        if rank in members:
            replica_group = group
    return ep_group, replica_group


def _wrapped(
    model: TinyExpertModel, world: int, kind: str, window: int, ep_group: Any, replica_group: Any
) -> nn.Module:
    mesh = init_device_mesh("cpu", (world,))
    shards = ExpertShards(params=(model.experts,), ep_group=ep_group, replica_group=replica_group)
    config = DDPConfig() if kind == "ddp" else FSDP2Config()
    return apply_data_parallel(
        model, mesh=mesh, config=config, gradient_accumulation_steps=window, expert_shards=shards
    )


def _full_params(model: TinyExpertModel, ep: int, ep_group: Any) -> dict[str, torch.Tensor]:
    full = {  # FSDP2 shards the dense parameters (DTensors); DDP replicates them
        name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for name, p in model.named_parameters()
        if name != "experts"
    }
    experts = [torch.empty_like(model.experts) for _ in range(ep)]
    dist.all_gather(experts, model.experts.detach().contiguous(), group=ep_group)
    full["experts"] = torch.cat(experts)
    return {
        k.replace("layers.0", "dense").replace("layers.1", "router"): v for k, v in full.items()
    }


def run(
    rank: int, world: int, kind: str, counts: list[list[int]], seed: int, ep: int | None = None
) -> dict[str, Any]:
    """One SGD step, window len(counts[rank]), token-sum loss, clipping on; returns the update.

    ``ep`` ranks (consecutive) split the experts; ranks ``e, e+ep, ...`` hold the same ones.
    """
    ep = world if ep is None else ep
    ep_group, replica_group = _groups(rank, world, ep)
    model = TinyExpertModel(ep, rank % ep, make_weights(seed), ep_group)
    window = len(counts[rank])
    wrapped = _wrapped(model, world, kind, window, ep_group, replica_group)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1.0)
    engine = Engine(wrapped, optimizer, max_grad_norm=0.05, gradient_accumulation_steps=window)
    all_tokens = [make_tokens(seed + 1 + r, counts[r]) for r in range(world)]
    local = all_tokens[rank]
    num_tokens = engine.global_num_tokens(sum(t.shape[0] for t in local))
    result = None
    for x in local:
        loss = engine(x).pow(2).sum()  # token-sum loss
        engine.backward(loss, num_tokens=num_tokens)
        result = engine.step()
    assert result is not None and result.updated
    return {"params": _full_params(model, ep, ep_group), "norm": float(result.grad_norm)}


def _adam_engine(
    rank: int, world: int, kind: str, seed: int, ep: int, ep_group: Any, replica_group: Any
) -> tuple[TinyExpertModel, Engine]:
    # DDP: no second name for the dense modules (get_state_dict cannot reload a DDP model
    # whose modules are registered twice, with or without experts).
    blocks = kind == "fsdp2"
    model = TinyExpertModel(ep, rank % ep, make_weights(seed), ep_group, blocks=blocks)
    wrapped = _wrapped(model, world, kind, 1, ep_group, replica_group)
    return model, Engine(wrapped, torch.optim.Adam(wrapped.parameters(), lr=0.1))


def _expert_moments(model: TinyExpertModel, engine: Engine, ep: int, ep_group: Any) -> Any:
    """Adam's exp_avg of the experts, gathered over the ep group: [E, H, H]."""
    local = engine.optimizer.state[model.experts]["exp_avg"]
    parts = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(parts, local.contiguous(), group=ep_group)
    return torch.cat(parts)


def save_and_reload(
    rank: int, world: int, kind: str, seed: int, ep: int, directory: str
) -> dict[str, Any]:
    """Two Adam steps, save; a model built from other weights loads it. Returns the saved
    parameters and expert moments, and those of the reloaded model (all gathered)."""
    ep_group, replica_group = _groups(rank, world, ep)
    model, engine = _adam_engine(rank, world, kind, seed, ep, ep_group, replica_group)
    for step in range(2):
        x = make_tokens(seed + 10 * step + rank, [3 + rank])[0]
        engine.backward(engine(x).pow(2).sum(), num_tokens=engine.global_num_tokens(x.shape[0]))
        assert engine.step().updated
    engine.save_checkpoint(directory)
    saved = _full_params(model, ep, ep_group), _expert_moments(model, engine, ep, ep_group)
    fresh_model, fresh = _adam_engine(rank, world, kind, seed + 1, ep, ep_group, replica_group)
    fresh.load_checkpoint(directory)
    loaded = _full_params(fresh_model, ep, ep_group)
    return {
        "saved": saved[0],
        "saved_moments": saved[1],
        "loaded": loaded,
        "loaded_moments": _expert_moments(fresh_model, fresh, ep, ep_group),
    }


def load_in_one_process(directory: str, seed: int, *, blocks: bool) -> dict[str, Any]:
    """The checkpoint loaded without a process group into a model holding every expert."""
    model = TinyExpertModel(1, 0, make_weights(seed), blocks=blocks)
    engine = Engine(model, torch.optim.Adam(model.parameters(), lr=0.1))
    engine.load_checkpoint(directory)
    params = {
        k.replace("layers.0", "dense").replace("layers.1", "router"): p.detach().clone()
        for k, p in model.named_parameters()
    }
    return {"params": params, "moments": engine.optimizer.state[model.experts]["exp_avg"]}


def reference(counts: list[list[int]], seed: int) -> dict[str, Any]:
    """Single process, all experts, float64: the global token-mean loss, clipped SGD step."""
    weights = {k: v.double() for k, v in make_weights(seed).items()}
    model = TinyExpertModel(1, 0, weights).double()
    tokens = [t.double() for r in range(len(counts)) for t in make_tokens(seed + 1 + r, counts[r])]
    total = sum(t.shape[0] for t in tokens)
    loss = sum(model(t).pow(2).sum() for t in tokens) / total
    loss.backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    coef = min(1.0, 0.05 / (float(norm) + 1e-6))
    with torch.no_grad():
        out = {n: (p - coef * p.grad).float() for n, p in model.named_parameters()}
    out = {k.replace("layers.0", "dense").replace("layers.1", "router"): v for k, v in out.items()}
    return {"params": out, "norm": float(norm)}
