"""The SFT token-sum loss without the [B, S, V] logits.

The model runs with its output projection passed through, and vocab-parallel's grads-in-forward
linear cross-entropy turns the final hidden states and the projection weight into the loss and
both gradients, chunk by chunk. By default it forms only the trained positions (its
``skip_ignored``, given their number counted without a host sync by
``train_recipes.data.trained_rows``): the head's three logits-sized matmuls per token are not spent
on prompts, padding and image tokens.

# B batch, S (local) sequence, H hidden, V vocabulary, K trained positions

Used where it computes the same loss: an ``nn.Linear`` head without bias and no logit
transform after it (no final logit soft-capping). Otherwise the logits are materialised and
read by ``vocab_parallel.token_log_probs``, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol, TypeAlias

import torch
from torch import Tensor, nn

from train_recipes.data.trained_rows import TrainedRows

#: The model's keyword inputs: token tensors, and ``qkv_format`` ("thd") for packed rows.
ModelInputs: TypeAlias = dict[str, Tensor | str]


class _LogitsOutput(Protocol):
    logits: Tensor  # [B, S, V], a DTensor sharded over V under tensor parallelism


class CausalLM(Protocol):
    """What the loss calls: a transformers causal LM, its DDP/FSDP2 wrapper or the Engine."""

    def __call__(self, **inputs: Tensor | str | bool) -> _LogitsOutput:
        """The forward, with the batch's tensors (and ``qkv_format``) as keywords."""
        ...


