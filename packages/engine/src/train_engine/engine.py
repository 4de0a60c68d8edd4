"""The training Engine: from the loss's backward to one update per accumulation window.

Backward with exact accumulation scaling, deferred gradient sync, sharding-aware clipping, a
non-finite policy and one optimizer/scheduler update per window. The jobs live in private
modules: the window's state machine (``_window``), the update at its boundary (``_update``),
the counters (``_counters``), the wrapper's gradient sync (``_grad_sync``), the save and
restore (``_engine_state``); this module is the public facade that ties them together.

The caller owns the forward's inputs and the loss; the Engine owns everything from the loss's
backward to cleared gradients. It wraps an already-distributed model (plain module, DDP, or
FSDP2 with optional tensor-parallel DTensor parameters); see :mod:`train_engine.setup`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from train_engine._counters import UpdateCounters
from train_engine._device_update import flag_on_param_device, supports_device_update
from train_engine._engine_state import EngineState
from train_engine._grad_sync import GradSync
from train_engine._step_result import StepResult
from train_engine._tokens import host_num_tokens, sum_over_groups
from train_engine._topology import detect_topology
from train_engine._update import (
    NonFiniteGradientError,
    NonFinitePolicy,
    UpdateRule,
    empty_window,
    result_without_update,
)
from train_engine._validation import check_engine_arguments, check_loss, check_optimizer_params
from train_engine._wide_grads import WideGradSums
from train_engine._window import AccumulationWindow

__all__ = ["Engine", "NonFiniteGradientError", "StepResult"]

logger = logging.getLogger(__name__)  # skip warnings: train_engine._counters, same name


class Engine(EngineState):
    """Backward, gradient synchronisation, clipping and the update, for one accumulation window.

    Example::

        engine = Engine(model, optimizer, scheduler, max_grad_norm=1.0, gradient_accumulation_steps=4)
        for batch in loader:
            out = engine(**batch)
            engine.backward(loss_fn(out, batch))
            result = engine.step()          # updates on every 4th call

    Args:
        model: a plain module, a ``DistributedDataParallel`` wrapper, or a module on which
            ``fully_shard`` was applied (FSDP2, possibly with DTensor TP parameters).
        optimizer: the optimizer over the model's parameters (the sharded ones under FSDP2).
        lr_scheduler: stepped once after every optimizer update; None for none.
        max_grad_norm: clip the global gradient norm to this value; None disables clipping
            (the norm is still computed and reported).
        norm_type: p of the gradient p-norm (``float("inf")`` allowed).
        gradient_accumulation_steps: micro-batches per optimizer update (the window).
        defer_grad_sync: reduce gradients only in the window's last backward (DDP
            ``no_sync``, FSDP2 ``set_requires_gradient_sync``): less communication, and, for
            FSDP2, unsharded gradients kept during the window (more memory).
        nonfinite: what to do when the global gradient norm is inf/NaN, decided identically on
            every rank: "skip" the update (gradients cleared, scheduler not stepped), "raise"
            :class:`NonFiniteGradientError`, or "step" anyway (no host synchronisation).
        dp_group: the data-parallel ranks over which :meth:`global_num_tokens` sums; a process
            group or a (possibly multi-dimensional) mesh. None uses the wrapper's gradient
            averaging group. Pass it when that group also spans context-parallel ranks that
            count the same tokens.
        grad_accumulation_dtype: for a model without a data-parallel wrapper, the dtype in
            which a window's bf16/fp16 gradients are summed, then rounded once to the
            parameter's dtype at the boundary (its bytes per such parameter of memory). None
            keeps autograd's accumulation in the parameter's dtype. Not read under DDP/FSDP2.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any = None,
        *,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        gradient_accumulation_steps: int = 1,
        defer_grad_sync: bool = True,
        nonfinite: NonFinitePolicy = "skip",
        dp_group: dist.ProcessGroup | DeviceMesh | None = None,
        grad_accumulation_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        check_engine_arguments(model, optimizer, max_grad_norm, nonfinite)
        self.module = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.max_grad_norm = max_grad_norm
        self.norm_type = float(norm_type)
        self.defer_grad_sync = defer_grad_sync
        self.nonfinite: NonFinitePolicy = nonfinite
        check_optimizer_params(model, optimizer)
        self._topology = detect_topology(model)
        self._sync = GradSync(model, self._topology, dp_group)
        self._params = [p for p in model.parameters() if p.requires_grad]
        local = self._topology.kind == "local"
        self._wide_grads = WideGradSums(self._params if local else (), grad_accumulation_dtype)
        self._param_device_types = frozenset(p.device.type for p in self._params)
        self._window = AccumulationWindow(1)
        self.set_gradient_accumulation_steps(gradient_accumulation_steps)
        self._counters = UpdateCounters()  # saved in state_dict, but the run of skips
        self._broken: str | None = None
        self._last_norm: Tensor | None = None

    # ----------------------------------------------------------------- properties and queries

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer update."""
        return self._window.length

    @property
    def optimizer_steps(self) -> int:
        """Optimizer updates done so far (skipped windows not counted)."""
        self._counters.settle()
        return self._counters.optimizer_steps

    @property
    def skipped_steps(self) -> int:
        """Windows whose update was skipped (non-finite gradients, or no loss tokens)."""
        self._counters.settle()
        return self._counters.skipped_steps

    @property
    def consecutive_skipped_steps(self) -> int:
        """Windows skipped in a row since the last real update (0 after an update).

        Like :attr:`skipped_steps` it reads the last device-decided skip flag (with a fused
        optimizer), which waits only for the gradient norm of the last window, not for the
        update. A loop that aborts after N skips in a row reads it after each boundary
        ``step()`` (or each boundary :class:`StepResult`'s, which reads it one step late
        without waiting). Not saved in :meth:`state_dict`: it restarts at 0 after a resume.
        """
        self._counters.settle()
        return self._counters.consecutive_skipped

    @property
    def micro_step(self) -> int:
        """Index of the current micro-batch in its window (0 .. window-1)."""
        return self._window.micro_step

    @property
    def grad_average_size(self) -> int | float:
        """The factor by which the wrapper averages gradients (1 for a plain module)."""
        return self._topology.grad_average_size

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last of its window (its step() updates)."""
        return self._window.is_boundary()

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last window; None before the first.

        This reads the value to the host (one synchronisation).
        """
        return None if self._last_norm is None else float(self._last_norm.item())

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(
                f"the Engine is unusable after a failed backward ({self._broken}); gradients and "
                "the wrapper's reduction state are undefined. Rebuild the model, optimizer and "
                "Engine and resume from the last checkpoint"
            )

    # ----------------------------------------------------------------------------- windows

    def set_gradient_accumulation_steps(self, n: int) -> None:
        """Set the window length; allowed only between windows (e.g. for a shorter last one)."""
        self._window.set_length(n, static_graph=bool(getattr(self.module, "static_graph", False)))

    def _set_grad_sync(self) -> None:
        self._sync.set((not self.defer_grad_sync) or self.is_gradient_accumulation_boundary())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward (see :meth:`forward`)."""
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward with the gradient-sync mode of the current micro-batch.

        Under DDP the forward must go through the Engine: DDP decides in forward whether the
        following backward all-reduces.
        """
        self._check_usable()
        self._set_grad_sync()
        if torch.is_grad_enabled():
            self._window.forward_done = True
        return self.module(*args, **kwargs)

    def global_num_tokens(self, local_count: int | float | Tensor) -> Tensor:
        """Sum a per-rank count of loss tokens over the data-parallel ranks.

        Args:
            local_count: this rank's number (or total weight) of loss tokens in the whole
                window, a Python number or a 0-dim tensor.

        Returns:
            0-dim tensor, identical on every data-parallel rank (int64 for integer counts,
            float64 otherwise), on the device of the data-parallel backend. No host sync.
        """
        return sum_over_groups(local_count, self._sync.dp_groups)

    # ---------------------------------------------------------------------------- backward

    def backward(self, loss: Tensor, *, num_tokens: int | float | Tensor | None = None) -> None:
        """Backpropagate one micro-batch's loss, scaled for the window.

        Two contracts:

        (a) ``num_tokens=None``: ``loss`` is this micro-batch's mean loss; it is divided by the
            window length, so the update follows the mean of the micro-batch means
            (DeepSpeed's semantics).
        (b) ``num_tokens`` given: ``loss`` is the *sum* of this micro-batch's per-token losses
            and ``num_tokens`` the number of loss tokens in the whole window over all
            data-parallel ranks (:meth:`global_num_tokens`). The gradient becomes exactly that
            of (sum of all token losses) / num_tokens: the scale includes the wrapper's
            averaging factor, so it does not depend on how the global batch is split over
            ranks and micro-batches. A window with zero tokens gives zero gradients (the
            backward still runs, so every rank joins the reduction) and its update is skipped
            under every ``nonfinite`` policy (counted in :attr:`skipped_steps`; the scheduler
            does not advance), so weight decay does not move the weights on a step that
            learned nothing.

        Exactly one backward per micro-batch: call :meth:`step` after each (off the boundary
        it only advances the micro-batch), so a window never takes more backwards than its
        length.

        Args:
            loss: 0-dim tensor attached to the graph.
            num_tokens: see (b); the same value for every micro-batch of a window. A Python
                number or CPU tensor is checked at once (finite, >= 0, unchanged in the
                window); a count on an accelerator is checked on the device, without a host
                sync: an invalid one makes the window's gradient NaN, so the non-finite
                policy skips the update (or raises).

        Raises:
            RuntimeError: a second backward() in the same micro-batch (it would count the
                micro-batch twice).
            TypeError: ``loss`` is not a tensor, or ``num_tokens`` is a bool.
            ValueError: a non-scalar loss, a loss with no autograd graph (detached, or a leaf
                that does not depend on the model), mixed contracts, or a ``num_tokens`` that
                is nan, inf, negative or changed within the window.
        """
        self._check_usable()
        window = self._window
        window.check_first_backward()
        check_loss(loss)
        contract = window.check_contract(num_tokens)
        host_tokens = None if num_tokens is None else host_num_tokens(num_tokens)
        window.check_count(host_tokens)
        window.check_forward_seen(required=self._topology.kind == "ddp" and self.defer_grad_sync)
        scaled = window.scale(
            loss, num_tokens, host_tokens, grad_average_size=self._topology.grad_average_size
        )
        self._set_grad_sync()
        try:
            scaled.backward()
        except BaseException as err:
            self._broken = f"{type(err).__name__}: {err}"
            raise
        if window.length > 1:
            self._wide_grads.fold()
        window.record_backward(contract, num_tokens, host_tokens)

    # -------------------------------------------------------------------------------- step

    def _end_window(self) -> None:
        self._clear_grads()
        self._window.reset()
        self._counters.windows += 1

    def step(self) -> StepResult:
        """End the micro-batch; at the window's boundary clip and update.

        Off the boundary it only advances the micro-batch counter. At the boundary it computes
        the global gradient norm, applies the non-finite policy, skips a window without loss
        tokens (contract (b) with ``num_tokens`` 0), clips, steps the optimizer and the
        scheduler once, and clears the gradients.

        Raises:
            RuntimeError: no :meth:`backward` since the previous step().
            NonFiniteGradientError: ``nonfinite="raise"`` and the norm is not finite.
        """
        self._check_usable()
        counters = self._counters
        if not self._window.end_micro_batch():
            return result_without_update(self.optimizer, counters)
        # The previous update's skip flag is long computed: reading it now does not stall.
        counters.settle()
        self._wide_grads.write_back()
        # Host-only (is None tests): after the window's gradient reduction, every wrapper
        # (DDP, FSDP2) has set the gradients of the parameters the loss reached.
        if not any(p.grad is not None for p in self._params):
            self._clear_grads()
            self._window.reset()
            raise RuntimeError(
                f"no trainable parameter of the model received a gradient in accumulation "
                f"window {counters.windows + 1}: the losses passed to backward() are not "
                "connected to the model (computed from another module or tensor). Compute the "
                "loss from engine(...)'s output; the window was discarded"
            )
        norm = self._sync.grad_norm(self._params, self.norm_type)
        self._last_norm = norm
        rule = UpdateRule(
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            max_grad_norm=self.max_grad_norm,
            nonfinite=self.nonfinite,
        )
        on_device = supports_device_update(self.optimizer) and flag_on_param_device(
            self._param_device_types
        )
        return rule.apply(
            norm,
            self._params,
            empty=empty_window(self._window.num_tokens),
            on_device=on_device,
            counters=counters,
            end_window=self._end_window,
        )

    def zero_grad(self) -> None:
        """Clear all gradients (to None). Mid-window, this discards the window and starts anew.

        Raises:
            RuntimeError: mid-window under FSDP2 with deferred sync, where the window's
                unsharded gradients live inside FSDP2 (not in ``param.grad``) until the last
                backward and cannot be discarded.
        """
        window = self._window
        if window.mid_window and self._topology.kind == "fsdp2" and self.defer_grad_sync:
            raise RuntimeError(
                f"zero_grad() in the middle of a window (micro-batch {window.micro_step + 1} of "
                f"{window.length}) is not supported for FSDP2 with deferred gradient sync: FSDP2 "
                "holds the window's unsharded gradients internally until the last backward. "
                "Finish the window, or build the Engine with defer_grad_sync=False"
            )
        if window.mid_window:
            logger.warning(
                "zero_grad() in the middle of a window (micro-batch %d of %d): the window's "
                "gradients are discarded and a new window starts",
                window.micro_step + 1,
                window.length,
            )
        self._clear_grads()
        window.reset()

    def _clear_grads(self) -> None:
        self._wide_grads.clear()
        self.module.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
