"""Independent float64 references (plain log_softmax / F.cross_entropy), one process, and inputs.

A label's log-probability is :func:`train_testing.reference.token_log_probs` (shared by every
package's tests); what only these tests need (entropy, the reductions and label smoothing of
``cross_entropy``, policy losses) is here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from train_testing.reference import IGNORE_INDEX

# The label value every reference and every vocab_parallel call in these tests ignores.
IGNORE = IGNORE_INDEX


def ref_entropy(logits: Tensor, temperature: float) -> Tensor:
    """[...] float64 entropy; masked (-inf) entries contribute 0."""
    log_p = F.log_softmax(logits / temperature, dim=-1)
    finite_log_p = log_p.masked_fill(~torch.isfinite(log_p), 0.0)
    return -(log_p.exp() * finite_log_p).sum(-1)


def ref_cross_entropy(
    logits: Tensor, labels: Tensor, ignore_index: int, reduction: str, label_smoothing: float
) -> Tensor:
    """F.cross_entropy in float64 over the flattened leading dims."""
    v = logits.shape[-1]
    loss = F.cross_entropy(
        logits.reshape(-1, v),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return loss.reshape(labels.shape) if reduction == "none" else loss


def make_logits(
    shape: tuple[int, ...], vocab: int, *, seed: int, masked_columns: int = 0, scale: float = 3.0
) -> Tensor:
    """Random float32 logits [*shape, V] with the first ``masked_columns`` columns at -inf."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=gen) * scale
    if masked_columns:
        logits[..., :masked_columns] = float("-inf")
    return logits


def make_labels(
    shape: tuple[int, ...],
    vocab: int,
    *,
    seed: int,
    low: int = 0,
    ignore_index: int = IGNORE,
    ignore_fraction: float = 0.25,
) -> Tensor:
    """Random int64 labels in [low, V) with about ``ignore_fraction`` set to ``ignore_index``."""
    gen = torch.Generator().manual_seed(seed + 1)
    labels = torch.randint(low, vocab, shape, generator=gen)
    ignored = torch.rand(shape, generator=gen) < ignore_fraction
    return torch.where(ignored, ignore_index, labels)


def upstream(shape: tuple[int, ...], *, seed: int) -> Tensor:
    """Random float64 upstream gradient weights [...]: checks gradients, not just sums."""
    gen = torch.Generator().manual_seed(seed + 2)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def clipped_surrogate(
    log_p: Tensor, old_log_p: Tensor, advantage: Tensor, weight: Tensor
) -> Tensor:
    """Token-level PPO / GRPO clipped policy loss (clip 0.2): -min(r A, clip(r) A) * weight."""
    ratio = torch.exp(log_p - old_log_p)
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)
    return -surrogate * weight


def policy_inputs(log_p: Tensor, *, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """(old log-probs, advantages, weights) [...] fp32 around ``log_p`` (float64, 0 where
    ignored): ratios spread over about [0.5, 2], so some tokens fall in the clipped range
    (no gradient) and some do not."""
    gen = torch.Generator().manual_seed(seed + 3)
    old = log_p + 0.35 * torch.randn(log_p.shape, generator=gen, dtype=torch.float64)
    advantage = torch.randn(log_p.shape, generator=gen, dtype=torch.float64)
    weight = torch.rand(log_p.shape, generator=gen, dtype=torch.float64) + 0.5
    return old.float(), advantage.float(), weight.float()


# The fused linear losses' tests' case: 33 tokens, so chunks of 7 leave a ragged last chunk.
LINEAR_SHAPE, LINEAR_HIDDEN, LINEAR_VOCAB = (3, 11), 24, 150


def linear_case(dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`linear_inputs` of the LINEAR_* sizes."""
    return linear_inputs(LINEAR_SHAPE, LINEAR_HIDDEN, LINEAR_VOCAB, dtype, seed=seed)


def linear_inputs(
    shape: tuple[int, ...], hidden_size: int, vocab: int, dtype: torch.dtype, *, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(hidden [..., H], weight [V, H] (std 0.6), labels [...] with about a quarter ignored)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.6).to(dtype)
    labels = make_labels(shape, vocab, seed=seed, ignore_index=IGNORE)
    return hidden, weight, labels


def clipped_with_entropy_bonus(
    log_p: Tensor, entropy: Tensor, old_log_p: Tensor, advantage: Tensor, weight: Tensor
) -> Tensor:
    """The clipped policy loss minus 0.05 * the token's entropy, both per token * weight."""
    return clipped_surrogate(log_p, old_log_p, advantage, weight) - 0.05 * entropy * weight
