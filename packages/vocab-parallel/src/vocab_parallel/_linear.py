"""Autograd function for log p(label) straight from hidden states and the output projection.

# N tokens, H hidden, V global vocabulary, Vl local vocabulary rows, B rows per block

The [N, Vl] logits never exist at once: forward walks the projection in blocks of B vocabulary
rows, computes the [N, B] logits of a block, folds them into running per-token softmax
statistics (online softmax) and drops them. Backward recomputes each block, turns it into the
block's logits gradient and immediately into its share of the hidden gradient (accumulated in
fp32, [N, H]) and its rows of the weight gradient (one matmul per block, so the weight gradient
is never accumulated in low precision and needs no fp32 weight-sized buffer).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from vocab_parallel._logits import (
    CHUNK_ELEMENTS,
    Plan,
    Targets,
    locate_targets,
    raise_invalid,
    unchecked_labels,
)
from vocab_parallel._math import chunk_grad, merge, scaled_target, shard_stats
from vocab_parallel._reduce import reduce_stats
from vocab_parallel._stats import GradTerms, ShardStats

# 16-bit blocks (Triton backend) hold at least 1/LOW_PRECISION_BLOCKS of the local vocabulary,
# so the block is a fixed fraction of the logits whatever N is (8 blocks: 0.125x), and at least
# LOW_PRECISION_BLOCK_ELEMENTS logits (128 MiB of bf16) when N is small. Few, large blocks keep
# the per-block matmuls near peak and cut the per-block work around them; on an H200 (N=8192
# and 16384, V=151936) 16K-32K rows per block ran 1-4% faster than 4K-8K rows.
LOW_PRECISION_BLOCKS = 8
LOW_PRECISION_BLOCK_ELEMENTS = 1 << 26


def block_size_for(tokens: int, local_vocab: int, *, low_precision: bool = False) -> int:
    """Default vocabulary rows per block.

    fp32 blocks: about CHUNK_ELEMENTS logits. 16-bit blocks (Triton backend, never converted
    to fp32): the larger of Vl / LOW_PRECISION_BLOCKS rows and LOW_PRECISION_BLOCK_ELEMENTS
    logits, rounded up to a multiple of 128 rows; at most Vl.
    """
    local_vocab = max(local_vocab, 1)
    if not low_precision:
        return max(1, min(local_vocab, CHUNK_ELEMENTS // max(tokens, 1)))
    by_fraction = -(-local_vocab // LOW_PRECISION_BLOCKS)
    by_elements = LOW_PRECISION_BLOCK_ELEMENTS // max(tokens, 1)
    rows = -(-max(by_fraction, by_elements) // 128) * 128
    return min(local_vocab, rows)


def _block_fp32(logits: Tensor, inv_temperature: float) -> Tensor:
    """Scaled fp32 logits of a block; reuses the matmul output when it is already fp32."""
    z = logits if logits.dtype == torch.float32 else logits.float()
    if inv_temperature != 1.0:
        z.mul_(inv_temperature)
    return z


def _block_targets(index: Tensor, in_shard: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """(in_block [N] bool, column [N] int64 within the block, 0 where not in_block)."""
    in_block = in_shard & (index >= start) & (index < stop)
    column = torch.where(in_block, index - start, torch.zeros_like(index))
    return in_block, column


def _blockwise_stats(
    hidden: Tensor, weight: Tensor, targets: Targets, plan: Plan
) -> tuple[ShardStats, Tensor]:
    """Softmax statistics and target logits [N] from one cuBLAS matmul per block of rows."""
    n = hidden.shape[0]
    local_vocab = weight.shape[0]
    inv_t = plan.inv_temperature
    target = hidden.new_zeros(n, dtype=torch.float32)
    running: ShardStats | None = None
    for start in range(0, local_vocab, plan.chunk_size):
        stop = min(start + plan.chunk_size, local_vocab)
        logits = hidden @ weight[start:stop].T
        in_block, column = _block_targets(targets.index, targets.in_shard, start, stop)
        picked = scaled_target(logits.gather(1, column.unsqueeze(-1)).squeeze(-1), inv_t)
        target = torch.where(in_block, picked, target)
        if plan.backend == "triton":
            from vocab_parallel import _triton

            block = _triton.shard_stats(logits, inv_temperature=inv_t, entropy=False, sum_z=False)
        else:
            block = shard_stats(_block_fp32(logits, inv_t), entropy=False, sum_z=False)
        del logits
        running = block if running is None else merge(running, block)
    if running is None:  # this rank holds no vocabulary rows
        running = shard_stats(
            hidden.new_zeros((n, 0), dtype=torch.float32), entropy=False, sum_z=False
        )
    return running, target


def _add_matmul_(accumulator: Tensor, a: Tensor, b: Tensor) -> None:
    """Add a @ b to the fp32 accumulator for 16-bit a, b, summed in fp32 in one CUDA matmul."""
    if accumulator.dtype == a.dtype:
        accumulator.addmm_(a, b)
    elif accumulator.is_cuda:
        torch.addmm(accumulator, a, b, out_dtype=accumulator.dtype, out=accumulator)
    else:  # CPU matmuls have no fp32 output for 16-bit inputs: fp32 copies give the same sums
        accumulator.addmm_(a.to(accumulator.dtype), b.to(accumulator.dtype))


def _mm_into(a: Tensor, b: Tensor, out: Tensor) -> None:
    """Write a @ b into ``out``: 16-bit a, b; ``out`` of their dtype or fp32 (never rounded to 16 bits)."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    elif a.is_cuda:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    else:  # CPU matmuls have no fp32 output for 16-bit inputs; the products are exact in fp32
        torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


