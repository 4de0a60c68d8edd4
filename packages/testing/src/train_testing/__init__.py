"""Test helpers shared by the workspace's packages (unpublished).

- :func:`run_on_ranks` / :class:`RankPool`: run a function on N real gloo (or NCCL) processes.
- ``rank_pool`` pytest fixture: session-wide pools, one per world size.
- :func:`requires_cuda` / :func:`requires_module`: skip markers that state their reason.
- :mod:`train_testing.bench`: what the benchmark scripts share (imported on its own, no pytest).
- :mod:`train_testing.tiny_hf`: tiny random-init Hugging Face models from a config (lazy transformers).
- :mod:`train_testing.package_checks`: a published package's version and ``__all__`` checks.
"""

from train_testing.markers import requires_cuda, requires_module
from train_testing.ranks import RankError, RankFailure, RankPool, run_on_ranks

__all__ = [
    "RankError",
    "RankFailure",
    "RankPool",
    "requires_cuda",
    "requires_module",
    "run_on_ranks",
]
