"""The records the logits math passes around: per-shard softmax statistics, gradient terms.

# T tokens (rows of one chunk)

Both implementations of the math, the PyTorch one (:mod:`vocab_parallel._math`) and the Triton
kernels (:mod:`vocab_parallel._triton`), fill and read these, so they live apart from both.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["LOG_FLOOR", "GradTerms", "ShardStats"]

# Any log-probability below this already underflows exp() to exactly 0 in fp32 (exp(-104) == 0).
# Clamping to it keeps p * log p at 0 for masked (-inf) logits instead of 0 * -inf = nan, and
# changes no probability.
LOG_FLOOR = -1.0e4


@dataclass(kw_only=True, slots=True)
class ShardStats:
    """Per-token partial statistics of one vocabulary shard (or block), all fp32 [T].

    Attributes:
        max: max of the scaled logits z over the shard; -inf where every entry is -inf.
        sum_exp: sum of exp(z - shift), with shift = max (0 where max is -inf).
        sum_exp_z: sum of exp(z - shift) * (z - shift); None when entropy is not wanted.
        sum_z: sum of z; None when the uniform term (label smoothing) is not wanted.
    """

    max: Tensor
    sum_exp: Tensor
    sum_exp_z: Tensor | None
    sum_z: Tensor | None


@dataclass(kw_only=True, slots=True, frozen=True)
class GradTerms:
    """The per-token inputs of a logits gradient (:func:`chunk_grad`), all [T].

    The upstream gradients are fp32; the callers multiply them by 1 / temperature beforehand,
    which makes the result the gradient w.r.t. the unscaled logits.

    Attributes:
        log_normalizer: global logZ.
        grad_all: upstream gradient of log p_y (zero at ignored positions), for the -p part
            that every vocabulary shard gets; None when log p_y is unused.
        entropy: global entropy H (needed with ``grad_entropy``).
        grad_entropy: upstream gradient of H, or None.
        grad_uniform: upstream gradient of mean_v log p_v, or None.
        target_index: int64 local column of the target (any in-range column where
            ``target_grad`` is 0), or None when no target lives in this shard.
        target_grad: the onehot part: ``grad_all`` where the target is in this shard, else 0.
    """

    log_normalizer: Tensor
    grad_all: Tensor | None = None
    entropy: Tensor | None = None
    grad_entropy: Tensor | None = None
    grad_uniform: Tensor | None = None
    target_index: Tensor | None = None
    target_grad: Tensor | None = None

    def rows(self, span: slice) -> GradTerms:
        """The terms of the tokens in ``span``."""

        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[span]

        return GradTerms(
            log_normalizer=self.log_normalizer[span],
            grad_all=cut(self.grad_all),
            entropy=cut(self.entropy),
            grad_entropy=cut(self.grad_entropy),
            grad_uniform=cut(self.grad_uniform),
            target_index=cut(self.target_index),
            target_grad=cut(self.target_grad),
        )
