"""The wrapper's side of a window: when gradients sync, over which ranks, and their norm.

DDP and FSDP2 reduce gradients inside backward; the Engine decides, before each micro-batch's
forward, whether this backward reduces (only the window's last, with deferred sync). What the
data-parallel ranks are, and how the window's gradient norm is taken (expert-parallel
gradients are synced by the norm itself), also depends on the wrapper alone: this module keeps
that apart from the window's arithmetic.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from train_engine._topology import Topology
from train_engine.expert_parallel import grad_norm as expert_grad_norm
from train_engine.grad_norm import global_grad_norm

__all__ = ["GradSync"]


class GradSync:
    """Switches the wrapper's gradient reduction on and off, and measures the window's norm.

    Args:
        model: the wrapped model (DDP, FSDP2 or a plain module).
        topology: what wraps it (:func:`~train_engine._topology.detect_topology`).
        dp_group: the data-parallel ranks that count tokens: a group, a mesh (one group per
            dimension, summed in turn) or None (the wrapper's averaging groups).
    """

    def __init__(
        self,
        model: nn.Module,
        topology: Topology,
        dp_group: dist.ProcessGroup | DeviceMesh | None,
    ) -> None:
        self._model = model
        self._topology = topology
        self._state: bool | None = None
        if dp_group is None:
            self.dp_groups = topology.dp_groups
        elif isinstance(dp_group, DeviceMesh):
            self.dp_groups = tuple(dp_group.get_group(d) for d in range(dp_group.ndim))
        else:
            self.dp_groups = (dp_group,)

    def set(self, sync: bool) -> None:
        """Make the next backward reduce gradients (``sync``) or keep them local."""
        if sync == self._state:
            return
        kind = self._topology.kind
        if kind == "ddp":
            # DDP decides in forward whether the following backward reduces (what no_sync()
            # toggles), so this must be set before the forward.
            setattr(self._model, "require_backward_grad_sync", sync)  # noqa: B010
        elif kind == "fsdp2":
            for module in self._topology.fsdp_modules:
                module.set_requires_gradient_sync(sync, recurse=False)  # type: ignore[operator]
        self._state = sync

    def grad_norm(self, params: list[nn.Parameter], norm_type: float) -> Tensor:
        """The window's global gradient norm; expert-parallel gradients are synced here first."""
        experts = self._topology.experts
        if experts is None:
            return global_grad_norm(params, norm_type)
        return expert_grad_norm(params, experts, norm_type, self._topology.grad_average_size)
