"""Checked operands of the public functions: backend, temperature, chunk, dtypes, layouts.

# N tokens (the flattened leading dims [...]), H hidden, V vocabulary, Vl local vocabulary

Every public function of :mod:`vocab_parallel.losses` and :mod:`vocab_parallel.linear_loss`
validates its inputs here and gets back local tensors, the vocabulary shard and the plan its
autograd function runs; the errors name the bad value and the fix.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from vocab_parallel._logits import Plan, chunk_size_for
from vocab_parallel._sharding import VocabShard, check_labels, replicated_local
from vocab_parallel.plain_shard import VocabGroup, resolve_vocab_shard


def resolve_backend(backend: str, logits: Tensor) -> str:
    """Pick the implementation for ``logits`` (or hidden states, for the fused form).

    "auto" means the Triton kernels for CUDA tensors when triton is installed, else PyTorch.
    """
    if backend == "torch":
        return "torch"
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    available = importlib.util.find_spec("triton") is not None
    if backend == "auto":
        return "triton" if available and logits.is_cuda else "torch"
    if not available:
        raise ImportError(
            "backend='triton' needs the triton package; install the 'triton' extra "
            "(pip install 'vocab-parallel[triton]') or use backend='torch'"
        )
    if not logits.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"backend='triton' runs on CUDA tensors, but the logits are on {logits.device}; "
            "use backend='auto' or 'torch' on this device"
        )
    return "triton"


def _check_temperature(temperature: float) -> float:
    if not (isinstance(temperature, int | float) and math.isfinite(temperature)) or (
        temperature <= 0
    ):
        raise ValueError(
            f"temperature must be a finite number > 0, got {temperature!r}; use 1.0 for the "
            "plain softmax"
        )
    return 1.0 / float(temperature)


def _check_chunk(chunk_size: int | None) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(
            f"chunk_size must be a positive int or None (automatic), got {chunk_size!r}"
        )


def _check_float(t: Tensor, name: str) -> None:
    if not t.dtype.is_floating_point:
        raise TypeError(
            f"{name} has dtype {t.dtype}; expected a floating dtype (bfloat16, float16, float32 "
            "or float64)"
        )


def linear_operands(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float,
    chunk_size: int | None,
    vocab_group: VocabGroup | None = None,
) -> tuple[float, VocabShard, Tensor, Tensor, torch.Size]:
    """The checked operands of both fused linear forms.

    Returns:
        (1 / temperature, the weight's vocabulary shard, hidden as [N, H] local, labels [...]
        local, the batch shape [...]).
    """
    inv_t = _check_temperature(temperature)
    _check_chunk(chunk_size)
    _check_linear_inputs(hidden, weight)
    shard = resolve_vocab_shard(
        weight, vocab_group, vocab_dim=0, name="weight", expected="Shard(0)"
    )
    local_hidden = replicated_local(hidden, name="hidden")
    batch_shape = local_hidden.shape[:-1]
    labels = check_labels(
        replicated_local(labels, name="labels"), batch_shape=batch_shape, what="hidden states"
    )
    flat_hidden = local_hidden.reshape(-1, local_hidden.shape[-1])
    return inv_t, shard, flat_hidden, labels, batch_shape


def _check_linear_inputs(hidden: Tensor, weight: Tensor) -> None:
    """Check hidden [..., H] and weight [V, H] share a floating dtype; the error names both."""
    _check_float(hidden, "hidden")
    _check_float(weight, "weight")
    if weight.ndim != 2:
        raise ValueError(f"weight must be [V, H], got shape {tuple(weight.shape)}")
    if hidden.ndim < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden has shape {tuple(hidden.shape)} but weight is {tuple(weight.shape)}; "
            f"expected hidden [..., {weight.shape[1]}] (the weight's H)"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden is {hidden.dtype} but weight is {weight.dtype}; cast one of them so they match"
        )


def _as_slabs(local: Tensor) -> Tensor:
    """View logits [..., Vl] as [B, R, Vl] without copying whenever the strides allow.

    A contiguous tensor is one slab; a slice along the last leading dim (``logits[:, :-1]``)
    is B slabs of R rows. Anything else (or a non-unit stride along Vl) is copied once.
    """
    local_vocab = local.shape[-1]
    lead = local.shape[:-1]
    # Explicit sizes: a rank may hold zero vocabulary columns (V < number of shards).
    n = math.prod(lead)
    if local.stride(-1) == 1 or local_vocab <= 1:
        with contextlib.suppress(RuntimeError):
            return local.view(1, n, local_vocab)
        if len(lead) >= 2:
            with contextlib.suppress(RuntimeError):
                return local.view(math.prod(lead[:-1]), lead[-1], local_vocab)
    return local.reshape(1, n, local_vocab)


@dataclass(kw_only=True, slots=True, frozen=True)
class LogitsOperands:
    """The checked operands of a logits function (see :func:`logits_operands`)."""

    slabs: Tensor  # the local logits as [B, R, Vl] slabs
    labels: Tensor | None  # [N] local, or None
    plan: Plan
    batch_shape: torch.Size  # [...]


def logits_operands(
    logits: Tensor,
    labels: Tensor | None,
    *,
    temperature: float,
    ignore_index: int,
    chunk_size: int | None,
    entropy: bool,
    uniform: bool,
    validate: bool,
    backend: str,
    in_place: bool,
    vocab_group: VocabGroup | None,
) -> LogitsOperands:
    """The checked operands of the logits functions."""
    inv_t = _check_temperature(temperature)
    _check_chunk(chunk_size)
    if logits.ndim < 1:
        raise ValueError("logits must have at least one dim (the vocabulary, last)")
    _check_float(logits, "logits")
    shard = resolve_vocab_shard(
        logits, vocab_group, vocab_dim=-1, name="logits", expected="Shard(-1)"
    )
    batch_shape = logits.shape[:-1]
    flat_labels = None
    if labels is not None:
        labels = check_labels(
            replicated_local(labels, name="labels"), batch_shape=batch_shape, what="logits"
        )
        if labels.device != shard.local.device:
            raise ValueError(
                f"labels are on {labels.device} but logits on {shard.local.device}; move them"
            )
        flat_labels = labels.reshape(-1)
    local = shard.local
    slabs = _as_slabs(local)
    plan = Plan(
        layout=shard.layout,
        inv_temperature=inv_t,
        ignore_index=ignore_index,
        chunk_size=chunk_size or chunk_size_for(local.shape[-1]),
        entropy=entropy,
        uniform=uniform,
        validate=validate,
        backend=resolve_backend(backend, local),
        in_place=in_place,
    )
    return LogitsOperands(slabs=slabs, labels=flat_labels, plan=plan, batch_shape=batch_shape)


def trained_rows(valid: Tensor, trained_count: int | None, *, check: bool) -> Tensor | None:
    """The positions [M] of the tokens to form (``valid``, [N] bool), or None for all N.

    ``trained_count`` (M, known on the host) lets the positions be found without reading their
    number back from the device; without it, finding them waits for the device once. ``check``
    compares a given count with the device's (one more wait).

    Raises:
        ValueError: ``trained_count`` outside [0, N], or (``check``) not the number of True.
    """
    n = valid.shape[0]
    if trained_count is None:
        rows = torch.nonzero(valid).squeeze(1)
    else:
        if not 0 <= trained_count <= n:
            raise ValueError(
                f"trained_count={trained_count} is outside [0, {n}] (the number of tokens); pass "
                "the number of labels that are not ignore_index, or None to count them"
            )
        if check and (actual := int(valid.sum())) != trained_count:
            raise ValueError(
                f"trained_count={trained_count}, but {actual} labels are not ignore_index; pass "
                "their exact number (a smaller one would drop trained tokens), or None"
            )
        rows = torch.nonzero_static(valid, size=trained_count).squeeze(1)
    return None if rows.shape[0] == n else rows


def autocast_compute(
    device_type: str,
) -> tuple[torch.dtype | None, contextlib.AbstractContextManager[None]]:
    """(the dtype the linear forms' matmuls run in, a context that turns autocast off).

    Under autocast the linear forms run their matmuls in autocast's dtype, on copies made
    inside their autograd functions, and the functions themselves with autocast off (their
    buffers follow the dtypes they chose). Their gradients keep the inputs' dtypes: fp32
    master tensors get fp32 gradients never rounded to 16 bits (autocast's own casts would
    round them, since a 16-bit input's gradient is 16-bit). Without autocast: (None, a no-op).
    """
    if not torch.is_autocast_enabled(device_type):
        return None, contextlib.nullcontext()
    return torch.get_autocast_dtype(device_type), torch.autocast(device_type, enabled=False)
