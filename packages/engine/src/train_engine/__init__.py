"""DeepSpeed-style training Engine around an already-distributed PyTorch model: exact accumulation, sharding-aware clipping, DDP/FSDP2 setup, resumable checkpoints."""

from importlib.metadata import version as _version

__version__ = _version("train-engine")

__all__ = ["__version__"]
