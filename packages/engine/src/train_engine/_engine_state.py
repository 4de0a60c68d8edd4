"""The Engine's save and restore: its own counters, and checkpoints of the training state.

A base class of :class:`~train_engine.Engine`, kept apart from the step: these methods only
read the Engine's window and counters and hand the model, optimizer and scheduler to
:mod:`train_engine.checkpoint`. The attributes and the two methods they use are the Engine's,
declared here for the type checker.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from train_engine._counters import UpdateCounters
from train_engine._window import AccumulationWindow

__all__ = ["EngineState"]


class EngineState:
    """``state_dict`` / ``load_state_dict`` and ``save_checkpoint`` / ``load_checkpoint``."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    _window: AccumulationWindow
    _counters: UpdateCounters
    _last_norm: Tensor | None

    def _check_usable(self) -> None:
        raise NotImplementedError  # the Engine's: refuses use after a failed backward

    def set_gradient_accumulation_steps(self, n: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, int]:
        """The Engine's own counters (not model, optimizer or scheduler)."""
        self._counters.settle()
        return {
            "micro_step": self._window.micro_step,
            **self._counters.state_dict(),
            "gradient_accumulation_steps": self._window.length,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore counters saved by :meth:`state_dict`; only between windows."""
        self._window.require_between("load_state_dict")
        # The loaded state replaces the last update's unread skip flag.
        self._counters.drop_pending()
        expected = set(self.state_dict())
        if set(state) != expected:
            raise ValueError(
                f"Engine state keys {sorted(state)} do not match the expected {sorted(expected)}"
            )
        if state["micro_step"] != 0:
            raise ValueError(
                f"the saved Engine state is in the middle of a window (micro_step="
                f"{state['micro_step']}); only states saved between windows can be restored"
            )
        self.set_gradient_accumulation_steps(int(state["gradient_accumulation_steps"]))
        self._counters.load_state_dict(state)

    def save_checkpoint(
        self,
        directory: str | os.PathLike[str],
        *,
        extra_state: Any = None,
        optimizer_state: bool = True,
    ) -> None:
        """Atomically save model, optimizer, scheduler, Engine counters, RNG and caller state.

        Collective: every rank calls it with the same directory (on a filesystem all ranks
        share). See :func:`train_engine.checkpoint.save_checkpoint`.

        Args:
            directory: the checkpoint directory; an earlier checkpoint there is replaced
                atomically. A file or a non-empty directory that is not a checkpoint is
                refused (FileExistsError on every rank), never moved aside.
            extra_state: any picklable per-rank object (e.g. a data loader's state), returned
                on this rank by :meth:`load_checkpoint`.
            optimizer_state: False saves the weights without the optimizer's state; a load
                of it restarts the optimizer from the loaded weights.

        Raises:
            CheckpointWriteError: on every rank, when writing failed on any rank (a full
                disk, any OS error); the partial save was removed, nothing else changed.
        """
        from train_engine.checkpoint import save_checkpoint

        self._check_usable()
        self._window.require_between("save_checkpoint")
        # Settle before the scheduler's state is written (a skipped update restores it).
        self._counters.settle()
        save_checkpoint(
            directory,
            model=self.module,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            engine_state=self.state_dict(),
            extra_state=extra_state,
            optimizer_state=optimizer_state,
        )

    def load_checkpoint(self, directory: str | os.PathLike[str], *, verify: bool = True) -> Any:
        """Restore a checkpoint written by :meth:`save_checkpoint`; returns this rank's extra state.

        Collective. See :func:`train_engine.checkpoint.load_checkpoint`.

        Args:
            directory: the checkpoint directory (:func:`train_engine.complete_checkpoints`).
            verify: check the recorded file checksums before anything is loaded.

        A checkpoint saved with ``optimizer_state=False`` restarts the optimizer from the
        loaded weights (zero moments and steps).

        Raises:
            CheckpointCorruptError: on every rank, with the model, optimizer, scheduler,
                counters and RNG unchanged: load an earlier checkpoint instead.
            FileNotFoundError: no complete checkpoint at ``directory``.
        """
        from train_engine.checkpoint import load_checkpoint

        self._check_usable()
        self._window.require_between("load_checkpoint")
        loaded = load_checkpoint(
            directory,
            model=self.module,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            verify=verify,
        )
        self.load_state_dict(loaded.engine_state)
        self._last_norm = None
        return loaded.extra_state
