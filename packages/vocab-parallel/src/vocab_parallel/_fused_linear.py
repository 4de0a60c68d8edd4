"""Autograd function for sum_t c_t * log p(label_t), both gradients formed during the forward.

From hidden states and the output projection.

# N tokens, H hidden, V global vocabulary, Vl local vocabulary rows, C tokens per chunk

When the per-token weights c_t of the loss are known before backward (SFT's token sum or mean,
RL's per-token coefficients), d loss / d logits = c_t * (onehot - softmax) / temperature is
known as soon as a token's softmax normalizer is. Forward therefore walks the tokens in chunks
of C: one matmul makes the chunk's [C, Vl] logits, the per-token statistics are reduced over
the vocabulary ranks (one MAX and one SUM all-reduce of [C]-sized scalars: the normalizer needs
the whole vocabulary before any gradient can be formed), the logits buffer is overwritten by its
own gradient, and two more matmuls turn it into the chunk's rows of the hidden gradient and its
share of the weight gradient. Three logits-sized matmuls in all, where a form that recomputes
the logits in backward runs four. Backward only multiplies the stored gradients by the scalar
upstream gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from vocab_parallel._linear import _add_matmul_, _chunk_logits_grad, _mm_into
from vocab_parallel._logits import Plan, locate_targets, raise_invalid, unchecked_labels
from vocab_parallel._math import scale_by_upstream_, scaled_fp32, scaled_target, shard_stats
from vocab_parallel._operands import trained_rows
from vocab_parallel._reduce import reduce_stats
from vocab_parallel._stats import GradTerms
from vocab_parallel._token_function import TokenFunction

# Default chunking: one chunk's logits hold at most 1/FUSED_CHUNKS of the full [N, Vl] logits
# (1/20 = 0.05x, the memory goal; rounded down to 64 tokens: 384 of 8192, 768 of 16384, 0.047x),
# but at least FUSED_MIN_CHUNK_ELEMENTS logits (8 MiB
# of bf16), so that a small batch is not cut into chunks too thin for the matmuls to run near
# peak. Fewer chunks would be faster: every chunk reads and writes the whole weight-gradient
# accumulator once (its addmm), so that traffic is chunks x 2 x the accumulator's bytes: on an
# H200 (V=151936, H=4096, bf16 accumulator) 1/20 ran 2.1% (T=8192) and 4.6% (T=16384) faster
# than 1/24 (benchmarks/results/vocab_parallel_h200_T*_perf.json).
FUSED_CHUNKS = 20
FUSED_MIN_CHUNK_ELEMENTS = 1 << 22


def fused_chunk_tokens(tokens: int, local_vocab: int, *, fp32_accumulator_width: int = 0) -> int:
    """Default tokens per chunk: max(N / FUSED_CHUNKS, FUSED_MIN_CHUNK_ELEMENTS / Vl), at most N.

    With an fp32 weight-gradient accumulator of H columns (``fp32_accumulator_width``), at
    least H / 2 tokens: then a bf16 chunk of logits ([C, Vl]) holds at most a quarter of what
    the accumulator ([Vl, H] fp32) already holds, and the accumulator, read and written once
    per chunk, is passed over fewer times. Rounded down to a multiple of 64 tokens when that
    leaves at least 64 (matmul-friendly tiles).
    """
    tokens = max(tokens, 1)
    rows = max(
        tokens // FUSED_CHUNKS,
        FUSED_MIN_CHUNK_ELEMENTS // max(local_vocab, 1),
        fp32_accumulator_width // 2,
        1,
    )
    if rows >= 64:
        rows -= rows % 64
    return min(rows, tokens)


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """Return a @ b as fp32, never rounded to a 16-bit dtype (one mixed-precision matmul on CUDA)."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    _mm_into(a, b, out)
    return out


