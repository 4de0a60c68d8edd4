"""Per-token log-probs of given labels under a causal LM, and their sums per sequence or segment.

What preference and policy-gradient losses are built from (DPO's sequence log-probs, GRPO's
ratios): differentiable log-probs whose downstream mixes tokens, so they come from
vocab-parallel's recompute form (``linear_token_log_probs``) on the final hidden states and
the head's weight where the head allows it (no [B, S, V] logits), else from the materialised
logits (``token_log_probs``). Both work on vocabulary-sharded (tensor-parallel) heads.

# B batch, S (local) sequence, H hidden, V vocabulary, N segments
"""

from __future__ import annotations

from torch import Tensor, nn

from train_recipes.loss.fused_loss import CausalLM, ModelInputs, hidden_and_head_weight

__all__ = ["segment_sums", "sequence_sums", "token_log_probs_of"]

IGNORE_INDEX = -100


def token_log_probs_of(
    model: CausalLM,
    head: nn.Linear | None,
    inputs: ModelInputs,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> Tensor:
    """The log-prob of every position's label under ``model``, through vocab-parallel.

    Args:
        model: the Engine, a DDP/FSDP2 wrapper or the model itself (a frozen reference under
            ``torch.no_grad`` too).
        head: :func:`train_recipes.loss.fused_loss.fused_head` of ``model``; with a head the
            model's output projection passes its hidden states through and the log-probs are
            formed chunk by chunk from them and ``head.weight`` (recomputed in backward); None
            reads the [B, S, V] logits.
        inputs: the model's keyword inputs (``input_ids`` [B, S], ``position_ids`` ...; no
            labels).
        labels: [B, S] int64, already shifted (position t holds the token t+1), -100 where
            nothing is scored.
        temperature: the log-probs are those of softmax(logits / temperature).
        chunk_tokens: tokens per chunk of the fused form (None: vocab-parallel's default).

    Returns:
        [B, S] float32, 0 (and zero gradient) where ``labels == -100``; the same on every
        vocabulary (tensor-parallel) rank.

    Raises:
        ValueError: the head's weight is still sharded by data parallelism when it is read
            (the head in an FSDP2 unit of its own).
    """
    import vocab_parallel as vp

    if head is None:
        logits = model(**inputs, use_cache=False).logits  # [B, S, V]
        return vp.token_log_probs(logits, labels, temperature=temperature)
    hidden, weight = hidden_and_head_weight(model, head, inputs)  # [B, S, H], [V, H]
    return vp.linear_token_log_probs(
        hidden, weight, labels, temperature=temperature, chunk_size=chunk_tokens
    )


def sequence_sums(token_log_p: Tensor, labels: Tensor) -> Tensor:
    """Sum of each row's scored log-probs.

    Args:
        token_log_p: [B, S] from :func:`token_log_probs_of` (0 at ignored positions).
        labels: [B, S], -100 where nothing is scored.

    Returns:
        [B] float32 (differentiable).
    """
    return (token_log_p * (labels != IGNORE_INDEX)).sum(dim=-1)


def segment_sums(token_log_p: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Sum of the log-probs of each segment (e.g. each answer of a packed row).

    Args:
        token_log_p: [B, S] (0 at ignored positions).
        segment_ids: [B, S] int64 in [0, num_segments), or -1 for positions of no segment.
        num_segments: N.

    Returns:
        [N] float32 (differentiable); a segment with no position sums to 0.
    """
    flat_ids = segment_ids.reshape(-1)
    keep = flat_ids >= 0
    out = token_log_p.new_zeros(num_segments, dtype=token_log_p.dtype)
    return out.index_add(0, flat_ids[keep], token_log_p.reshape(-1)[keep])
