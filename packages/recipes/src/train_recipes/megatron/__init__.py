"""The recipe's megatron-core backend (``model.backend: megatron``, extra ``train-recipes[megatron]``).

- :mod:`~train_recipes.megatron.model`: a megatron-core ``GPTModel`` for a Llama-style HF config
  (local layer spec, no Transformer Engine) and megatron-core's process groups.
- :mod:`~train_recipes.megatron.attention`: core attention that keeps packed documents apart.
- :mod:`~train_recipes.megatron.convert`: HF Llama weights in, and back out for the export.
- :mod:`~train_recipes.megatron.training`: the data-parallel wrapper, tp-aware clipping through
  the Engine, and the vocab-parallel token-sum loss on energon-sft batches.

Importing this package does not import megatron-core; each function does, with an error naming
the extra when it is missing. Supported: megatron-core 0.16.1, the last release that installs
on Python 3.11 (0.17 and later need Python 3.12).
"""
