"""Context-parallel batch sharding, token layouts and CP attention backends for PyTorch and Hugging Face models."""

from importlib.metadata import version as _version

__version__ = _version("cp-sharder")

__all__ = ["__version__"]
