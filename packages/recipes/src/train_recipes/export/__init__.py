"""Hugging Face export of a trained model.

Plain, converted MoE, LoRA, streamed from sharded ranks, and the ``train-recipes export``
command.
"""
