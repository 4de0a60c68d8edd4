"""Recipes and the `train-recipes` CLI that combine the workspace's library packages."""

from importlib.metadata import version as _version

__version__ = _version("train-recipes")

__all__ = ["__version__"]
