"""Fused linear losses whose gradients are formed in forward, never building [N, V].

SFT cross-entropy and weighted log-prob sums, from hidden states and the output projection.

# N tokens (the flattened leading dims [...]), H hidden, V vocabulary

Use these when the loss is a known weighted sum of token log-probs (the weights are given
before backward): three logits-sized matmuls. When log-probs are an output with an unknown
downstream, use :func:`vocab_parallel.linear_token_log_probs` (it recomputes the logits in
backward: four matmuls).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from vocab_parallel._linear_loss_call import fused_loss
from vocab_parallel._sharding import replicated_local
from vocab_parallel._token_function import TokenLoss
from vocab_parallel.losses import Backend
from vocab_parallel.plain_shard import VocabGroup


def fused_linear_token_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    coefficients: Tensor | float,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    validate: bool = False,
    backend: Backend = "auto",
    fp32_logits: bool = False,
    fp32_weight_grad: bool = True,
    skip_ignored: bool = True,
    trained_count: int | None = None,
    return_log_probs: bool = False,
    vocab_group: VocabGroup | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Weighted log-prob sum over tokens, with both gradients formed in forward.

    The loss is sum_t coefficients_t * log p(label_t) under
    softmax(hidden @ weight.T / temperature).

    Forward walks the tokens in chunks: each chunk's logits (one matmul) become its gradient
    in place, then its hidden-gradient rows (a second matmul) and its share of the weight
    gradient (a third); backward only scales the stored gradients by the upstream gradient.
    Extra memory, besides the gradients: one chunk's [C, V_local] logits (in the input dtype
    on the Triton backend; on the torch backend an fp32 copy and an fp32 gradient as well),
    an fp32 [C, H] hidden-gradient chunk under vocabulary sharding, and with
    with ``fp32_weight_grad`` an fp32 weight-sized accumulator during forward (2x a bf16
    weight; the weight's own gradient exists besides it once formed), and with
    ``fp32_logits`` fp32 chunk logits plus a separate gradient buffer (3x the chunk's bf16).

    Under ``torch.autocast`` the matmuls run in autocast's dtype on copies of ``hidden`` and
    ``weight`` made inside the call (the weight's copy is extra memory, as autocast's own
    would be), and the gradients keep the inputs' dtypes: fp32 inputs get fp32 gradients that
    were never rounded to 16 bits (the hidden rows as fp32 matmul outputs, the weight gradient
    as the fp32 accumulator with ``fp32_weight_grad``).

    Args:
        hidden: [..., H] float; plain, or a DTensor that is Replicate on every mesh dim.
        weight: [V, H] same dtype; a DTensor may shard V (``Shard(0)``, e.g. a ColwiseParallel
            lm_head). No bias. ``requires_grad=False`` (a frozen lm_head) skips its gradient.
        labels: [...] integer; ``ignore_index`` positions contribute nothing.
        coefficients: [...] per-token weights c_t (constants: a tensor that requires grad is
            refused), or one number / 0-dim tensor for every token. SFT's summed
            cross-entropy is c = -1 (see :func:`linear_cross_entropy`); a policy-gradient loss
            passes, e.g., -advantage_t / num_tokens.
        temperature: > 0; the logits are divided by it.
        ignore_index: label value without a target.
        chunk_size: tokens per chunk; None picks max(N / 20, 4M / V_local) tokens (rounded
            down to a multiple of 64): one chunk's logits are at most 1/20 of the full logits
            for large N. With the fp32 weight-gradient accumulator (16-bit weight that needs
            a gradient, ``fp32_weight_grad=True``), at least H / 2 tokens: the chunk then
            holds at most a quarter of the accumulator's bytes, and the accumulator (read and
            written once per chunk) is passed over fewer times. Results do not depend on it beyond fp rounding of the weight gradient.
        validate: check the label range (one device-to-host sync).
        backend: "auto", "torch" or "triton" for the per-chunk softmax work between the matmuls
            (see :func:`vocab_parallel.token_log_probs`).
        fp32_logits: for 16-bit inputs, keep each chunk's logits as fp32 matmul outputs
            instead of rounding them to the input dtype (as any matmul, and the unfused
            ``hidden @ weight.T``, returns them): slightly smaller gradient error, 3x the
            chunk memory.
        fp32_weight_grad: for 16-bit weights, sum the weight gradient over the chunks in an
            fp32 buffer; False sums it in the weight's dtype (no extra buffer and half the
            accumulator traffic, but each chunk's partial sum is rounded, which roughly
            triples the weight gradient's error at 24 chunks; the scheme of other fused
            cross-entropy libraries). The hidden gradient is one matmul per chunk either way.
        skip_ignored: leave the tokens labelled ``ignore_index`` out of the matmuls (they add
            nothing to the loss or the gradients; their hidden-gradient rows are 0): in SFT,
            where prompts are not trained, the loss then costs in proportion to the trained
            tokens only. Finding them reads their number back from the device once (the host
            waits for the work queued so far) unless ``trained_count`` is given. False: every
            token goes through the matmuls, and no such read (e.g. under CUDA-graph capture).
        trained_count: the number of labels that are not ``ignore_index``, when the host knows
            it (e.g. counted by the data loader, or copied back asynchronously before the
            model's forward): then skipping needs no read from the device. It must be exact: a
            smaller number would drop trained tokens (``validate=True`` checks it, one read).
        return_log_probs: also return log p(label) [...] (fp32, not differentiable, 0 where
            ignored), e.g. for logging.
        vocab_group: for a plain local weight shard ``[Vl, H]`` (Megatron's output layer): its
            process group (even split) or a :class:`~vocab_parallel.VocabSplit`; None: the
            layout comes from ``weight``.

    Returns:
        The fp32 0-dim loss, identical on every vocabulary rank (and ``log_probs`` when asked).
        The hidden gradient is summed over the vocabulary ranks in forward, so it is the full
        gradient on every rank.

    Raises:
        RuntimeError: a second backward through the same call (``retain_graph=True``).
    """
    loss, log_p, _ = fused_loss(
        hidden,
        weight,
        labels,
        coefficients,
        temperature=temperature,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        validate=validate,
        backend=backend,
        fp32_logits=fp32_logits,
        fp32_weight_grad=fp32_weight_grad,
        skip_ignored=skip_ignored,
        trained_count=trained_count,
        vocab_group=vocab_group,
    )
    return (loss, log_p) if return_log_probs else loss


