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
        leaves = [log_p.detach()]
        if self.with_entropy:
            if entropy is None:
                raise ValueError("TokenFunction.with_entropy needs the chunk's entropies")
            leaves.append(entropy.detach())
        inputs = [x[select] for x in self.inputs]
        with torch.enable_grad():
            for leaf in leaves:
                leaf.requires_grad_()
            values = self._call([*leaves, *inputs])
            slopes: Sequence[Tensor | None] = [None] * len(leaves)
            if values.requires_grad:  # else the loss depends on none of them: no gradient
                slopes = torch.autograd.grad(values.sum(), leaves, allow_unused=True)
        values = values.detach()
        if check and log_p.shape[0] >= 2:
            self._check_elementwise([*(x.detach() for x in leaves), *inputs], values)
        zero = torch.zeros((), dtype=torch.float32, device=log_p.device)
        grads = [
            torch.zeros_like(log_p) if g is None else torch.where(valid, g.float(), zero)
            for g in slopes
        ]
        values = torch.where(valid, values.float(), zero)
        return values, grads[0], (grads[1] if self.with_entropy else None)

    def _call(self, args: list[Tensor]) -> Tensor:
        """fn(log_p, [entropy,] *inputs), checked to give one value per token."""
        values = self.fn(*args)
        if not isinstance(values, Tensor) or values.shape != args[0].shape:
            got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
            raise ValueError(
                f"token_loss returned {got}; expected one loss per token, shape "
                f"{tuple(args[0].shape)} (an elementwise function of the chunk's log-probs and "
                "token_inputs; reduce over tokens outside it, e.g. through the inputs' weights)"
            )
        return values

    def _check_elementwise(self, args: list[Tensor], values: Tensor) -> None:
        half = args[0].shape[0] // 2
        with torch.no_grad():
            first = self._call([x[:half] for x in args])
            second = self._call([x[half:] for x in args])
        apart = torch.cat([first, second])
        if not torch.allclose(apart.float(), values.float(), rtol=1e-5, atol=1e-6, equal_nan=True):
            raise ValueError(
                "token_loss is not elementwise: its values for a chunk's first tokens change "
                "when it sees only them (a mean, sum or normalisation over tokens inside it?); "
                "compute per-token terms only, and pass any per-sequence or global factor as a "
                "token input (e.g. 1 / sequence length, or 1 / number of trained tokens)"
            )
