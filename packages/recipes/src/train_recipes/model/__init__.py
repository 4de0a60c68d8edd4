"""Building and distributing the model.

Build and LoRA (``build``), meta-device and sharded loading, parallelisation (FSDP2, tensor
parallel, MoE expert parallel), activation checkpointing, attention selection and the VLM
vision tower's kernels.
"""
