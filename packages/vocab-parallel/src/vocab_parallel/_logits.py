"""Autograd function over (possibly vocabulary-sharded) logits, chunked over tokens.

# N tokens (B * R), B slabs, R rows per slab, V global vocabulary, Vl local vocabulary columns,
# C tokens per chunk

The logits arrive as [B, R, Vl] with unit stride along Vl: a contiguous tensor is one slab
(B = 1), and a slice such as ``logits[:, :-1]`` keeps its strides instead of being copied.

Forward reads the logits once (one fp32 chunk of [C, Vl] at a time) and keeps only [N]-sized
statistics; backward recomputes softmax per chunk from the saved input logits and the saved
logZ, writing straight into the gradient buffer. No fp32 copy of the logits is ever kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vocab_parallel._math import chunk_grad, scaled_fp32, scaled_target, shard_stats
from vocab_parallel._reduce import reduce_stats
from vocab_parallel._sharding import VocabLayout
from vocab_parallel._stats import GradTerms, ShardStats

# Auto chunking: fp32 elements per chunk buffer (64 MiB). Two such buffers live at once.
CHUNK_ELEMENTS = 1 << 24


@dataclass(kw_only=True, slots=True, frozen=True)
class Plan:
    """Everything the autograd function needs besides tensors.

    Attributes:
        layout: the vocabulary layout (process group, first local column, global V).
        inv_temperature: 1 / temperature.
        ignore_index: label value that marks a position without a target.
        chunk_size: tokens (or vocabulary rows, for the linear form) per chunk.
        entropy: compute the entropy.
        uniform: compute mean_v log p_v (label smoothing).
        validate: count labels outside [0, V) and raise if any.
        backend: "torch" (chunked PyTorch) or "triton" (fused kernels, logits path only).
        in_place: backward writes the logits gradient into the logits' own storage (logits path).
    """

    layout: VocabLayout
    inv_temperature: float
    ignore_index: int
    chunk_size: int
    entropy: bool
    uniform: bool
    validate: bool
    backend: str = "torch"
    in_place: bool = False


@dataclass(kw_only=True, slots=True, frozen=True)
class Targets:
    """Where each label lives.

    Attributes:
        valid: [N] bool, label != ignore_index.
        in_shard: [N] bool, valid and inside this rank's columns.
        index: [N] int64 local column, 0 where not in_shard (always in bounds).
        invalid: scalar fp32 count of valid labels outside [0, V), or None when not validated.
    """

    valid: Tensor
    in_shard: Tensor
    index: Tensor
    invalid: Tensor | None


def locate_targets(labels: Tensor, *, plan: Plan, local_vocab: int) -> Targets:
    """Map global labels [N] to local columns without ever indexing out of bounds."""
    valid = labels != plan.ignore_index
    local = labels - plan.layout.vocab_start
    in_shard = valid & (local >= 0) & (local < local_vocab)
    index = torch.where(in_shard, local, torch.zeros_like(local))
    invalid = None
    if plan.validate:
        invalid = _out_of_range(labels, plan).sum().to(torch.float32)
    return Targets(valid=valid, in_shard=in_shard, index=index, invalid=invalid)


def _out_of_range(labels: Tensor, plan: Plan) -> Tensor:
    """[N] bool: the label is not ignore_index and outside [0, V)."""
    outside = (labels < 0) | (labels >= plan.layout.vocab_size)
    return (labels != plan.ignore_index) & outside


def raise_invalid(labels: Tensor, *, plan: Plan, count: int) -> None:
    """Raise the out-of-range label error (every rank reaches it after the same collective)."""
    bad = labels[_out_of_range(labels, plan)]
    raise ValueError(
        f"{count} label(s) are outside [0, {plan.layout.vocab_size}) and are not ignore_index="
        f"{plan.ignore_index} (first: {bad[:5].tolist()}); fix the labels or set them to "
        f"ignore_index"
    )


def unchecked_labels(targets: Targets, labels: Tensor, *, plan: Plan) -> Tensor | None:
    """Check the labels now where no collective is needed; return the count still to reduce.

    Without a vocabulary group the out-of-range count is read here, before the logits-sized
    kernels are launched: the host then waits only for the few small label ops, and the
    device queue fills again right after, instead of idling through everything launched after
    a read that waits for the whole softmax. With a group the count rides on the statistics'
    SUM all-reduce (every rank must decide together), so it is returned for that.

    Raises:
        ValueError: a label outside [0, V) that is not ``ignore_index`` (no group).
    """
    if targets.invalid is None or plan.layout.group is not None:
        return targets.invalid
    count = int(targets.invalid.item())
    if count:
        raise_invalid(labels, plan=plan, count=count)
    return None


def chunk_size_for(local_vocab: int) -> int:
    """Default tokens per chunk so that one fp32 chunk holds about CHUNK_ELEMENTS entries."""
    return max(1, CHUNK_ELEMENTS // max(local_vocab, 1))


def row_chunks(logits: Tensor, chunk_size: int) -> Iterator[tuple[int, Tensor]]:
    """(first token, [C, Vl] view) for each chunk of rows of logits [B, R, Vl], slab by slab."""
    slabs, rows, _ = logits.shape
    for slab in range(slabs):
        for start in range(0, rows, chunk_size):
            yield slab * rows + start, logits[slab, start : start + chunk_size]


def target_logits(logits: Tensor, targets: Targets, inv_temperature: float) -> Tensor:
    """[N] fp32 scaled target logit where the target is in this shard, else 0."""
    slabs, rows, local_vocab = logits.shape
    if local_vocab == 0:
        return logits.new_zeros(slabs * rows, dtype=torch.float32)
    index = targets.index.view(slabs, rows, 1)
    picked = logits.gather(-1, index).reshape(slabs * rows)
    values = scaled_target(picked, inv_temperature)
    return torch.where(targets.in_shard, values, torch.zeros_like(values))


class VocabStats(torch.autograd.Function):
    """(log p_y, H, mean_v log p_v) [N] from logits [B, R, Vl]; see :class:`Plan`."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor | None, plan: Plan) -> Any:
        slabs, rows, local_vocab = logits.shape
        n = slabs * rows
        targets = None
        invalid = None
        if labels is not None:
            targets = locate_targets(labels, plan=plan, local_vocab=local_vocab)
            invalid = unchecked_labels(targets, labels, plan=plan)
        if plan.backend == "triton":
            from vocab_parallel import _triton

            stats = _triton.shard_stats(
                logits,
                inv_temperature=plan.inv_temperature,
                entropy=plan.entropy,
                sum_z=plan.uniform,
            )
        else:
            parts: list[ShardStats] = []
            for _, chunk in row_chunks(logits, plan.chunk_size):
                z = scaled_fp32(chunk, plan.inv_temperature)
                parts.append(shard_stats(z, entropy=plan.entropy, sum_z=plan.uniform))
                del z
            stats = _concat(parts, n=n, like=logits, plan=plan)

        target = logits.new_zeros(n, dtype=torch.float32)
        if targets is not None:
            target = target_logits(logits, targets, plan.inv_temperature)
        glob = reduce_stats(stats, target=target, invalid_labels=invalid, group=plan.layout.group)
        if glob.invalid_labels and labels is not None:
            raise_invalid(labels, plan=plan, count=glob.invalid_labels)

        def zeros() -> Tensor:
            return logits.new_zeros(n, dtype=torch.float32)

        log_p = zeros()
        if targets is not None:
            log_p = (glob.target - glob.shift) - glob.log_sum_exp
            log_p = torch.where(targets.valid, log_p, zeros())
        entropy = glob.entropy if glob.entropy is not None else zeros()
        uniform = zeros()
        if glob.sum_z is not None:
            uniform = glob.sum_z / plan.layout.vocab_size - glob.log_normalizer

        ctx.plan = plan
        ctx.has_targets = targets is not None
        saved = [logits, glob.log_normalizer, entropy]
        if targets is not None:
            saved += [targets.valid, targets.in_shard, targets.index]
        ctx.save_for_backward(*saved)
        ctx.set_materialize_grads(False)
        ctx.spent = False
        return log_p, entropy, uniform

    @staticmethod
    def backward(
        ctx: Any,
        grad_log_p: Tensor | None,
        grad_entropy: Tensor | None,
        grad_uniform: Tensor | None,
    ) -> tuple[Tensor | None, None, None]:
        plan: Plan = ctx.plan
        if plan.in_place:
            if ctx.spent:
                raise RuntimeError(
                    "backward ran twice through an in_place=True call: the first one overwrote "
                    "the logits with their gradient; call the function again, or pass "
                    "in_place=False to use retain_graph=True"
                )
            ctx.spent = True
        logits, log_normalizer, entropy, *rest = ctx.saved_tensors
        if not ctx.has_targets:
            grad_log_p = None
        if not plan.entropy:
            grad_entropy = None
        if not plan.uniform:
            grad_uniform = None
        if grad_log_p is None and grad_entropy is None and grad_uniform is None:
            return None, None, None
        inv_t = plan.inv_temperature
        g_target = g_all = index = None
        if grad_log_p is not None:
            valid, in_shard, index = rest
            # Ignored positions are constant 0: their gradient is dropped here.
            g = torch.where(valid & in_shard, grad_log_p.float(), 0.0)
            g_target = g * inv_t
            # The -p part of d log p_y / dz applies on every rank, not only the target's.
            g_all = torch.where(valid, grad_log_p.float(), 0.0) * inv_t
        g_ent = grad_entropy.float() * inv_t if grad_entropy is not None else None
        terms = GradTerms(
            log_normalizer=log_normalizer,
            grad_all=g_all,
            entropy=entropy if g_ent is not None else None,
            grad_entropy=g_ent,
            grad_uniform=grad_uniform.float() * inv_t if grad_uniform is not None else None,
            target_index=index,
            target_grad=g_target,
        )
        inv_vocab = 1.0 / plan.layout.vocab_size

        if plan.backend == "triton":
            from vocab_parallel import _triton

            grad = _triton.logits_grad(
                logits, terms, inv_temperature=inv_t, inv_vocab=inv_vocab, in_place=plan.in_place
            )
            if plan.in_place:
                # Written by a kernel behind autograd's back: bump the version so that any other
                # use of these logits in the graph fails loudly instead of reading a gradient.
                torch.autograd.graph.increment_version(logits)
            return grad, None, None
        slabs, rows, local_vocab = logits.shape
        # In place: each chunk is read into an fp32 copy before its rows are overwritten.
        grad = logits if plan.in_place else logits.new_empty((slabs, rows, local_vocab))
        if local_vocab == 0:
            return grad, None, None
        grad_chunks = row_chunks(grad, plan.chunk_size)
        for start, chunk_logits in row_chunks(logits, plan.chunk_size):
            _, grad_rows = next(grad_chunks)
            span = slice(start, start + chunk_logits.shape[0])
            z = scaled_fp32(chunk_logits, inv_t)
            chunk = chunk_grad(z, terms.rows(span), inv_vocab=inv_vocab)
            grad_rows.copy_(chunk)
            del z, chunk
        return grad, None, None


def _concat(parts: list[ShardStats], *, n: int, like: Tensor, plan: Plan) -> ShardStats:
    if not parts:
        empty = like.new_zeros(n, dtype=torch.float32)
        return ShardStats(
            max=empty.clone(),
            sum_exp=empty.clone(),
            sum_exp_z=empty.clone() if plan.entropy else None,
            sum_z=empty.clone() if plan.uniform else None,
        )
    if len(parts) == 1:
        return parts[0]

    def cat(values: list[Tensor | None]) -> Tensor | None:
        return None if values[0] is None else torch.cat([v for v in values if v is not None])

    max_ = cat([p.max for p in parts])
    sum_exp = cat([p.sum_exp for p in parts])
    assert max_ is not None and sum_exp is not None
    return ShardStats(
        max=max_,
        sum_exp=sum_exp,
        sum_exp_z=cat([p.sum_exp_z for p in parts]),
        sum_z=cat([p.sum_z for p in parts]),
    )
