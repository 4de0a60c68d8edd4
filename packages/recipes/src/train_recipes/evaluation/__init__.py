"""Held-out measurements shared by the recipes: the held-out loss and greedy exact match."""
