"""A per-token loss of log-probs, differentiated one chunk at a time inside the fused forward.

# N tokens, C tokens in a chunk

The grads-in-forward loop needs d loss / d log p_t for a chunk's tokens as soon as their
log-probs exist. For a fixed weighted sum that is the weight itself; for a loss that is any
elementwise function of log p_t (a PPO / GRPO clipped objective, a KL term to reference
log-probs) it is the function's derivative at the chunk's log-probs, which autograd gives from
the chunk's [C] log-probs alone: no logits are involved, so it costs a few [C]-sized ops. A
function may also read each token's softmax entropy H_t (the statistics pass then sums
p * z as well); its derivative in H_t weights the entropy's logits gradient the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

TokenLoss = Callable[..., Tensor]
"""``token_loss(log_p [C] fp32, [entropy [C] fp32,] *inputs [C]) -> [C]``: token t's loss from
its own entries (the entropy argument only when asked for)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenFunction:
    """loss_t = fn(log p_t, [H_t,] *inputs_t) for every trained token.

    Attributes:
        fn: elementwise in the token dimension: output t reads only entry t of each argument.
        inputs: [N] constants (per-token advantages, old log-probs, weights), flattened like
            the labels; each chunk gets its own rows of them.
        with_entropy: fn takes the token's softmax entropy H_t as its second argument.
    """

    fn: TokenLoss
    inputs: tuple[Tensor, ...]
    with_entropy: bool = False

    def chunk_terms(
        self,
        log_p: Tensor,
        entropy: Tensor | None,
        valid: Tensor,
        select: slice | Tensor,
        *,
        check: bool,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(loss_t, d loss_t / d log p_t, d loss_t / d H_t or None) for one chunk.

        All [C] fp32, 0 where not ``valid``; the entropy derivative only ``with_entropy``.

        Args:
            log_p: [C] fp32 log-probs of the chunk (0 where ignored).
            entropy: [C] fp32 entropies (``with_entropy``), else None.
            valid: [C] bool, the tokens with a label.
            select: the chunk's positions among the N tokens (a slice or an index tensor).
            check: also run ``fn`` on the two halves of the chunk and compare (``validate``).

        Raises:
            ValueError: ``fn`` returns no tensor, the wrong shape, or (``check``) values that
                depend on other tokens' entries.
        """
        if self.with_entropy and entropy is None:
            raise ValueError("TokenFunction.with_entropy needs the chunk's entropies")
        inputs = [x[select] for x in self.inputs]
        if self.with_entropy:
            assert entropy is not None
            inputs.insert(0, entropy)
        with torch.enable_grad():
            leaves = [log_p.detach().requires_grad_()]
            if self.with_entropy:
                leaves.append(inputs[0].detach().requires_grad_())
                inputs[0] = leaves[1]
            values = self._call(leaves[0], inputs)
            slopes: Sequence[Tensor | None] = [None] * len(leaves)
            if values.requires_grad:  # else the loss depends on neither: no gradient
                slopes = torch.autograd.grad(values.sum(), leaves, allow_unused=True)
        inputs = [x.detach() for x in inputs]
        if check and log_p.shape[0] >= 2:
            self._check_elementwise(log_p, inputs, values.detach())
        zero = torch.zeros((), dtype=torch.float32, device=log_p.device)
        values = torch.where(valid, values.detach().float(), zero)
        grads = [
            torch.zeros_like(log_p) if g is None else torch.where(valid, g.float(), zero)
            for g in slopes
        ]
        return values, grads[0], (grads[1] if self.with_entropy else None)

    def _call(self, log_p: Tensor, inputs: list[Tensor]) -> Tensor:
        values = self.fn(log_p, *inputs)
        if not isinstance(values, Tensor) or values.shape != log_p.shape:
            got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
            raise ValueError(
                f"token_loss returned {got}; expected one loss per token, shape "
                f"{tuple(log_p.shape)} (an elementwise function of the chunk's log-probs and "
                "token_inputs; reduce over tokens outside it, e.g. through the inputs' weights)"
            )
        return values

    def _check_elementwise(self, log_p: Tensor, inputs: list[Tensor], values: Tensor) -> None:
        half = log_p.shape[0] // 2
        with torch.no_grad():
            first = self._call(log_p[:half], [x[:half] for x in inputs])
            second = self._call(log_p[half:], [x[half:] for x in inputs])
        apart = torch.cat([first, second])
        if not torch.allclose(apart.float(), values.float(), rtol=1e-5, atol=1e-6, equal_nan=True):
            raise ValueError(
                "token_loss is not elementwise: its values for a chunk's first tokens change "
                "when it sees only them (a mean, sum or normalisation over tokens inside it?); "
                "compute per-token terms only, and pass any per-sequence or global factor as a "
                "token input (e.g. 1 / sequence length, or 1 / number of trained tokens)"
            )
