"""What the recipes train on.

energon-sft's data API (``energon_api``, the one place that touches it), tokenizers and chat
templates, direct chat-file inputs and their cache, the data report, the per-replica loader,
the local data plane and the embedded demo task.
"""
