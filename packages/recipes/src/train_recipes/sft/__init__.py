"""The SFT recipe.

The SPMD entry point (``run``), the recipe's stages (``recipe``), its held-out evaluation and
its summary table.
"""