# Config attributes of transformers models that transform the logits after the head (the fused
# loss would skip them, so such models keep the logits path).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def fused_head(model: CausalLM) -> nn.Linear | None:
    """The output projection the fused loss can replace, or None where it would change the loss.

    Args:
        model: the Engine, a DDP wrapper or the (FSDP2 / tensor-parallel) transformers model.
    """
    inner = model
    for _ in range(2):  # the Engine holds the model (DDP or FSDP2), DDP holds the model
        if getattr(inner, "find_unused_parameters", False):
            # DDP would mark the head's weight unused (the forward no longer reaches it) and
            # then see its gradient arrive.
            return None
        inner = getattr(inner, "module", inner)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # peft
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear or head.bias is not None:
        return None
    config = getattr(base, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if any(getattr(cfg, name, None) not in (None, 1.0) for name in _LOGIT_TRANSFORMS):
            return None
    return head


@contextlib.contextmanager
def _head_passes_hidden(head: nn.Linear) -> Iterator[None]:
    """Make ``head(x)`` return ``x`` within the block.

    The model's ``logits`` are then its final hidden states [B, S, H]. The module's hooks
    (FSDP2's, tensor parallelism's) still run around it.
    """
    head.forward = _identity  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del head.forward


def _identity(x: Tensor) -> Tensor:
    return x


def _keep_root_unsharded_after_forward(model: CausalLM) -> None:
    """Keep the root FSDP2 unit, which holds the head, unsharded after forward.

    The loss reads the head's weight after the model's forward. The root's parameters are the
    first that backward needs anyway, which is why FSDP2 keeps a root unsharded by default.
    Blocks keep their setting.
    """
    from torch.distributed.fsdp import FSDPModule

    inner = getattr(model, "module", model)  # the Engine holds the FSDP2 model
    if isinstance(inner, FSDPModule):
        inner.set_reshard_after_forward(False, recurse=False)


def hidden_and_head_weight(
    model: CausalLM, head: nn.Linear, inputs: ModelInputs
) -> tuple[Tensor, Tensor]:
    """The model's final hidden states and the weight of its output projection ``head``.

    The forward runs with ``head`` passed through (:func:`_head_passes_hidden`), so no logits
    are formed; a loss then reads both through vocab-parallel's linear forms.

    Args:
        model: what the recipe calls (the Engine, a wrapper, or the unwrapped model).
        head: :func:`fused_head` of it.
        inputs: the model's keyword inputs (no labels).

    Returns:
        hidden [B, S, H] (replicated over the tensor-parallel ranks) and ``head.weight``
        [V, H] (a vocabulary shard under tensor parallelism).

    Under FSDP2 the root unit is set to stay unsharded after forward (only the root: blocks
    keep their ``reshard_after_forward``), so that the head's weight is the gathered one.

    Raises:
        ValueError: the head's weight is still sharded by data parallelism when it is read
            (e.g. the head in an FSDP2 unit of its own that resharded after forward), which
            would read as vocabulary shards.
    """
    from torch.distributed.tensor import DTensor, Replicate

    _keep_root_unsharded_after_forward(model)
    with _head_passes_hidden(head):
        hidden = model(**inputs, use_cache=False).logits  # [B, S, H]
    weight = head.weight
    if isinstance(hidden, DTensor):
        # Tensor parallel: ColwiseParallel's output hook split the passed-through hidden states
        # over their last dim; every vocabulary rank needs all of them.
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    if isinstance(weight, DTensor) and (
        not isinstance(hidden, DTensor) or weight.device_mesh != hidden.device_mesh
    ):
        raise ValueError(
            f"the output projection's weight is a DTensor on mesh {weight.device_mesh} with "
            f"{weight.placements} after forward, not the tensor-parallel vocabulary shards; "
            "leave the output projection in the root FSDP2 unit (as apply_data_parallel does), "
            "not in a unit of its own"
        )
    return hidden, weight


def fused_token_sum_loss(
    model: CausalLM,
    head: nn.Linear,
    inputs: ModelInputs,
    labels: Tensor,
    *,
    chunk_tokens: int | None = None,
    trained_only: bool = True,
) -> Tensor:
    """Sum over the trained tokens of -log p(label), from the hidden states and ``head.weight``.

    Args:
        model: what the recipe calls (the Engine, or the unwrapped model for evaluation).
        head: :func:`fused_head` of it.
        inputs: the model's keyword inputs (no labels).
        labels: [B, S] already shifted, -100 where nothing is trained.
        chunk_tokens: tokens per chunk of the loss (``model.fused_loss_chunk_tokens``); None:
            vocab-parallel's default.
        trained_only: the loss forms only the K trained positions (vocab-parallel's
            ``skip_ignored`` with ``trained_count=K``, K counted before the forward;
            ``model.fused_loss_trained_only``): the same loss and gradients up to summation
            order, without a host sync, under tensor parallelism too. False: every position
            goes through the head's matmuls.

    Returns:
        0-dim float32 tensor; its gradients were formed in forward (backward scales them).

    Under FSDP2 the root unit is set to stay unsharded after forward (only the root: blocks
    keep their ``reshard_after_forward``), so that the head's weight is the gathered one.

    Raises:
        ValueError: the head's weight is still sharded by data parallelism when the loss reads
            it (e.g. the head in an FSDP2 unit of its own that resharded after forward), which
            would read as vocabulary shards.
    """
    import vocab_parallel as vp

    # Counted before the forward is launched: by the time the forward is queued the count has
    # reached the host, and reading it costs no wait.
    rows = TrainedRows(labels) if trained_only else None
    hidden, weight = hidden_and_head_weight(model, head, inputs)
    # The head's gradient is summed over the chunks in its own dtype, not in an fp32 buffer
    # the size of the head (1 GiB for a 128k x 2048 head) that would be alive at the end of
    # forward, with every activation: the peak. Its error stays at the bf16 rounding floor
    # (1.71e-3 against 1.67e-3 at T=16384, V=151936 in BENCHMARKS.md), and FSDP2 reduces it
    # into fp32 as before.
    return vp.linear_cross_entropy(
        hidden,
        weight,
        labels,
        reduction="sum",
        chunk_size=chunk_tokens,
        fp32_weight_grad=False,
        skip_ignored=rows is not None,
        trained_count=None if rows is None else rows.count(),
    )


def logits_token_sum_loss(model: CausalLM, inputs: ModelInputs, labels: Tensor) -> Tensor:
    """The token-sum loss read from the materialised [B, S, V] logits (vocab-parallel)."""
    from vocab_parallel import token_log_probs

    logits = model(**inputs, use_cache=False).logits  # [B, S, V]
    return -token_log_probs(logits, labels).sum()


def token_sum_loss_with(
    model: CausalLM,
    head: nn.Linear | None,
    inputs: ModelInputs,
    labels: Tensor,
    *,
    chunk_tokens: int | None = None,
    trained_only: bool = True,
) -> Tensor:
    """The recipe's token-sum loss for a resolved ``head``: fused with gradients, else logits.

    ``head``: :func:`fused_head` of the training model (None: the logits path). The fused loss
    runs only with gradients enabled (evaluation reads the logits). ``chunk_tokens``: tokens
    per chunk of the fused loss (None: vocab-parallel's default); ``trained_only``: the fused
    loss sees only the trained positions (see :func:`fused_token_sum_loss`).
    """
    if head is not None and torch.is_grad_enabled():
        return fused_token_sum_loss(
            model, head, inputs, labels, chunk_tokens=chunk_tokens, trained_only=trained_only
        )
    return logits_token_sum_loss(model, inputs, labels)


def token_sum_loss_of(
    model: CausalLM,
    inputs: ModelInputs,
    labels: Tensor,
    *,
    chunk_tokens: int | None = None,
    trained_only: bool = True,
) -> Tensor:
    """:func:`token_sum_loss_with` the head resolved on this call.

    A run resolves it once (:class:`train_recipes.loss.token_loss.TokenSumLoss`).
    """
    return token_sum_loss_with(
        model,
        fused_head(model),
        inputs,
        labels,
        chunk_tokens=chunk_tokens,
        trained_only=trained_only,
    )
