"""MoE models in the SFT recipe: conversion to moe-dispatch layers, expert parallelism, export.

A transformers MoE model of a supported family (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3) is
converted after loading: each sparse block becomes an ``ExpertParallelMoE`` with the same
weights. With ``parallel.ep`` > 1 each layer keeps E/ep experts and reaches the others through
an all-to-all (with per-rank token equalization); the experts stay out of FSDP2 or DDP and the
Engine syncs, clips and checkpoints them (``ExpertShards``).

Expert-parallel groups: ``ep`` consecutive data-parallel ranks of the same (cp, tp) coordinate.
The ranks holding the same experts (the replica group) are the other data-parallel blocks and
all cp ranks of that tp coordinate.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from collections.abc import Iterator
    from contextlib import AbstractContextManager

    from moe_dispatch import Dispatcher, RouterOutput
    from train_engine import Engine, ExpertShards
    from train_recipes.config.loader import JSONValue
    from train_recipes.config.sft import MoELossConfig, SFTConfig
    from train_recipes.run.process_group import RankContext

logger = logging.getLogger(__name__)

#: transformers model_type values whose MoE blocks this recipe converts.
SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
#: config.json keys that may hold the number of routed experts (names vary across versions).
_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
#: model_type values of MoE families this recipe cannot convert (ep > 1 is rejected for them).
_OTHER_MOE_MARKERS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_")


@dataclass(kw_only=True, slots=True, frozen=True)
class MoEGroups:
    """This rank's expert-parallel groups.

    Attributes:
        ep: the expert-parallel degree.
        ep_group: the ranks that split the experts among them (None when ep == 1).
        replica_group: the ranks holding the same experts as this one (None when alone).
    """

    ep: int
    ep_group: dist.ProcessGroup | None
    replica_group: dist.ProcessGroup | None


def read_model_type(model_path: str | None) -> tuple[str | None, dict[str, JSONValue]]:
    """The ``model_type`` and the raw config.json of a local HF model (None without a path)."""
    if model_path is None:
        return None, {}
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None, {}
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError):  # the preflight reports an unreadable config.json
        return None, {}
    return (raw.get("model_type"), raw) if isinstance(raw, dict) else (None, {})


def check_moe_config(config: SFTConfig, *, world_size: int) -> None:
    """The MoE part of ``validate_sft``: ep degree, family support, loss coefficients.

    Raises:
        ConfigError: naming the offending key.
    """
    from train_recipes.config.loader import ConfigError

    parallel, moe = config.parallel, config.moe
    ep = parallel.ep
    if ep < 1:
        raise ConfigError("parallel.ep", f"must be >= 1, got {ep}")
    for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
        value = getattr(moe, name)
        if not value >= 0:
            raise ConfigError(f"moe.{name}", f"must be >= 0, got {value}")
    model_type, raw = read_model_type(config.model.path)
    supported = model_type in SUPPORTED_MODEL_TYPES
    uses_moe = ep > 1 or moe.aux_loss_coef > 0 or moe.z_loss_coef > 0
    if supported and config.model.sharded_load:
        # The meta-device load reads each rank's slices by the HF names into the distributed
        # model; a converted model has other names and experts sliced over ep, and conversion
        # itself copies the loaded HF weights.
        raise ConfigError(
            "model.sharded_load",
            f"model_type {model_type!r} is converted to moe-dispatch layers after a full load; "
            "the sharded (meta-device) load does not support MoE models: set "
            "model.sharded_load=false (or leave it unset)",
        )
    if moe.bias_update_rate > 0 and model_type != "deepseek_v3":
        raise ConfigError(
            "moe.bias_update_rate",
            f"aux-loss-free bias balancing needs sigmoid routing (deepseek_v3), got "
            f"model_type {model_type!r}",
        )
    if not uses_moe:
        return
    if not supported:
        looks_moe = any(any(m in k for m in _OTHER_MOE_MARKERS) for k in raw)
        what = f"model_type {model_type!r}" if model_type else "the tiny demo model (dense)"
        raise ConfigError(
            "parallel.ep" if ep > 1 else "moe.aux_loss_coef",
            f"{what} {'is a MoE family without conversion support' if looks_moe else 'has no MoE layers'}; "
            f"parallel.ep and the moe.* losses need one of {sorted(SUPPORTED_MODEL_TYPES)}",
        )
    dp = world_size // (parallel.cp * parallel.tp)
    if ep > 1:
        if dp % ep:
            raise ConfigError(
                "parallel.ep",
                f"ep={ep} does not divide the data-parallel size {dp} (world {world_size} / "
                f"(cp={parallel.cp} * tp={parallel.tp})); pick ep dividing {dp}",
            )
        experts = next((int(cast(int, raw[k])) for k in _EXPERT_COUNT_KEYS if raw.get(k)), 0)
        if experts % ep:
            raise ConfigError(
                "parallel.ep",
                f"ep={ep} does not divide the model's {experts} experts; pick ep dividing {experts}",
            )
    if config.lora.enabled:
        raise ConfigError("lora.enabled", "LoRA is not supported on converted MoE models")


def is_convertible(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers MoE model of a family this recipe converts."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in SUPPORTED_MODEL_TYPES


def build_groups(ctx: RankContext, ep: int) -> MoEGroups:
    """Create the expert-parallel and replica groups (collective: every rank calls it).

    Args:
        ctx: the recipe's RankContext (mesh ("dp", "cp", "tp")).
        ep: the expert-parallel degree.
    """
    if ep == 1:
        return MoEGroups(ep=1, ep_group=None, replica_group=None)
    ranks = ctx.mesh.mesh  # [dp, cp, tp] global ranks
    dp, cp, tp = ranks.shape
    mine_ep: Any = None  # new_group's result: a group here (-100 only for non-members)
    mine_replica: Any = None
    # Every rank creates every group, in the same order (new_group is collective).
    for c in range(cp):
        for t in range(tp):
            for block in range(dp // ep):
                members = ranks[block * ep : (block + 1) * ep, c, t].tolist()
                group = dist.new_group(members)
                if ctx.rank in members:
                    mine_ep = group
    for t in range(tp):
        for e in range(ep):
            members = sorted(ranks[e::ep, :, t].reshape(-1).tolist())
            replicas = dist.new_group(members) if len(members) > 1 else None
            if ctx.rank in members:
                mine_replica = replicas
    return MoEGroups(ep=ep, ep_group=mine_ep, replica_group=mine_replica)


def convert_model(model: nn.Module, groups: MoEGroups) -> ExpertShards | None:
    """Convert the HF sparse blocks in place; returns the ``ExpertShards`` (None when ep == 1).

    The router-logit output of transformers is switched off: the recipe's own
    ``moe.aux_loss_coef`` (scaled under the token-sum contract) replaces transformers' loss.
    """
    from moe_dispatch import AllToAllDispatcher, EqualizingDispatcher, convert_hf_moe
    from train_engine import ExpertShards

    def dispatcher(num_experts: int) -> Dispatcher:
        inner = AllToAllDispatcher(groups.ep_group, num_experts)
        return EqualizingDispatcher(inner, group=groups.ep_group, alignment=1)

    hf_config = getattr(model, "config", None)
    if hf_config is not None and getattr(hf_config, "output_router_logits", False):
        hf_config.output_router_logits = False
    layers = convert_hf_moe(model, dispatcher_factory=dispatcher if groups.ep > 1 else None)
    logger.info("converted %d MoE layers (ep=%d)", len(layers), groups.ep)
    if groups.ep == 1:
        return None
    from moe_dispatch import ExpertParallelMoE

    params: list[nn.Parameter] = []
    for module in model.modules():
        if isinstance(module, ExpertParallelMoE):
            params += [module.experts.gate_up_proj, module.experts.down_proj]
    return ExpertShards(
        params=tuple(params), ep_group=groups.ep_group, replica_group=groups.replica_group
    )


def convert_for_export(model: nn.Module) -> bool:
    """Convert a supported MoE model in one process (ep=1) so an SFT checkpoint loads into it.

    Checkpoints hold the converted layers' names; their experts, saved as shards over any ep
    degree, load whole (the distributed checkpoint reshards them). Returns whether it converted.
    """
    if not is_convertible(model):
        return False
    convert_model(model, MoEGroups(ep=1, ep_group=None, replica_group=None))
    return True


def to_hf_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The export state dict in the HF layout (collective over ep; a no-op for other models)."""
    from train_recipes.model.build import unwrap

    inner = unwrap(model)
    try:
        from moe_dispatch import ExpertParallelMoE, hf_state_dict
    except ImportError:  # moe-dispatch absent: nothing can be converted
        return state
    if not any(isinstance(m, ExpertParallelMoE) for m in inner.modules()):
        return state
    full = hf_state_dict(inner, state)
    return full if state else {}