def fused_linear_log_prob_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    token_loss: TokenLoss,
    token_inputs: Sequence[Tensor] = (),
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    validate: bool = False,
    backend: Backend = "auto",
    fp32_logits: bool = False,
    fp32_weight_grad: bool = True,
    skip_ignored: bool = True,
    trained_count: int | None = None,
    return_log_probs: bool = False,
    with_entropy: bool = False,
    vocab_group: VocabGroup | None = None,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """sum_t token_loss(log p_t, *token_inputs_t) over the trained tokens, gradients in forward.

    For losses that are an elementwise function of each token's log-prob, not a fixed weighted
    sum of them: PPO / GRPO clipped objectives (the ratio exp(log p_t - old_t) needs log p_t),
    KL terms to given reference log-probs, or their sum. Each chunk's log-probs exist before
    its gradient is formed, so the derivative of ``token_loss`` at them (autograd over the
    chunk's [C] log-probs, a few small ops) weights the chunk's softmax gradient, as a fixed
    coefficient does in :func:`fused_linear_token_loss`: three logits-sized matmuls, the same
    memory (and the same autocast behaviour), where log-probs from
    :func:`vocab_parallel.linear_token_log_probs` fed to the same function cost four.

    Example (token-level clipped policy gradient over the trained tokens, normalised by their
    number; ``advantages``, ``old_log_p`` [B, S]):

    .. code-block:: python

        def clipped(log_p, old_log_p, advantage, weight):
            ratio = torch.exp(log_p - old_log_p)
            surrogate = torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)
            return -surrogate * weight

        n = (labels != -100).sum()
        loss = fused_linear_log_prob_loss(
            hidden, lm_head.weight, labels, clipped, (old_log_p, advantages, 1.0 / n)
        )

    Args:
        hidden: [..., H] float; plain, or a DTensor that is Replicate on every mesh dim.
        weight: [V, H] same dtype; may shard V (``Shard(0)``); no bias.
        labels: [...] integer; ``ignore_index`` positions contribute nothing.
        token_loss: ``token_loss(log_p, *inputs) -> losses``: log_p [C] fp32, each input [C]
            fp32 (the chunk's rows of ``token_inputs``), losses [C]. It must be elementwise
            (loss t reads only entry t of each argument), differentiable in ``log_p`` by
            autograd, and free of side effects: it runs once per chunk of C tokens
            (``validate=True`` also runs it on each half of the first chunk and raises if the
            values change). Reductions over tokens, e.g. a per-sequence or global mean, go into
            a weight passed among ``token_inputs``.
        token_inputs: per-token constants [...] (or 0-dim, shared by every token), e.g. old
            log-probs, advantages, reference log-probs, weights; a tensor that requires grad is
            refused.
        temperature: > 0 (as in :func:`fused_linear_token_loss`, so are the arguments below).
        ignore_index: label value without a target.
        chunk_size: tokens per chunk; None picks one.
        validate: check the label range, a given ``trained_count``, and that ``token_loss`` is
            elementwise (device-to-host syncs).
        backend: "auto", "torch" or "triton".
        fp32_logits: keep chunk logits in fp32.
        fp32_weight_grad: sum the weight gradient in fp32.
        skip_ignored: leave ignored tokens out of the matmuls.
        trained_count: the exact number of labels that are not ``ignore_index``, if known.
        return_log_probs: also return log p(label) [...] (fp32, not differentiable), and with
            ``with_entropy`` the entropies [...] too (0 where ignored), e.g. for logging.
        with_entropy: also form each token's softmax entropy H_t (one more fp32 sum in the
            statistics pass over the chunk's logits, no more matmuls) and pass it to
            ``token_loss`` as its second argument, ``token_loss(log_p, entropy, *inputs)``: an
            entropy bonus (-beta * entropy) is then part of the loss, differentiated through
            the logits like the log-prob terms (dH/dz = -p (log p + H) / temperature).
        vocab_group: for a plain local weight shard (Megatron's output layer).

    Returns:
        The fp32 0-dim loss, identical on every vocabulary rank; with ``return_log_probs``
        (loss, log p(label) [...]), and with ``with_entropy`` as well (loss, log p, entropy).
        Backward scales the stored gradients by the upstream gradient.

    Raises:
        ValueError: ``token_loss`` returns another shape or (``validate``) is not elementwise;
            a token input of the wrong shape or requiring grad.
        TypeError: ``token_loss`` is not callable.
        RuntimeError: a second backward through the same call.
    """
    loss, log_p, entropy = fused_loss(
        hidden,
        weight,
        labels,
        (token_loss, tuple(token_inputs), with_entropy),
        temperature=temperature,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        validate=validate,
        backend=backend,
        fp32_logits=fp32_logits,
        fp32_weight_grad=fp32_weight_grad,
        skip_ignored=skip_ignored,
        trained_count=trained_count,
        vocab_group=vocab_group,
    )
    if not return_log_probs:
        return loss
    return (loss, log_p) if entropy is None else (loss, log_p, entropy)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    reduction: Literal["mean", "sum"] = "mean",
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    validate: bool = False,
    backend: Backend = "auto",
    fp32_logits: bool = False,
    fp32_weight_grad: bool = True,
    skip_ignored: bool = True,
    trained_count: int | None = None,
    vocab_group: VocabGroup | None = None,
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T / temperature, labels)``, gradients formed in forward.

    The values of ``F.cross_entropy`` over the flattened tokens: "sum" adds the token losses,
    "mean" divides by the number of non-ignored labels (nan when all are ignored, as PyTorch).
    For a loss normalised by a token count known elsewhere (gradient accumulation over
    micro-batches and ranks), take "sum" and scale the result: ``loss_sum / num_tokens``
    backpropagates 1 / num_tokens, and backward multiplies the stored gradients by it.

    Args:
        hidden: as in :func:`fused_linear_token_loss` (so are the arguments below).
        weight: [V, H], may shard V.
        labels: [...] integer.
        temperature: > 0.
        ignore_index: label value without a target.
        chunk_size: tokens per chunk; None picks one.
        validate: check the label range (one host sync).
        backend: "auto", "torch" or "triton".
        fp32_logits: keep chunk logits in fp32.
        fp32_weight_grad: sum the weight gradient in fp32.
        skip_ignored: leave ignored tokens out of the matmuls (one read of their number from
            the device unless ``trained_count`` is given).
        trained_count: the exact number of labels that are not ``ignore_index``, if known.
        vocab_group: as in :func:`fused_linear_token_loss`.
        reduction: "mean" or "sum" (per-token losses: use
            :func:`vocab_parallel.linear_token_log_probs`).

    Returns:
        fp32 0-dim loss, identical on every vocabulary rank.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"reduction must be 'mean' or 'sum', got {reduction!r}; for per-token losses use "
            "linear_token_log_probs"
        )
    coefficients: Tensor | float = -1.0
    valid_count = None
    if reduction == "mean":
        local_labels = replicated_local(labels, name="labels")
        valid_count = (local_labels != ignore_index).sum()
        # -1 / count folded into the per-token weights: the gradients are formed already
        # divided, so backward gets an upstream gradient of exactly 1.
        coefficients = -1.0 / valid_count.clamp(min=1).to(torch.float32)
    loss, _, _ = fused_loss(
        hidden,
        weight,
        labels,
        coefficients,
        temperature=temperature,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        validate=validate,
        backend=backend,
        fp32_logits=fp32_logits,
        fp32_weight_grad=fp32_weight_grad,
        skip_ignored=skip_ignored,
        trained_count=trained_count,
        vocab_group=vocab_group,
    )
    if valid_count is not None:
        loss = torch.where(valid_count > 0, loss, torch.full_like(loss, float("nan")))
    return loss
