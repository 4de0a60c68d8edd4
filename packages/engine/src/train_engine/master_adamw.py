"""AdamW over low-precision (bf16/fp16) parameters with fp32 master weights, in one kernel.

Mixed precision the usual way (FSDP2's ``param_dtype``, or autocast) keeps fp32 parameters and
casts a low-precision copy for every forward; on one GPU FSDP2 still copies the parameters in
and the gradients out each step. :class:`MasterWeightAdamW` turns that around: the model holds
its bf16 parameters, the optimizer holds the fp32 master weights next to the moments, and one
update reads the bf16 gradient and writes the fp32 master, both moments and the rounded bf16
parameter. The numbers are those of fp32-master mixed precision: the same fp32 update as
``torch.optim.AdamW`` on the master weights, the parameter rounded from it to nearest.

Without master weights, AdamW on bf16 parameters loses most small updates: an update below
half a unit in the last place of bf16 (``2**-9`` of the weight) rounds away, and at a
fine-tuning learning rate of 2e-5 most do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor

from train_engine._master_adamw_tables import Bucket, BucketKey, bucket_tables, local_tensor

__all__ = ["MasterWeightAdamW"]

logger = logging.getLogger(__name__)

Backend = Literal["auto", "triton", "torch"]
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_SUPPORTED = (torch.float32, *_LOW_PRECISION)


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW that keeps fp32 master weights for bf16/fp16 parameters.

    Each low-precision parameter gets an fp32 master copy (state ``"master_param"``), taken
    from the parameter at construction; fp32 parameters are their own master. ``step()``
    updates the master weights with AdamW's fp32 arithmetic (decoupled weight decay, bias
    correction, ``eps`` added to the root of the second moment, as ``torch.optim.AdamW``) and
    writes each parameter as its master rounded to nearest. Parameters without a gradient are
    left alone, as torch does.

    The gradient is read in whatever dtype autograd produced (bf16 for bf16 parameters, fp32
    after an fp32 reduction). Accumulating several micro-batches into a bf16 gradient would
    round each sum to bf16; :class:`~train_engine.Engine` sums an unwrapped model's window in
    fp32 and rounds once (its ``grad_accumulation_dtype``). Works on plain tensors and on
    DTensor parameters (each rank updates its local shard; the state is sharded alike).

    Like ``torch.optim.AdamW(fused=True)`` it honours the ``grad_scale`` / ``found_inf``
    device tensors (``GradScaler``'s interface, which :class:`~train_engine.Engine` uses to
    clip and to skip a non-finite window without a host synchronisation).

    The master weights are authoritative: :meth:`load_state_dict` restores them and rewrites
    the parameters from them.

    Args:
        params: parameters or parameter groups (dicts with ``"params"`` and overrides).
        lr: learning rate, a Python float (schedulers may change it per step).
        betas: the moments' decay rates, each in [0, 1).
        eps: added to the root of the second moment (>= 0).
        weight_decay: decoupled decay (>= 0), per group.
        backend: "triton" (one kernel per bucket, CUDA), "torch" (per-tensor torch ops; any
            device; reads ``found_inf`` on the host), or "auto" (Triton for CUDA tensors).

    Raises:
        ValueError: a bad hyperparameter or backend, a parameter of an unsupported dtype, or
            a non-contiguous parameter.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        backend: Backend = "auto",
    ) -> None:
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"backend={backend!r}; expected 'auto', 'triton' or 'torch'")
        self._backend: Backend = backend
        self._buckets: dict[BucketKey, Bucket] = {}
        self._steps: list[Tensor] = []
        # GradScaler's interface (`grad_scale`, `found_inf`) is set by the caller around step()
        # and deleted after; absent by default, as GradScaler multiplies into an existing one.
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    # -- construction -----------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group and create its state (master weights, zero moments, step 0)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group, len(self.param_groups) - 1)
        params: list[Tensor] = group["params"]
        first = params[0] if params else None
        device = local_tensor(first).device if first is not None else torch.device("cpu")
        steps = torch.zeros(len(params), dtype=torch.float32, device=device)
        self._steps.append(steps)
        for i, param in enumerate(params):
            local = local_tensor(param)
            if param.dtype not in _SUPPORTED:
                raise ValueError(
                    f"parameter {i} of group {len(self.param_groups) - 1} is {param.dtype}; "
                    "MasterWeightAdamW takes float32, bfloat16 or float16 parameters"
                )
            if not local.is_contiguous():
                raise ValueError(
                    f"parameter {i} of group {len(self.param_groups) - 1} (shape "
                    f"{tuple(param.shape)}) is not contiguous; the update addresses it as one "
                    "block of memory: make it contiguous before building the optimizer"
                )
            if local.device != device:
                raise ValueError(
                    f"parameter {i} of group {len(self.param_groups) - 1} is on {local.device}, "
                    f"the group's first on {device}; put a group's parameters on one device"
                )
            state = self.state[param]
            state["step"] = steps[i]
            state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
            if param.dtype in _LOW_PRECISION:
                master = torch.empty_like(param, dtype=torch.float32)
                master.copy_(param.detach())
                state["master_param"] = master

    @torch.no_grad()
    def reset_state(self) -> None:
        """Start afresh from the current parameters, as at construction.

        Moments and step counts become zero and each master weight is taken from its
        parameter again, in place (the kernels' address tables stay valid). A load of the
        parameters alone (a checkpoint without optimizer state) needs it: the master weights
        are authoritative, and the next step would otherwise write the old ones back.
        """
        for steps in self._steps:
            steps.zero_()
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                state["exp_avg"].zero_()
                state["exp_avg_sq"].zero_()
                if "master_param" in state:
                    state["master_param"].copy_(param.detach())

    # -- the update -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group_index, group in enumerate(self.param_groups):
            lr = group["lr"]
            if isinstance(lr, Tensor):
                raise TypeError(
                    f"param_groups[{group_index}]['lr'] is a Tensor; MasterWeightAdamW takes a "
                    "Python float learning rate (pass lr as a float)"
                )
            # GradScaler deletes these attributes after its step(): read them defensively.
            amp = (getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
            for triton_bucket, indices in self._group_buckets(group_index, group):
                if triton_bucket:
                    self._step_triton(group_index, group, indices, *amp)
                else:
                    self._step_torch(group_index, group, indices, *amp)
        return loss

    def _group_buckets(
        self, group_index: int, group: dict[str, Any]
    ) -> Iterator[tuple[bool, tuple[int, ...]]]:
        """(use Triton, the tensor indices) of each (param dtype, grad dtype, backend) bucket."""
        by_kind: dict[tuple[torch.dtype, torch.dtype, bool], list[int]] = {}
        for i, param in enumerate(group["params"]):
            if param.grad is None:
                continue
            grad = local_tensor(param.grad)
            if grad.dtype not in _SUPPORTED or not grad.is_contiguous():
                raise ValueError(
                    f"the gradient of parameter {i} of group {group_index} is {grad.dtype}"
                    f"{'' if grad.is_contiguous() else ', not contiguous'}; expected a "
                    "contiguous float32, bfloat16 or float16 gradient"
                )
            triton_bucket = self._backend == "triton" or (
                self._backend == "auto" and grad.device.type == "cuda"
            )
            by_kind.setdefault((param.dtype, grad.dtype, triton_bucket), []).append(i)
        for (_, _, triton_bucket), indices in by_kind.items():
            yield triton_bucket, tuple(indices)

    def _step_torch(
        self,
        group_index: int,
        group: dict[str, Any],
        indices: tuple[int, ...],
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        """Per-tensor torch ops, fp32 arithmetic: the portable (and reference) path."""
        if found_inf is not None and bool(found_inf.item()):
            return
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        steps = self._steps[group_index]
        for i in indices:
            param = group["params"][i]
            state = self.state[param]
            grad = local_tensor(param.grad).to(torch.float32)
            if grad_scale is not None:
                grad = grad / grad_scale.to(grad.device)
            master = local_tensor(state.get("master_param", param))
            avg, sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
            step = float(steps[i]) + 1.0
            master.mul_(1.0 - lr * weight_decay)
            avg.lerp_(grad, 1.0 - beta1)
            sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            denom = (sq.sqrt() / (1.0 - beta2**step) ** 0.5).add_(eps)
            master.addcdiv_(avg, denom, value=-lr / (1.0 - beta1**step))
            if "master_param" in state:
                local_tensor(param).copy_(master)
        steps[list(indices)] += 1.0

    def _step_triton(
        self,
        group_index: int,
        group: dict[str, Any],
        indices: tuple[int, ...],
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        from train_engine._master_adamw_triton import launch_master_adamw

        params = [group["params"][i] for i in indices]
        bucket = bucket_tables(self._buckets, self.state, group_index, indices, params)
        beta1, beta2 = group["betas"]
        steps = self._steps[group_index]
        covers_group = len(indices) == len(group["params"])
        launch_master_adamw(
            block_tensor=bucket.block_tensor,
            block_offset=bucket.block_offset,
            numels=bucket.numels,
            addresses=bucket.addresses,
            # A bucket of the whole group reads the group's counters as they are.
            steps=steps if covers_group else steps[bucket.step_index],
            grad_scale=grad_scale,
            found_inf=found_inf,
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            param_dtype=str(params[0].dtype).removeprefix("torch."),
            grad_dtype=str(params[0].grad.dtype).removeprefix("torch."),
            separate_master=params[0].dtype in _LOW_PRECISION,
            aligned=bucket.aligned,
        )
        # A skipped update (found_inf = 1) leaves the counters, like torch's fused AdamW.
        increment = torch.ones((), dtype=torch.float32, device=steps.device)
        if found_inf is not None:
            increment = increment - found_inf.to(steps.device)
        if covers_group:
            steps.add_(increment)
        else:
            steps.index_add_(0, bucket.step_index, increment.expand(len(indices)))

    # -- state ------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyperparameters and state in place, in fp32, then the parameters.

        ``torch.optim.Optimizer.load_state_dict`` would cast the moments and master weights
        to the parameters' dtype (bf16); here they are copied into the existing fp32 tensors,
        and each low-precision parameter is rewritten from its restored master weight.

        Raises:
            ValueError: the saved groups or their sizes differ from this optimizer's, or a
                parameter's state is missing.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state has {len(saved_groups)} parameter groups, this optimizer "
                f"{len(self.param_groups)}; build the optimizer with the same groups"
            )
        saved_state = state_dict["state"]
        with torch.no_grad():
            for group_index, (group, saved) in enumerate(
                zip(self.param_groups, saved_groups, strict=True)
            ):
                if len(saved["params"]) != len(group["params"]):
                    raise ValueError(
                        f"group {group_index} has {len(saved['params'])} parameters in the "
                        f"state, {len(group['params'])} here; build the optimizer with the "
                        "same parameters"
                    )
                for key, value in saved.items():
                    if key != "params":
                        group[key] = value
                for saved_id, param in zip(saved["params"], group["params"], strict=True):
                    if saved_id not in saved_state:
                        raise ValueError(
                            f"the state has no entry for parameter {saved_id} (group "
                            f"{group_index}); it was saved by a different optimizer"
                        )
                    mine, theirs = self.state[param], saved_state[saved_id]
                    for key, tensor in mine.items():
                        if key not in theirs:
                            raise ValueError(
                                f"the state of parameter {saved_id} has no {key!r}; it was "
                                "saved by a different optimizer"
                            )
                        tensor.copy_(theirs[key])
                    if "master_param" in mine:
                        param.copy_(mine["master_param"])


def _check_hyperparameters(group: dict[str, Any], index: int) -> None:
    beta1, beta2 = group["betas"]
    checks = (
        ("lr", group["lr"], not isinstance(group["lr"], Tensor) and group["lr"] >= 0, ">= 0"),
        ("betas[0]", beta1, 0.0 <= beta1 < 1.0, "in [0, 1)"),
        ("betas[1]", beta2, 0.0 <= beta2 < 1.0, "in [0, 1)"),
        ("eps", group["eps"], group["eps"] >= 0, ">= 0"),
        ("weight_decay", group["weight_decay"], group["weight_decay"] >= 0, ">= 0"),
    )
    for name, value, ok, expected in checks:
        if not ok:
            raise ValueError(
                f"param_groups[{index}] {name}={value!r}; expected a Python float {expected}"
            )