def _chunk_logits_grad(
    logits: Tensor, terms: GradTerms, *, plan: Plan, dtype: torch.dtype
) -> Tensor:
    """[C, Vl] gradient of sum_t c_t log p_t w.r.t. the chunk's logits, in ``dtype``.

    ``terms.grad_all`` is c_t / temperature (0 where ignored), ``terms.target_grad`` the same
    where the target is in this shard (else 0). When ``logits`` already have ``dtype``, the
    Triton backend overwrites them with their gradient; fp32 logits of 16-bit inputs get a new
    buffer.
    """
    inv_vocab = 1.0 / plan.layout.vocab_size
    if plan.backend == "triton":
        from vocab_parallel import _triton

        return _triton.logits_grad(
            logits,
            terms,
            inv_temperature=plan.inv_temperature,
            inv_vocab=inv_vocab,
            in_place=True,  # the logits are not needed once their gradient exists
            out_dtype=dtype,
        )
    grad = chunk_grad(_block_fp32(logits, plan.inv_temperature), terms, inv_vocab=inv_vocab)
    return grad.to(dtype)


class LinearLogProbs(torch.autograd.Function):
    """log p(label) [N] from hidden [N, H] and the local projection rows [Vl, H]."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        plan: Plan,
        compute_dtype: torch.dtype | None,
    ) -> Tensor:
        ctx.compute_dtype = compute_dtype
        hidden_in, weight_in = hidden, weight
        if compute_dtype is not None:  # copies for the matmuls, made again in backward
            hidden, weight = hidden.to(compute_dtype), weight.to(compute_dtype)
        local_vocab = weight.shape[0]
        targets = locate_targets(labels, plan=plan, local_vocab=local_vocab)
        invalid = unchecked_labels(targets, labels, plan=plan)
        running, target = _blockwise_stats(hidden, weight, targets, plan)
        glob = reduce_stats(running, target=target, invalid_labels=invalid, group=plan.layout.group)
        if glob.invalid_labels:
            raise_invalid(labels, plan=plan, count=glob.invalid_labels)
        log_p = (glob.target - glob.shift) - glob.log_sum_exp
        log_p = torch.where(targets.valid, log_p, torch.zeros_like(log_p))
        ctx.plan = plan
        # The inputs, not the copies: holding 16-bit copies until backward would add their
        # memory at the end of forward, where a model's memory peaks; casting again is one pass.
        ctx.save_for_backward(
            hidden_in,
            weight_in,
            glob.log_normalizer,
            targets.valid,
            targets.in_shard,
            targets.index,
        )
        return log_p

    @staticmethod
    def backward(
        ctx: Any, grad_log_p: Tensor
    ) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        plan: Plan = ctx.plan
        hidden_in, weight_in, log_normalizer, valid, in_shard, index = ctx.saved_tensors
        hidden, weight = hidden_in, weight_in
        if ctx.compute_dtype is not None:
            hidden, weight = hidden.to(ctx.compute_dtype), weight.to(ctx.compute_dtype)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        inv_t = plan.inv_temperature
        g_all = torch.where(valid, grad_log_p.float(), 0.0) * inv_t
        local_vocab = weight.shape[0]
        grad_hidden = hidden.new_zeros(hidden.shape, dtype=torch.float32) if need_hidden else None
        grad_weight = torch.empty_like(weight_in) if need_weight else None
        for start in range(0, local_vocab, plan.chunk_size):
            stop = min(start + plan.chunk_size, local_vocab)
            rows = weight[start:stop]
            in_block, column = _block_targets(index, in_shard, start, stop)
            terms = GradTerms(
                log_normalizer=log_normalizer,
                grad_all=g_all,
                target_index=column,
                target_grad=torch.where(in_block, g_all, 0.0),
            )
            # The block's [N, B] logits, recomputed by cuBLAS, become their gradient.
            grad_logits = _chunk_logits_grad(hidden @ rows.T, terms, plan=plan, dtype=hidden.dtype)
            if grad_hidden is not None:
                _add_matmul_(grad_hidden, grad_logits, rows)
            if grad_weight is not None:
                _mm_into(grad_logits.T, hidden, grad_weight[start:stop])
            del grad_logits
        if grad_hidden is not None and plan.layout.group is not None:
            # Each rank saw only its vocabulary rows: the hidden gradient is a sum over ranks
            # ([N, H] floats, independent of V).
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=plan.layout.group)
        return (
            grad_hidden.to(hidden_in.dtype) if grad_hidden is not None else None,
            grad_weight,
            None,
            None,
            None,
        )
