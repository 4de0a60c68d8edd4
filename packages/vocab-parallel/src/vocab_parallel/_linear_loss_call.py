"""From the fused linear losses' arguments to one ``FusedLinearLoss`` call.

# N tokens (the flattened leading dims [...]), H hidden, V vocabulary

The three public losses of :mod:`vocab_parallel.linear_loss` differ only in what a token's loss
is (a coefficient, a token function, the cross-entropy's mean); this is what they share: the
operands resolved (DTensor vocabulary shard, temperature, autocast), the per-token constants
checked, the chunking and backend chosen, and the autograd function applied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vocab_parallel._fused_linear import FusedLinearLoss, fused_chunk_tokens
from vocab_parallel._logits import Plan
from vocab_parallel._operands import autocast_compute, linear_operands, resolve_backend
from vocab_parallel._sharding import replicated_local
from vocab_parallel._token_function import TokenFunction, TokenLoss
from vocab_parallel.plain_shard import VocabGroup

__all__ = ["fused_loss", "per_token"]


def per_token(value: Tensor, *, name: str, batch_shape: torch.Size, device: torch.device) -> Tensor:
    """A per-token constant [...] or 0-dim, checked, as fp32 [N] on ``device``."""
    value = replicated_local(value, name=name)
    if value.requires_grad:
        raise ValueError(
            f"{name} require grad, but the fused loss treats them as constants (its gradients "
            f"are formed in forward); pass {name}.detach()"
        )
    if value.ndim == 0:
        value = value.expand(batch_shape)
    if value.shape != batch_shape:
        raise ValueError(
            f"{name} have shape {tuple(value.shape)}; expected {tuple(batch_shape)} (one per "
            "token) or a scalar"
        )
    return value.reshape(-1).to(device=device, dtype=torch.float32)


def fused_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    coefficients: Tensor | float | tuple[TokenLoss, Sequence[Tensor], bool],
    *,
    temperature: float,
    ignore_index: int,
    chunk_size: int | None,
    validate: bool,
    backend: str,
    fp32_logits: bool,
    fp32_weight_grad: bool,
    skip_ignored: bool,
    trained_count: int | None,
    vocab_group: VocabGroup | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, log_p [...], entropy [...] or None) with loss = sum_t c_t * log p(label_t).

    ``coefficients`` as (token_loss, token_inputs, with_entropy): loss = sum_t token_loss(log
    p_t, [H_t,] *inputs_t) over the trained tokens; the entropy is returned with_entropy.
    """
    inv_t, shard, flat_hidden, labels, batch_shape = linear_operands(
        hidden,
        weight,
        labels,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_group=vocab_group,
    )
    n = flat_hidden.shape[0]
    device = flat_hidden.device
    terms: Tensor | TokenFunction
    if isinstance(coefficients, tuple):
        fn, inputs, with_entropy = coefficients
        if not callable(fn):
            raise TypeError(
                f"token_loss must be a function (log_p, *token_inputs) -> per-token losses, "
                f"got {type(fn).__name__}"
            )
        terms = TokenFunction(
            fn=fn,
            inputs=tuple(
                per_token(x, name=f"token_inputs[{i}]", batch_shape=batch_shape, device=device)
                for i, x in enumerate(inputs)
            ),
            with_entropy=with_entropy,
        )
    elif isinstance(coefficients, Tensor):
        terms = per_token(coefficients, name="coefficients", batch_shape=batch_shape, device=device)
    else:
        terms = flat_hidden.new_full((n,), float(coefficients), dtype=torch.float32)
    local_weight = shard.local
    compute_dtype, autocast_off = autocast_compute(flat_hidden.device.type)
    grad_enabled = torch.is_grad_enabled()
    need_weight = grad_enabled and local_weight.requires_grad
    fp32_accumulator_width = 0
    matmul_dtype = compute_dtype or local_weight.dtype
    if need_weight and fp32_weight_grad and matmul_dtype != torch.float32:
        fp32_accumulator_width = local_weight.shape[1]
    plan = Plan(
        layout=shard.layout,
        inv_temperature=inv_t,
        ignore_index=ignore_index,
        chunk_size=chunk_size
        or fused_chunk_tokens(
            n,
            local_weight.shape[0],
            fp32_accumulator_width=fp32_accumulator_width,
        ),
        entropy=False,
        uniform=False,
        validate=validate,
        backend=resolve_backend(backend, flat_hidden),
    )
    flat_labels = labels.reshape(-1)
    with autocast_off:
        loss, log_p, entropy = FusedLinearLoss.apply(
            flat_hidden,
            local_weight,
            flat_labels,
            terms,
            plan,
            grad_enabled and flat_hidden.requires_grad,
            need_weight,
            bool(fp32_logits),
            bool(fp32_weight_grad),
            bool(skip_ignored),
            trained_count,
            compute_dtype,
        )
    if isinstance(terms, TokenFunction) and terms.with_entropy:
        token_entropy = entropy.view(batch_shape)
    else:
        token_entropy = None
    return loss, log_p.view(batch_shape), token_entropy
