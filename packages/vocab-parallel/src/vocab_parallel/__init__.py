"""Token log-probs, entropy and cross-entropy over dense or vocab-sharded DTensor logits, without gathering the vocabulary."""

from importlib.metadata import version as _version

from vocab_parallel.linear_loss import (
    fused_linear_log_prob_loss,
    fused_linear_token_loss,
    linear_cross_entropy,
)
from vocab_parallel.losses import (
    cross_entropy,
    linear_token_log_probs,
    token_entropy,
    token_log_probs,
    token_log_probs_and_entropy,
)
from vocab_parallel.plain_shard import VocabSplit

__version__ = _version("vocab-parallel")

__all__ = [
    "VocabSplit",
    "__version__",
    "cross_entropy",
    "fused_linear_log_prob_loss",
    "fused_linear_token_loss",
    "linear_cross_entropy",
    "linear_token_log_probs",
    "token_entropy",
    "token_log_probs",
    "token_log_probs_and_entropy",
]