def prepare(model: nn.Module, ctx: RankContext, config: SFTConfig) -> ExpertShards | None:
    """Convert a supported MoE model for training (every rank calls it); ExpertShards or None.

    Dense models, and MoE families without conversion (only with ep == 1, which
    ``check_moe_config`` ensures), are left unchanged.
    """
    if not is_convertible(model):
        return None
    groups = build_groups(ctx, config.parallel.ep)
    return convert_model(model, groups)


class RouterLosses:
    """The MoE router losses and routing metrics of the SFT loop (one object per run).

    Per micro-batch, :meth:`collect` records every MoE layer's routing during the forward and
    :meth:`term` returns what to add to that micro-batch's token-sum loss. The Engine scales a
    token-sum loss by G/N (G the gradient-averaging ranks, N the window's global loss tokens)
    and the wrapper averages over G ranks, so adding
    ``coef * loss_mb * N / (G * window)`` makes the gradient that of
    ``coef * (mean over ranks and micro-batches of loss_mb)``, whatever the accumulation,
    where ``loss_mb`` is the layer mean of the Switch load-balancing loss (or the z-loss).

    Args:
        model: the converted model (possibly wrapped).
        moe: the config's ``moe`` section: the load-balancing and z-loss weights, and the rate
            of :meth:`after_step`'s score-correction bias update.
        grad_ranks: G, the Engine's ``grad_average_size``.
        window: micro-batches per optimizer step.
        duplicates: ranks holding the same tokens (tp); the metrics sum over all ranks and
            divide by it.
    """

    def __init__(
        self,
        model: nn.Module,
        moe: MoELossConfig,
        *,
        grad_ranks: int | float,
        window: int,
        duplicates: int = 1,
    ) -> None:
        from moe_dispatch import ExpertParallelMoE

        self.layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
        self.model = model
        self.moe = moe
        self.grad_ranks = grad_ranks
        self.window = window
        self.duplicates = duplicates
        self._routing: list[RouterOutput] = []
        num_experts = self.layers[0].config.num_experts if self.layers else 0
        # [L, E] routed (token, expert) pairs and [2] (expected pairs, routed pairs) since the
        # last metrics read.
        self._load = torch.zeros(len(self.layers), num_experts, dtype=torch.float64)
        self._pairs = torch.zeros(2, dtype=torch.float64)
        self._window_load = torch.zeros_like(self._load)  # since the last after_step()

    @property
    def active(self) -> bool:
        """Whether the model has converted MoE layers."""
        return bool(self.layers)

    def collect(self) -> AbstractContextManager[None]:
        """Context manager around one micro-batch's forward."""
        import contextlib

        if not self.active:
            return contextlib.nullcontext()
        from moe_dispatch import collect_routing

        @contextlib.contextmanager
        def _collect() -> Iterator[None]:
            with collect_routing(self.model) as routing:
                yield
            self._routing = list(routing)

        return _collect()

    def term(self, num_tokens: torch.Tensor | float) -> torch.Tensor | float:
        """What to add to this micro-batch's token-sum loss (0.0 without losses or MoE)."""
        from moe_dispatch import expert_load, load_balancing_loss, router_z_loss

        routing, self._routing = self._routing, []
        if not routing:
            return 0.0
        with torch.no_grad():
            for i, r in enumerate(routing[: len(self.layers)]):
                load = expert_load(r.topk_ids, self._load.shape[1]).double().cpu()
                self._load[i] += load
                self._window_load[i] += load
            real = sum(int((r.topk_ids >= 0).sum()) for r in routing)
            self._pairs += torch.tensor(
                [float(sum(r.topk_ids.numel() for r in routing)), float(real)]
            )
        aux_coef, z_coef = self.moe.aux_loss_coef, self.moe.z_loss_coef
        if aux_coef == 0 and z_coef == 0:
            return 0.0
        total: torch.Tensor | float = 0.0
        if aux_coef:
            aux = sum(load_balancing_loss(r.probs, r.topk_ids) for r in routing) / len(routing)
            total = total + aux_coef * aux
        if z_coef:
            z = sum(router_z_loss(r.logits, r.topk_ids) for r in routing) / len(routing)
            total = total + z_coef * z
        assert isinstance(total, torch.Tensor)
        scale = num_tokens / (self.grad_ranks * self.window)
        if isinstance(scale, torch.Tensor):
            scale = scale.to(total.device, total.dtype)
        return total * scale

    def after_step(self, device: torch.device) -> None:
        """After the optimizer step: DeepSeek-V3's bias update from the window's global loads.

        Collective when the rate is set: every rank calls it, and all apply the same update.
        """
        load, self._window_load = self._window_load, torch.zeros_like(self._window_load)
        if not self.active or self.moe.bias_update_rate == 0:
            return
        from moe_dispatch import update_score_correction_bias

        load = load.to(device)
        if dist.is_initialized():
            dist.all_reduce(load)
        for layer, layer_load in zip(self.layers, load.cpu(), strict=True):
            if layer.router.score_correction_bias is not None:
                update_score_correction_bias(
                    layer.router, layer_load, rate=self.moe.bias_update_rate
                )

    def metrics(self, device: torch.device) -> dict[str, float]:
        """Tokens per expert (min, max, coefficient of variation) and dropped tokens.

        Counted since the last call, summed over all ranks (collective: every rank calls it).
        """
        if not self.active:
            return {}
        packed = torch.cat([self._load.reshape(-1), self._pairs]).to(device)
        if dist.is_initialized():
            dist.all_reduce(packed)
        packed = packed.cpu() / self.duplicates
        load = packed[: self._load.numel()].reshape(self._load.shape)
        expected, routed = packed[-2:].tolist()
        self._load.zero_()
        self._pairs.zero_()
        mean = load.mean(dim=1).clamp(min=1e-12)
        cv = (load.std(dim=1, unbiased=False) / mean).mean()
        return {
            "moe/tokens_per_expert_min": float(load.min()),
            "moe/tokens_per_expert_max": float(load.max()),
            "moe/tokens_per_expert_cv": float(cv),
            # The dispatch is dropless: a routed slot is only missing for padding rows (-1).
            "moe/dropped_tokens": expected - routed,
        }


def router_losses(
    model: nn.Module, engine: Engine, config: SFTConfig, ctx: RankContext
) -> RouterLosses:
    """The run's :class:`RouterLosses` (inactive for models without converted MoE layers)."""
    return RouterLosses(
        model,
        config.moe,
        grad_ranks=engine.grad_average_size,
        window=config.train.gradient_accumulation_steps,
        duplicates=ctx.tp_size,
    )
