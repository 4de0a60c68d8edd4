"""Public functions: token log-probs, entropy, cross-entropy and the fused linear form.

# N tokens (the flattened leading dims [...]), H hidden, V vocabulary

Every function accepts a plain tensor or a DTensor whose vocabulary dim is sharded (``Shard(-1)``
for logits, ``Shard(0)`` for the projection weight) over one mesh dim, with ``Replicate()`` on
any other mesh dim. Results are plain tensors, identical on every vocabulary rank. Only per-token
scalars cross ranks: one MAX and one SUM all-reduce in forward (plus, for the fused linear form,
one SUM of the [N, H] hidden gradient in backward).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from vocab_parallel._linear import LinearLogProbs, block_size_for
from vocab_parallel._logits import Plan, VocabStats
from vocab_parallel._logits_loss import LogitsLossInPlace
from vocab_parallel._operands import (
    LogitsOperands,
    autocast_compute,
    linear_operands,
    logits_operands,
    resolve_backend,
    trained_rows,
)
from vocab_parallel._sharding import replicated_local
from vocab_parallel.plain_shard import VocabGroup

Reduction = Literal["none", "mean", "sum"]
Backend = Literal["auto", "torch", "triton"]


def _vocab_stats(operands: LogitsOperands) -> tuple[Tensor, Tensor, Tensor]:
    """Run :class:`VocabStats`; returns (log_p, entropy, uniform), each [...]."""
    log_p, ent, uni = VocabStats.apply(operands.slabs, operands.labels, operands.plan)
    shape = operands.batch_shape
    return log_p.view(shape), ent.view(shape), uni.view(shape)


def token_log_probs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    validate: bool = False,
    backend: Backend = "auto",
    in_place: bool = False,
    vocab_group: VocabGroup | None = None,
) -> Tensor:
    """Log-probability of each label under softmax(logits / temperature).

    Args:
        logits: [..., V] any float dtype; a DTensor may shard V (``Shard(-1)``).
        labels: [...] integer; ``ignore_index`` positions give 0 and get no gradient.
        temperature: > 0; the logits are divided by it before the softmax.
        ignore_index: label value without a target.
        chunk_size: tokens per fp32 working chunk; None picks about 16M elements per chunk.
            Results do not depend on it.
        validate: check that every label is ``ignore_index`` or in [0, V) and raise
            otherwise. Costs one device-to-host sync. Without it an out-of-range label is
            never read out of bounds but yields a meaningless value.
        backend: "auto" (Triton kernels for CUDA tensors when triton is installed, else
            PyTorch), "torch" (chunked PyTorch, any device) or "triton".
        vocab_group: for a plain local vocabulary shard ``[..., Vl]`` (Megatron's
            vocab-parallel logits): its process group (the even split, rank r holding
            ``[r * Vl, (r + 1) * Vl)``) or a :class:`~vocab_parallel.VocabSplit` with an explicit
            offset. None: the layout comes from ``logits`` (a DTensor, or all of V).
        in_place: give up the logits: backward writes their gradient into their storage (no
            logits-sized buffer; the returned gradient aliases ``logits``), so after backward
            ``logits`` holds the gradient, and a second backward through this call raises.
            Another use of the same logits in the graph fails autograd's version check.
            A non-contiguous slice such as ``logits[:, :-1]`` is written in place too, but
            autograd's slicing backward then allocates the full gradient: slice the labels.

    Returns:
        [...] float32, identical on every vocabulary rank (a plain tensor).
    """
    log_p, _, _ = _vocab_stats(
        logits_operands(
            logits,
            labels,
            temperature=temperature,
            ignore_index=ignore_index,
            chunk_size=chunk_size,
            entropy=False,
            uniform=False,
            validate=validate,
            backend=backend,
            in_place=in_place,
            vocab_group=vocab_group,
        )
    )
    return log_p


def token_entropy(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    in_place: bool = False,
    vocab_group: VocabGroup | None = None,
) -> Tensor:
    """Entropy H = -sum_v p_v log p_v (>= 0) of softmax(logits / temperature), differentiable.

    Args:
        logits: [..., V] any float dtype; a DTensor may shard V (``Shard(-1)``).
        temperature: > 0.
        chunk_size: tokens per fp32 working chunk; None = automatic.
        backend: "auto", "torch" or "triton" (see :func:`token_log_probs`).
        in_place: write the gradient into the logits (see :func:`token_log_probs`).
        vocab_group: a plain shard's group or split (see :func:`token_log_probs`).

    Returns:
        [...] float32, identical on every vocabulary rank.
    """
    _, ent, _ = _vocab_stats(
        logits_operands(
            logits,
            None,
            temperature=temperature,
            ignore_index=-100,
            chunk_size=chunk_size,
            entropy=True,
            uniform=False,
            validate=False,
            backend=backend,
            in_place=in_place,
            vocab_group=vocab_group,
        )
    )
    return ent


def token_log_probs_and_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    validate: bool = False,
    backend: Backend = "auto",
    in_place: bool = False,
    vocab_group: VocabGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """Both :func:`token_log_probs` and :func:`token_entropy` from one pass over the logits.

    Options as in :func:`token_log_probs` (``in_place`` and ``vocab_group`` included).

    Returns:
        (log_probs [...], entropy [...]), both float32; the entropy is computed for every
        position, ignored or not.
    """
    log_p, ent, _ = _vocab_stats(
        logits_operands(
            logits,
            labels,
            temperature=temperature,
            ignore_index=ignore_index,
            chunk_size=chunk_size,
            entropy=True,
            uniform=False,
            validate=validate,
            backend=backend,
            in_place=in_place,
            vocab_group=vocab_group,
        )
    )
    return log_p, ent


def cross_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
    validate: bool = False,
    backend: Backend = "auto",
    in_place: bool = False,
    vocab_group: VocabGroup | None = None,
) -> Tensor:
    """``torch.nn.functional.cross_entropy`` over the last dim, vocabulary-parallel.

    Same values as ``F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ...)``
    without class weights: "mean" divides by the number of non-ignored labels (nan when all
    are ignored, as in PyTorch), ``label_smoothing`` mixes in the uniform distribution.

    Args:
        logits: [..., V] any float dtype; a DTensor may shard V (``Shard(-1)``).
        labels: [...] integer.
        ignore_index: label value that contributes neither loss nor count.
        reduction: "none" ([...]), "mean" or "sum" (scalars).
        label_smoothing: in [0, 1].
        chunk_size: tokens per fp32 working chunk; None = automatic.
        validate: check the label range (one device-to-host sync).
        backend: "auto", "torch" or "triton" (see :func:`token_log_probs`).
        in_place: write the gradient into the logits (see :func:`token_log_probs`). With a
            "sum" or "mean" reduction, no label smoothing, the Triton backend and the whole
            vocabulary on this rank, the gradient is formed in forward by one kernel (the
            weight of every token is known then): the logits hold their gradient as soon as
            this returns, so read nothing else from them afterwards.
        vocab_group: a plain shard's group or split (see :func:`token_log_probs`).

    Returns:
        float32 loss (dtype differs from PyTorch, which returns the logits' dtype).
    """
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    smooth = label_smoothing > 0.0
    operands = logits_operands(
        logits,
        labels,
        temperature=1.0,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        entropy=False,
        uniform=smooth,
        validate=validate,
        backend=backend,
        in_place=in_place,
        vocab_group=vocab_group,
    )
    plan, flat_labels = operands.plan, operands.labels
    in_forward = in_place and reduction != "none" and not smooth
    if in_forward and plan.backend == "triton" and plan.layout.group is None:
        assert flat_labels is not None
        # Every token's weight in the loss is known now: the gradient is formed in forward.
        coefficient = torch.full((), -1.0, device=operands.slabs.device)
        if reduction == "mean":
            coefficient = coefficient / (flat_labels != ignore_index).sum()
        loss, _ = LogitsLossInPlace.apply(operands.slabs, flat_labels, coefficient, plan)
        return loss
    log_p, _, uniform = _vocab_stats(operands)
    valid = replicated_local(labels, name="labels") != ignore_index
    loss = -log_p
    if smooth:
        uniform = torch.where(valid, uniform, torch.zeros_like(uniform))
        loss = (1.0 - label_smoothing) * loss - label_smoothing * uniform
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def linear_token_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    validate: bool = False,
    backend: Backend = "auto",
    skip_ignored: bool = True,
    trained_count: int | None = None,
    vocab_group: VocabGroup | None = None,
) -> Tensor:
    """Log p(label) under softmax(hidden @ weight.T / temperature), never building [N, V].

    The projection is walked in blocks of ``chunk_size`` vocabulary rows; each block's [N, B]
    logits are recomputed in backward. Extra memory, besides the gradients themselves: on
    the Triton backend (bf16/fp16) one [N, B] block in the input dtype, overwritten by its own
    gradient, and an fp32 [N, H] hidden-gradient accumulator that each block's matmul adds
    into; on the torch backend an fp32 block, its gradient and the same accumulator. With
    ``skip_ignored`` (the default) N there is the number of trained tokens M, plus the
    gathered [M, H] copy of their hidden rows.

    Speed: the recomputation makes four logits-sized matmuls where matmul + log_softmax makes
    three. Where the unfused fp32 log_softmax costs no more than about one such matmul, this is
    slower than the unfused form, in exchange for a small fraction of the logits' transient
    memory; the measured times and memory are in the repository's BENCHMARKS.md.

    Under ``torch.autocast`` the matmuls run in autocast's dtype on copies of ``hidden`` and
    ``weight`` made in forward and again in backward (not held in between), and fp32 inputs
    get fp32 gradients never rounded to 16 bits.

    Args:
        hidden: [..., H] float; plain, or a DTensor that is Replicate on every mesh dim.
        weight: [V, H] same dtype; a DTensor may shard V (``Shard(0)``, e.g. a ColwiseParallel
            lm_head). No bias.
        labels: [...] integer; ``ignore_index`` positions give 0 and get no gradient.
        temperature: > 0.
        ignore_index: label value without a target.
        chunk_size: vocabulary rows per block; None picks about 16M fp32 logits per block
            (torch backend) or, on the Triton backend with bf16/fp16, an eighth of the
            vocabulary (at least 64M logits).
        validate: check the label range (one device-to-host sync).
        backend: "auto", "torch" or "triton" for the per-block softmax work around the
            matmuls (see :func:`token_log_probs`).
        skip_ignored: leave the tokens labelled ``ignore_index`` (an RL prompt, padding) out
            of all four matmuls: their rows of ``hidden`` are gathered out once, the trained
            rows' log-probs are scattered back, and the ignored positions get 0 and a zero
            hidden gradient as before. Finding the rows reads their number from the device
            once (see ``trained_count``); False forms every token.
        trained_count: the number of labels that are not ``ignore_index`` when the host knows
            it (no device read; ``validate=True`` checks it). A wrong count without
            ``validate`` drops or repeats rows.
        vocab_group: for a plain local weight shard ``[Vl, H]`` (Megatron's output layer): its
            process group (even split) or a :class:`~vocab_parallel.VocabSplit`; None: the
            layout comes from ``weight`` (see :func:`token_log_probs`).

    Returns:
        [...] float32, identical on every vocabulary rank. The hidden gradient is summed over
        the vocabulary ranks in backward, so it is the full gradient on every rank.

    Raises:
        ValueError: ``trained_count`` outside [0, N], or (``validate``) not the number of
            labels that are not ``ignore_index``; invalid labels (``validate``).
    """
    inv_t, shard, flat_hidden, labels, batch_shape = linear_operands(
        hidden,
        weight,
        labels,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_group=vocab_group,
    )
    flat_labels = labels.reshape(-1)
    rows = (
        trained_rows(flat_labels != ignore_index, trained_count, check=validate)
        if skip_ignored
        else None
    )
    formed_hidden = flat_hidden if rows is None else flat_hidden.index_select(0, rows)
    formed_labels = flat_labels if rows is None else flat_labels.index_select(0, rows)
    resolved = resolve_backend(backend, flat_hidden)
    compute_dtype, autocast_off = autocast_compute(flat_hidden.device.type)
    matmul_dtype = compute_dtype or flat_hidden.dtype
    low_precision = resolved == "triton" and matmul_dtype in (torch.bfloat16, torch.float16)
    plan = Plan(
        layout=shard.layout,
        inv_temperature=inv_t,
        ignore_index=ignore_index,
        chunk_size=chunk_size
        or block_size_for(
            formed_hidden.shape[0], shard.local.shape[0], low_precision=low_precision
        ),
        entropy=False,
        uniform=False,
        validate=validate,
        backend=resolved,
    )
    with autocast_off:
        log_p = LinearLogProbs.apply(formed_hidden, shard.local, formed_labels, plan, compute_dtype)
    if rows is not None:
        # index_copy is differentiable in its source: backward hands the trained rows their
        # upstream gradient, and index_select's backward scatters their hidden gradient into
        # zeros, so the ignored rows get exactly 0.
        log_p = log_p.new_zeros(flat_labels.shape[0]).index_copy(0, rows, log_p)
    return log_p.view(batch_shape)
