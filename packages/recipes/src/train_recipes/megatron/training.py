"""Train a megatron-core ``GPTModel`` through train_engine's Engine.

# B batch, S sequence, T packed tokens, V vocabulary (V / tp per rank)

Which wrapper: PyTorch's DDP over the data-parallel ranks, not Megatron's
``DistributedDataParallel``. Megatron's DDP writes gradients into its own ``param.main_grad``
buffers and expects Megatron's optimizer and ``finalize_model_grads`` to reduce and consume
them (those hard-code CUDA tensors); the Engine steps a plain ``torch.optim`` optimizer on
``param.grad``. What Megatron's ``finalize_model_grads`` would add beyond the data-parallel
all-reduce is not needed here: with one pipeline stage, no sequence parallelism and no
tied embeddings across stages there are no layernorm or embedding gradients to all-reduce over
the tp group (each tp rank computes the replicated layernorms' full gradient itself).

Clipping over the tp group: the weights Megatron splits over tp ranks (``tensor_model_parallel``
attribute) are handed to the Engine as :class:`train_engine.ExpertShards` with the tp group as
the group of disjoint shards and the data-parallel group as the replicas: the Engine then sums
their squared norms over the tp group and counts the replicated weights once, which is
Megatron's own ``get_grad_norm_fp32`` rule, and it all-reduces them over the data-parallel ranks
at the end of each accumulation window (so DDP leaves them out; accumulation windows work as for
any model: no gradient sync until the window's last micro-batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    import torch.distributed as dist
    from megatron.core.models.gpt import GPTModel

    from train_engine import Engine, ExpertShards
    from train_recipes.data.energon_api import ModelBatch

__all__ = [
    "mask_padded_vocab",
    "megatron_token_sum_loss",
    "tensor_parallel_shards",
    "wrap_data_parallel",
]


def tensor_parallel_shards(model: nn.Module) -> ExpertShards | None:
    """The tp-sharded weights of a ``GPTModel`` as ``ExpertShards``, or None when tp == 1.

    Call after megatron-core's process groups exist (:func:`init_megatron_parallel`).
    """
    from megatron.core import parallel_state

    from train_engine import ExpertShards

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    params = tuple(
        p
        for p in model.parameters()
        if p.requires_grad and getattr(p, "tensor_model_parallel", False)
    )
    dp = parallel_state.get_data_parallel_world_size()
    return ExpertShards(
        params=params,
        ep_group=parallel_state.get_tensor_model_parallel_group(),
        replica_group=parallel_state.get_data_parallel_group() if dp > 1 else None,
    )


def wrap_data_parallel(model: nn.Module, *, dp_group: dist.ProcessGroup) -> nn.Module:
    """PyTorch DDP over ``dp_group`` for the replicated weights; tp shards left to the Engine.

    train_engine's ``apply_data_parallel`` refuses ``expert_shards`` with DDP (an unexplained
    wrong result with the all-to-all of expert parallelism), so the wrapper is built here: DDP
    ignores the tp-sharded weights, and the Engine sums them over the data-parallel replicas
    and counts them in the norm (``train_engine.expert_parallel``). The gloo tests check the
    gradients, the norm and the clipped update against float64 autograd on the HF model.
    Without tp the model is a plain DDP model.

    Args:
        model: the ``GPTModel`` on its device.
        dp_group: the data-parallel process group (Megatron's, which matches the recipe's).

    Returns:
        The DDP wrapper (pass it to the Engine).
    """
    from torch.nn.parallel import DistributedDataParallel

    from train_engine.expert_parallel import attach

    shards = tensor_parallel_shards(model)
    if shards is not None:
        ids = {id(p) for p in shards.params}
        ignored = [name for name, p in model.named_parameters() if id(p) in ids]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    device_ids = None
    first = next(model.parameters())
    if first.device.type == "cuda":
        device_ids = [first.device.index]
    wrapped = DistributedDataParallel(
        model,
        process_group=dp_group,
        device_ids=device_ids,
        broadcast_buffers=False,
        # The weights are loaded identically on every replica: nothing to broadcast.
        init_sync=False,
    )
    if shards is not None:
        attach(wrapped, shards)
    return wrapped


def mask_padded_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """Local vocab-parallel logits [..., V / tp] with the vocabulary padding at -inf.

    The padding columns (global index >= ``vocab_size``) then take no probability; the logits
    are returned unchanged when this rank holds none.
    """
    from megatron.core import parallel_state

    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return logits
    padding = torch.arange(start, start + local, device=logits.device) >= vocab_size
    return logits.masked_fill(padding, float("-inf"))


def megatron_token_sum_loss(model: nn.Module | Engine, batch: ModelBatch) -> Tensor:
    """The sum over this rank's trained tokens of -log p(label), for a ``GPTModel``.

    The same loss of contract as the HF backend's ``token_sum_loss``: energon-sft's batch goes
    through :func:`energon_sft.to_megatron_inputs` (packed rows as one THD row with
    ``PackedSeqParams``), and vocab-parallel reads the vocab-parallel logits [B, S, V / tp] in
    place over Megatron's tensor-parallel group.

    Args:
        model: the (DDP-wrapped) ``GPTModel``, or the Engine around it.
        batch: energon-sft's fields on the model's device: ``input_ids``, ``labels`` (shifted,
            -100 untrained), ``position_ids`` [B, S], ``qkv_format``; packed: ``cu_seqlens``
            and ``max_seqlen``.

    Returns:
        0-dim float32 tensor, identical on every tp rank.
    """
    from megatron.core import parallel_state

    from energon_sft import to_megatron_inputs
    from vocab_parallel import token_log_probs

    inputs = to_megatron_inputs(batch)
    logits = model(
        inputs.tokens,
        inputs.position_ids,
        None,  # SegmentCausalAttention is causal per sequence and reads no mask
        packed_seq_params=inputs.packed_seq_params(),
    )  # [B, S, V / tp] or [1, T, V / tp]
    logits = mask_padded_vocab(logits, _vocab_size(model))
    log_p = token_log_probs(
        logits,
        inputs.labels,
        vocab_group=parallel_state.get_tensor_model_parallel_group(),
    )
    return -log_p.sum()


def _vocab_size(model: nn.Module | Engine) -> int:
    """The unpadded vocabulary of the GPTModel inside the Engine / DDP wrappers."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    gpt = cast("GPTModel", model)
    return int(getattr(gpt, "unpadded_vocab_size", gpt.vocab_size))
