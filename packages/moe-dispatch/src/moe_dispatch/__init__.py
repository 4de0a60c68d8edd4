"""Expert-parallel MoE token dispatch (all-to-all, HybridEP) with per-rank token equalization and router replay."""

from importlib.metadata import version as _version

from moe_dispatch.all_to_all import AllToAllDispatcher, all_to_all_rows
from moe_dispatch.aux_losses import collect_routing, router_z_loss
from moe_dispatch.dispatcher import Dispatcher, LocalDispatcher
from moe_dispatch.equalize import (
    HYBRID_EP_ALIGNMENT,
    EqualizedTokens,
    EqualizingDispatcher,
    equalize_token_counts,
    padded_token_count,
)
from moe_dispatch.hf import (
    SUPPORTED_BLOCKS,
    SUPPORTED_MODEL_TYPES,
    convert_hf_moe,
    from_hf_moe_block,
    hf_state_dict,
)
from moe_dispatch.hybrid_ep import HybridEPDispatcher
from moe_dispatch.moe import ExpertParallelMoE, GroupedExperts, MoEConfig
from moe_dispatch.router import RouterOutput, TopKRouter, update_score_correction_bias
from moe_dispatch.router_replay import (
    RouterReplay,
    stack_routes,
    unstack_routes,
    validate_routes,
)
from moe_dispatch.routing import NO_EXPERT, expert_load, expert_range, load_balancing_loss

__version__ = _version("moe-dispatch")

__all__ = [
    "HYBRID_EP_ALIGNMENT",
    "NO_EXPERT",
    "SUPPORTED_BLOCKS",
    "SUPPORTED_MODEL_TYPES",
    "AllToAllDispatcher",
    "Dispatcher",
    "EqualizedTokens",
    "EqualizingDispatcher",
    "ExpertParallelMoE",
    "GroupedExperts",
    "HybridEPDispatcher",
    "LocalDispatcher",
    "MoEConfig",
    "RouterOutput",
    "RouterReplay",
    "TopKRouter",
    "__version__",
    "all_to_all_rows",
    "collect_routing",
    "convert_hf_moe",
    "equalize_token_counts",
    "expert_load",
    "expert_range",
    "from_hf_moe_block",
    "hf_state_dict",
    "load_balancing_loss",
    "padded_token_count",
    "router_z_loss",
    "stack_routes",
    "unstack_routes",
    "update_score_correction_bias",
    "validate_routes",
]
