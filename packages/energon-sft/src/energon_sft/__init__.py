"""Multimodal SFT data path on Megatron-Energon: cookers, task encoders, exact loss masks, resumable rank-aware loaders."""

from importlib.metadata import version as _version

__version__ = _version("energon-sft")

__all__ = ["__version__"]