def accumulate_weight_grad_(
    accumulator: Tensor, grad_logits: Tensor, h_chunk: Tensor, *, halves: bool | None = None
) -> None:
    """Add grad_logits.T [Vl, C] @ h_chunk [C, H] to the weight-gradient accumulator [Vl, H].

    With ``halves`` (default: on CUDA, for a 16-bit accumulator of the operands' dtype and an
    even, contiguous [C, Vl] chunk) the sum runs as one batched matmul over the two vocabulary
    halves: the same products, but cuBLAS then picks a faster accumulating kernel. On an H200
    (V=151936, H=4096, bf16) the whole loss ran 59.4 -> 56.0 ms at T=8192 (384-token chunks)
    and 102.2 -> 100.8 ms at T=16384 (768); 4 and 8 slices were slower than 2
    (benchmarks/results/vocab_parallel_h200_fused_slices*_round5.json).

    Args:
        accumulator: [Vl, H], modified in place.
        grad_logits: [C, Vl], the chunk's logits gradient.
        h_chunk: [C, H], the chunk's hidden states.
        halves: force the two-halves form (still only where it applies) or the plain one;
            None decides as above.
    """
    c, vocab = grad_logits.shape
    if halves is None:
        halves = accumulator.is_cuda and accumulator.dtype in (torch.bfloat16, torch.float16)
    halves = (
        halves
        and vocab % 2 == 0
        and accumulator.dtype == grad_logits.dtype
        and grad_logits.is_contiguous()
        and accumulator.is_contiguous()
    )
    if not halves:
        _add_matmul_(accumulator, grad_logits.T, h_chunk)
        return
    acc_halves = accumulator.view(2, vocab // 2, accumulator.shape[1])  # [2, Vl/2, H]
    grad_halves = grad_logits.view(c, 2, vocab // 2).permute(1, 2, 0)  # [2, Vl/2, C], a view
    acc_halves.baddbmm_(grad_halves, h_chunk.unsqueeze(0).expand(2, -1, -1))


def _chunk_logits(h_chunk: Tensor, weight: Tensor) -> Tensor:
    """One chunk's logits [C, Vl] = h_chunk [C, H] @ weight [Vl, H].T, in the inputs' dtype."""
    return h_chunk @ weight.T


def _chunk_matmuls(
    grad_logits: Tensor,
    h_chunk: Tensor,
    weight: Tensor,
    hidden_rows: Tensor | None,
    accumulator: Tensor | None,
    first: bool,
) -> None:
    """Form one chunk's gradients on one rank.

    Its share of the weight gradient is accumulator [Vl, H] += grad_logits.T @ h_chunk (written,
    not added, for the ``first`` chunk of an uninitialised accumulator of the operands' dtype);
    then its hidden-gradient rows are hidden_rows [C, H] = grad_logits [C, Vl] @ weight [Vl, H]
    (in that order, so that ``hidden_rows`` may be ``h_chunk``'s own gathered buffer).
    """
    if accumulator is not None:
        if first and accumulator.dtype == grad_logits.dtype:
            torch.mm(grad_logits.T, h_chunk, out=accumulator)
        else:
            accumulate_weight_grad_(accumulator, grad_logits, h_chunk)
    if hidden_rows is not None:
        _mm_into(grad_logits, weight, hidden_rows)


class _Rows:
    """One chunk's token positions: a slice of all N tokens, or an index into them."""

    __slots__ = ("select",)

    def __init__(self, select: slice | Tensor) -> None:
        self.select = select

    @property
    def index(self) -> Tensor | None:
        """The positions [C] when the chunk is gathered, else None (a slice)."""
        return self.select if isinstance(self.select, Tensor) else None

    def hidden(self, hidden: Tensor) -> Tensor:
        """The chunk's hidden rows [C, H] (a view for a slice, a gathered copy for an index)."""
        return hidden[self.select] if self.index is None else hidden.index_select(0, self.index)

    def grad_rows(self, grad_hidden: Tensor | None, h_chunk: Tensor) -> Tensor | None:
        """Where the chunk's hidden-gradient rows [C, H] are written.

        The rows themselves for a slice; for an index the chunk's gathered hidden rows (no
        longer read once the weight gradient has its share), which :meth:`scatter` puts back,
        or a new buffer when the gradient is wider than the rows (fp32 under autocast).
        """
        if grad_hidden is None:
            return None
        if self.index is None:
            return grad_hidden[self.select]
        if grad_hidden.dtype != h_chunk.dtype:
            return h_chunk.new_empty(h_chunk.shape, dtype=grad_hidden.dtype)
        return h_chunk

    def scatter(self, grad_hidden: Tensor | None, rows: Tensor | None) -> None:
        """Put the buffer of :meth:`grad_rows` into the gradient's rows (a slice wrote them)."""
        if grad_hidden is not None and rows is not None and self.index is not None:
            grad_hidden.index_copy_(0, self.index, rows)


class FusedLinearLoss(torch.autograd.Function):
    """(loss, log_p, entropy) from hidden [N, H], local projection rows [Vl, H], labels, c [N].

    loss = sum_t c_t * log p(label_t) (fp32 scalar, differentiable); log_p [N] fp32 is returned
    for logging only (not differentiable). With a :class:`TokenFunction` in place of c the
    loss is sum_t fn(log p_t, [H_t,] *inputs_t) over the trained tokens, and each chunk's c_t
    (and, when fn reads the entropy H_t, its entropy weight) is fn's derivative at the chunk's
    values, taken as soon as they exist (the two-kernel chunk path); entropy [N] (0 where
    ignored) is returned then, else it is empty. ``need_hidden`` / ``need_weight`` say which
    gradients to form (decided by the caller, from grad mode and ``requires_grad``).
    For 16-bit inputs: ``fp32_logits`` keeps the chunk logits as fp32 matmul outputs (else
    they are rounded to the input dtype, as any matmul returns them, and their gradient
    overwrites them); ``fp32_weight_grad`` sums the weight gradient over the chunks in an fp32
    buffer (else in the weight's dtype: each chunk's partial sum is rounded once).
    ``skip_ignored`` walks only the tokens whose label is not ``ignore_index`` (found with
    :func:`trained_rows`, given ``trained_count`` when the host knows it); the others' hidden
    gradient rows are 0. With a ``compute_dtype`` (autocast's) the matmuls run on copies of
    hidden and weight in that dtype while the gradients keep the inputs' own dtypes: fp32
    master tensors get fp32 gradients from fp32 matmul outputs (the hidden rows) and the fp32
    accumulator, never rounded to 16 bits on the way.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        coefficients: Tensor | TokenFunction,
        plan: Plan,
        need_hidden: bool,
        need_weight: bool,
        fp32_logits: bool,
        fp32_weight_grad: bool,
        skip_ignored: bool,
        trained_count: int | None,
        compute_dtype: torch.dtype | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        hidden_grad_dtype, weight_grad_dtype = hidden.dtype, weight.dtype
        if compute_dtype is not None:  # copies for the matmuls; the gradients keep the inputs'
            hidden, weight = hidden.to(compute_dtype), weight.to(compute_dtype)
        n = hidden.shape[0]
        local_vocab = weight.shape[0]
        inv_t = plan.inv_temperature
        targets = locate_targets(labels, plan=plan, local_vocab=local_vocab)
        function = coefficients if isinstance(coefficients, TokenFunction) else None
        if isinstance(coefficients, Tensor):
            coef = torch.where(targets.valid, coefficients.float(), 0.0)
        else:  # each chunk's derivatives and losses, once its log-probs exist
            token_losses = hidden.new_zeros(n, dtype=torch.float32)
        # Tokens labelled ignore_index add nothing to the loss or either gradient: with
        # ``skip_ignored`` they are left out of the matmuls (their hidden-gradient rows stay 0).
        # Labels are replicated over the vocabulary ranks, so every rank keeps the same tokens.
        rows = None
        if skip_ignored and n:
            rows = trained_rows(targets.valid, trained_count, check=plan.validate)
        m = n if rows is None else rows.shape[0]
        grad_hidden = None
        if need_hidden:
            fill = torch.empty if rows is None else torch.zeros
            grad_hidden = fill(hidden.shape, dtype=hidden_grad_dtype, device=hidden.device)
        accumulator = None
        # The whole vocabulary on this rank, Triton, gradients wanted and the chunk logits in
        # the input dtype: one kernel per chunk does the softmax, the log-probs and the
        # gradient in place (no collective to wait for between them).
        one_kernel = (
            function is None
            and plan.backend == "triton"
            and plan.layout.group is None
            and not fp32_logits
            and local_vocab > 0
            and (need_hidden or need_weight)
        )
        if need_weight:
            acc_dtype = torch.float32 if fp32_weight_grad else weight.dtype
            if one_kernel and acc_dtype == weight.dtype and m:
                # The first chunk's matmul writes every element (no zero fill, no first read).
                accumulator = torch.empty(weight.shape, dtype=acc_dtype, device=weight.device)
            else:
                accumulator = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
        log_p = hidden.new_zeros(n, dtype=torch.float32)
        # Per-token entropy, for a function that reads it (0 where ignored), else empty.
        with_entropy = function is not None and function.with_entropy
        entropy = hidden.new_zeros(n if with_entropy else 0, dtype=torch.float32)
        # Counted once: here without a vocabulary group, else with the first chunk's collective.
        unreduced = unchecked_labels(targets, labels, plan=plan)
        if function is None and not one_kernel:  # the one kernel forms it from coef itself
            g_all = coef * inv_t
        for start in range(0, m, plan.chunk_size):
            stop = min(start + plan.chunk_size, m)
            chunk = _Rows(slice(start, stop) if rows is None else rows[start:stop])
            sel = chunk.select
            h_chunk = chunk.hidden(hidden)
            if one_kernel:
                grad_logits = _chunk_logits(h_chunk, weight)  # overwritten by its gradient
                from vocab_parallel import _triton

                log_p[sel] = _triton.loss_grad_(
                    grad_logits,
                    inv_temperature=inv_t,
                    labels=labels[sel],
                    ignore_index=plan.ignore_index,
                    coefficients=coef[sel],
                )
                hidden_rows = chunk.grad_rows(grad_hidden, h_chunk)
                _chunk_matmuls(grad_logits, h_chunk, weight, hidden_rows, accumulator, start == 0)
                chunk.scatter(grad_hidden, hidden_rows)
                del grad_logits
                continue
            # [C, Vl]: with its gradient, the only logits-sized buffers.
            logits = _mm_fp32(h_chunk, weight.T) if fp32_logits else _chunk_logits(h_chunk, weight)
            index, in_shard = targets.index[sel], targets.in_shard[sel]
            target = logits.new_zeros(stop - start, dtype=torch.float32)
            if local_vocab:
                picked = logits.gather(1, index.unsqueeze(-1)).squeeze(-1)
                target = torch.where(in_shard, scaled_target(picked, inv_t), target)
            if plan.backend == "triton":
                from vocab_parallel import _triton

                stats = _triton.shard_stats(
                    logits, inv_temperature=inv_t, entropy=with_entropy, sum_z=False
                )
            else:  # a copy: the logits are still needed for the gradient
                stats = shard_stats(scaled_fp32(logits, inv_t), entropy=with_entropy, sum_z=False)
            invalid = unreduced if start == 0 else None
            glob = reduce_stats(
                stats, target=target, invalid_labels=invalid, group=plan.layout.group
            )
            if glob.invalid_labels:
                raise_invalid(labels, plan=plan, count=glob.invalid_labels)
            chunk_log_p = (glob.target - glob.shift) - glob.log_sum_exp
            chunk_valid = targets.valid[sel]
            chunk_log_p = torch.where(chunk_valid, chunk_log_p, 0.0)
            log_p[sel] = chunk_log_p
            chunk_entropy = grad_entropy = None
            if glob.entropy is not None:
                chunk_entropy = torch.where(chunk_valid, glob.entropy, 0.0)
                entropy[sel] = chunk_entropy
            if function is None:
                chunk_g = g_all[sel]
            else:
                values, slope, entropy_slope = function.chunk_terms(
                    chunk_log_p,
                    chunk_entropy,
                    chunk_valid,
                    sel,
                    check=plan.validate and start == 0,
                )
                token_losses[sel] = values
                chunk_g = slope * inv_t
                if entropy_slope is not None:
                    grad_entropy = entropy_slope * inv_t
            if grad_hidden is None and accumulator is None:
                continue
            if local_vocab:
                terms = GradTerms(
                    log_normalizer=glob.log_normalizer,
                    grad_all=chunk_g,
                    entropy=glob.entropy if grad_entropy is not None else None,
                    grad_entropy=grad_entropy,
                    target_index=index,
                    target_grad=torch.where(in_shard, chunk_g, 0.0),
                )
                grad_logits = _chunk_logits_grad(logits, terms, plan=plan, dtype=hidden.dtype)
            else:  # a rank without vocabulary rows still joins the hidden-gradient sum
                grad_logits = logits
            del logits
            hidden_rows = chunk.grad_rows(grad_hidden, h_chunk)
            sharded = plan.layout.group is not None
            # The accumulator was zero-filled here: every chunk adds (first=False).
            local_rows = None if sharded else hidden_rows
            _chunk_matmuls(grad_logits, h_chunk, weight, local_rows, accumulator, False)
            if hidden_rows is not None and sharded:
                # Each rank saw only its vocabulary rows: the chunk's hidden gradient is a sum
                # over ranks, taken in fp32 ([C, H], independent of V); h_chunk is no longer
                # read, so the rows may be its gathered buffer.
                partial = _mm_fp32(grad_logits, weight)
                dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=plan.layout.group)
                hidden_rows.copy_(partial)
                del partial
            chunk.scatter(grad_hidden, hidden_rows)
            del grad_logits
        grad_weight = None
        if accumulator is not None:
            grad_weight = accumulator.to(weight_grad_dtype)
            del accumulator
        loss = (coef * log_p).sum() if function is None else token_losses.sum()
        # Not saved with save_for_backward: these are results, handed over once in backward.
        ctx.grads = (grad_hidden, grad_weight)
        ctx.backend = plan.backend
        ctx.mark_non_differentiable(log_p, entropy)
        return loss, log_p, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_loss: Tensor | None, _grad_log_p: Tensor | None, _grad_entropy: Tensor | None
    ) -> tuple:
        if ctx.grads is None:
            raise RuntimeError(
                "backward ran twice through a fused linear loss: its gradients were formed in "
                "forward and handed over by the first backward; call the loss again instead of "
                "retain_graph=True"
            )
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        if grad_loss is not None:
            for grad in (grad_hidden, grad_weight):
                if grad is not None:
                    scale_by_upstream_(grad, grad_loss, backend=ctx.backend)
        return grad_hidden, grad_weight, *([None] * 10)
