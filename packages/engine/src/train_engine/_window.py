"""Where the Engine stands inside one accumulation window, and the misuse it refuses there.

A window is ``length`` micro-batches, each exactly one ``backward()`` followed by one
``step()``; only the last ``step()`` updates. This module holds that state machine (host values
only, so no check costs a device synchronisation) and the loss scaling of the two contracts.
"""

from __future__ import annotations

from torch import Tensor

from train_engine._tokens import token_scaled

__all__ = ["AccumulationWindow"]


class AccumulationWindow:
    """The micro-batch counter of one window and what its backwards have promised so far.

    Args:
        length: micro-batches per optimizer update.

    Attributes:
        length: micro-batches per optimizer update.
        micro_step: index of the current micro-batch (0 .. length-1).
        backward_done: this micro-batch already ran its backward.
        forward_done: this micro-batch ran a forward with gradients through the Engine.
        contract: "mean" or "sum" once the window's first backward ran, else None.
        num_tokens: the window's token count (contract (b)): a checked host value, or a tensor
            on an accelerator; None before the first backward or under contract (a).
    """

    __slots__ = (
        "backward_done",
        "contract",
        "forward_done",
        "length",
        "micro_step",
        "num_tokens",
    )

    def __init__(self, length: int) -> None:
        self.length = 1
        self.micro_step = 0
        self.backward_done = False
        self.forward_done = False
        self.contract: str | None = None
        self.num_tokens: float | Tensor | None = None
        self.set_length(length, static_graph=False)

    @property
    def mid_window(self) -> bool:
        """Whether a window has started (a backward ran, or a micro-batch was stepped past)."""
        return self.micro_step != 0 or self.backward_done

    def is_boundary(self) -> bool:
        """Whether the current micro-batch is the last of its window."""
        return self.micro_step == self.length - 1

    def set_length(self, n: int, *, static_graph: bool) -> None:
        """Change the window length; only between windows.

        Args:
            n: micro-batches per optimizer update, an int >= 1.
            static_graph: the model is a DDP wrapper built with ``static_graph=True``.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {n!r}")
        if self.mid_window:
            raise RuntimeError(
                f"cannot change gradient_accumulation_steps to {n} in the middle of a window "
                f"(micro-batch {self.micro_step + 1} of {self.length}); call it right after "
                "the step() that ended the previous window"
            )
        if n > 1 and static_graph:
            raise ValueError(
                f"gradient_accumulation_steps={n} with a DDP model built with static_graph=True: "
                "DDP's static graph does not support no_sync(); rebuild DDP with static_graph=False"
            )
        self.length = n

    def require_between(self, what: str) -> None:
        """Refuse ``what`` (a method name) in the middle of a window."""
        if self.mid_window:
            raise RuntimeError(
                f"{what}() in the middle of a window (micro-batch {self.micro_step + 1} of "
                f"{self.length}); call it right after the step() that ends a window"
            )

    def check_first_backward(self) -> None:
        """Refuse a second backward in one micro-batch."""
        if self.backward_done:
            raise RuntimeError(
                f"backward() called twice in micro-batch {self.micro_step + 1} of a "
                f"{self.length}-step window, without step() in between: the gradient would "
                "count this micro-batch twice. Call engine.step() after every engine.backward() "
                "(off the window's boundary it only advances the micro-batch); to backpropagate "
                "several losses of one micro-batch, add them and call backward() once"
            )

    def check_forward_seen(self, *, required: bool) -> None:
        """Refuse a backward whose forward bypassed the Engine where the wrapper needs it.

        Args:
            required: the model is DDP with deferred gradient sync, which decides in forward
                whether the backward all-reduces (only a window of several micro-batches
                defers anything).
        """
        if required and self.length > 1 and not self.forward_done:
            raise RuntimeError(
                "backward() under DDP with deferred gradient sync, but this micro-batch's "
                "forward did not go through the Engine; DDP decides in forward whether the "
                "backward all-reduces, so call engine(...) instead of model(...) (or build the "
                "Engine with defer_grad_sync=False)"
            )

    def check_contract(self, num_tokens: int | float | Tensor | None) -> str:
        """The backward's contract ("mean" or "sum"); refuses a switch within the window."""
        contract = "mean" if num_tokens is None else "sum"
        if self.contract is not None and contract != self.contract:
            raise ValueError(
                f"backward(num_tokens={'None' if num_tokens is None else 'given'}) in a window "
                f"that started with the {self.contract!r} contract; use one contract per "
                "window (pass num_tokens on every micro-batch or on none)"
            )
        return contract

    def check_count(self, host_tokens: float | None) -> None:
        """Refuse a host-readable token count that differs from the window's first."""
        reference = self.num_tokens
        if host_tokens is not None and isinstance(reference, float) and host_tokens != reference:
            raise ValueError(
                f"num_tokens changed within a window ({reference:g} then {host_tokens:g}); pass "
                "the whole window's global token count (engine.global_num_tokens) every time"
            )

    def scale(
        self,
        loss: Tensor,
        num_tokens: int | float | Tensor | None,
        host_tokens: float | None,
        *,
        grad_average_size: int | float,
    ) -> Tensor:
        """The loss to backpropagate, scaled for its contract (see ``Engine.backward``).

        Contract (a) divides by the window length, (b) multiplies by the wrapper's averaging
        factor over the window's token count.
        """
        if num_tokens is None:
            return loss / self.length if self.length > 1 else loss
        return token_scaled(
            loss, num_tokens, host_tokens, reference=self.num_tokens, size=grad_average_size
        )

    def record_backward(
        self, contract: str, num_tokens: int | float | Tensor | None, host_tokens: float | None
    ) -> None:
        """Note a backward that ran, with the arguments the checks above accepted."""
        self.contract = contract
        if self.num_tokens is None and num_tokens is not None:
            self.num_tokens = host_tokens if host_tokens is not None else num_tokens
        self.backward_done = True

    def end_micro_batch(self) -> bool:
        """End the micro-batch for ``step()``; whether it was the window's last.

        Off the boundary the counter advances; at the boundary the caller updates and then
        calls :meth:`reset`.

        Raises:
            RuntimeError: no backward since the previous ``step()``.
        """
        if not self.backward_done:
            raise RuntimeError(
                f"step() without a backward() since the previous step() (micro-batch "
                f"{self.micro_step + 1} of a {self.length}-step window); call "
                "engine.backward(loss) once per micro-batch before engine.step()"
            )
        self.backward_done = False
        self.forward_done = False
        if self.is_boundary():
            return True
        self.micro_step += 1
        return False

    def reset(self) -> None:
        """Start a new window (same length)."""
        self.micro_step = 0
        self.backward_done = False
        self.forward_done = False
        self.contract = None
        self.num_tokens = None
