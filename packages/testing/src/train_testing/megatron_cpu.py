"""Test-only patches that let megatron-core 0.16.1 run on CPU processes (gloo), for CI.

megatron-core assumes CUDA in a few places even with the local (non-Transformer-Engine) layer
spec and ``use_cpu_initialization=True``. Each patch below replaces exactly one such place and
says why; nothing else of megatron-core changes, so the numerics under test are its own. Never
use this in a library: on a GPU none of it is needed.

The fourth CUDA assumption named in the project's issue, the default causal mask built with
``device="cuda"`` by the local ``DotProductAttention``, needs no patch here: the recipe's
megatron backend replaces that module by ``SegmentCausalAttention``, which builds no mask.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

__all__ = ["megatron_on_cpu"]


def _cuda_device_is_cpu(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with ``torch.cuda.current_device()`` answering "cpu" while it runs."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with mock.patch.object(torch.cuda, "current_device", return_value="cpu"):
            return fn(*args, **kwargs)

    return wrapper


def _cpu_manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:
    """Stands in for ``model_parallel_cuda_manual_seed``, which seeds (and forks) the CUDA RNG.

    With ``use_cpu_initialization=True`` megatron-core draws initial weights from the CPU RNG,
    and the backend under test runs without dropout, so the CUDA RNG tracker is never read.
    """
    torch.manual_seed(seed)


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Within the block, megatron-core's CUDA-only calls run on the CPU.

    Patches (megatron-core 0.16.1):

    - ``tensor_parallel.random.model_parallel_cuda_manual_seed`` (and its re-export): it calls
      ``torch.cuda.manual_seed`` and the CUDA RNG tracker; replaced by a CPU seed.
    - ``RotaryEmbedding.get_emb``: on its first forward it moves ``inv_freq`` to
      ``torch.cuda.current_device()`` whatever the input's device; run with that answering
      "cpu", so RoPE stays on the CPU.
    - ``GlobalMemoryBuffer.get_tensor``: allocates its shared buffer on
      ``torch.cuda.current_device()``; same treatment.
    """
    from megatron.core import tensor_parallel, utils
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random as mp_random

    rope = rotary_pos_embedding.RotaryEmbedding
    buffer = utils.GlobalMemoryBuffer
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(mp_random, "model_parallel_cuda_manual_seed", _cpu_manual_seed)
        )
        stack.enter_context(
            mock.patch.object(tensor_parallel, "model_parallel_cuda_manual_seed", _cpu_manual_seed)
        )
        stack.enter_context(mock.patch.object(rope, "get_emb", _cuda_device_is_cpu(rope.get_emb)))
        stack.enter_context(
            mock.patch.object(buffer, "get_tensor", _cuda_device_is_cpu(buffer.get_tensor))
        )
        yield
