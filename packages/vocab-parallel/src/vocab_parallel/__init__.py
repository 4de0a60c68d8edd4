"""Token log-probs, entropy and cross-entropy over dense or vocab-sharded DTensor logits, without gathering the vocabulary."""

from importlib.metadata import version as _version

__version__ = _version("vocab-parallel")

__all__ = ["__version__"]
