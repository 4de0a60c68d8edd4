"""Expert-parallel MoE token dispatch (all-to-all, HybridEP) with per-rank token equalization and router replay."""

from importlib.metadata import version as _version

from moe_dispatch.all_to_all import AllToAllDispatcher, all_to_all_rows
from moe_dispatch.dispatcher import Dispatcher, LocalDispatcher
from moe_dispatch.equalize import (
    HYBRID_EP_ALIGNMENT,
    EqualizedTokens,
    EqualizingDispatcher,
    equalize_token_counts,
    padded_token_count,
)
from moe_dispatch.hybrid_ep import HybridEPDispatcher
from moe_dispatch.moe import (
    ExpertParallelMoE,
    GroupedExperts,
    MoEConfig,
    RouterOutput,
    TopKRouter,
    convert_hf_moe,
    from_hf_moe_block,
)
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
    "convert_hf_moe",
    "equalize_token_counts",
    "expert_load",
    "expert_range",
    "from_hf_moe_block",
    "load_balancing_loss",
    "padded_token_count",
    "stack_routes",
    "unstack_routes",
    "validate_routes",
]
