"""Context-parallel batch sharding, token layouts and CP attention backends for PyTorch and Hugging Face models.

Public API: :class:`ContextParallelSharder`, the :class:`ShardResult` of its ``shard()`` and its
:class:`ShardLayout`, and :func:`checkpoint_context_fn` (activation checkpointing inside
``train_ctx``). Index math lives in
:mod:`cp_sharder.layouts`, attention backends in :mod:`cp_sharder.attention`; the loss
normalisation contract is in ``ContextParallelSharder.num_label_tokens``.
"""

from importlib.metadata import version as _version

from cp_sharder.backends import checkpoint_context_fn
from cp_sharder.sharder import ContextParallelSharder, ShardLayout, ShardResult

__version__ = _version("cp-sharder")

__all__ = [
    "ContextParallelSharder",
    "ShardLayout",
    "ShardResult",
    "__version__",
    "checkpoint_context_fn",
]
