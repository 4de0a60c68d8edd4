"""The SFT token-sum loss.

The model path of one batch (``token_loss``) and the fused path that never forms the [B, S, V]
logits (``fused_loss``).
"""
