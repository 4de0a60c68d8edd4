"""Expert-parallel MoE token dispatch (all-to-all, HybridEP) with per-rank token equalization and router replay."""

from importlib.metadata import version as _version

__version__ = _version("moe-dispatch")

__all__ = ["__version__"]
