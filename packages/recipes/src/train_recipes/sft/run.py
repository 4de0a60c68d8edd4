"""The SFT recipe, with metrics, checkpoints, resume and HF export.

energon-sft data -> (cp-sharder) -> HF causal LM -> vocab-parallel token-sum loss ->
train_engine.Engine (DDP or FSDP2).

:func:`run_sft` is the SPMD loop: every rank drives its own :class:`SFTRecipe` (the stages, in
:mod:`train_recipes.sft.recipe`) through :func:`train_recipes.loop.drive.drive`.
"""

from __future__ import annotations

import torch.distributed as dist

from train_recipes.config.sft import SFTConfig
from train_recipes.loop.drive import drive
from train_recipes.loss.token_loss import token_sum_loss
from train_recipes.run.folder import CHECKPOINT_DIR, EXPORT_DIR
from train_recipes.run.preemption import SignalTrap, stop_vote, stopped_error
from train_recipes.sft.recipe import SFTRecipe
from train_recipes.sft.summary import SFTResult, sft_summary_text

__all__ = ["CHECKPOINT_DIR", "EXPORT_DIR", "SFTRecipe", "SFTResult", "run_sft", "token_sum_loss"]


def run_sft(
    config: SFTConfig, *, resume: bool = False, signals: SignalTrap | None = None
) -> SFTResult:
    """Run the SFT recipe on the already-launched ranks (or one process).

    The SPMD loop: every rank drives its own :class:`SFTRecipe` through
    :func:`train_recipes.loop.drive.drive`; rank 0 logs.

    Args:
        config: a validated config.
        resume: continue from the newest complete checkpoint in ``train.output_dir`` (a clean
            start, with a message, when there is none; a finished run returns at once). The
            caller checks the folder first (``run_folder.check_output_dir``, under its lock).
        signals: this process's installed trap: a signal it records stops the run at the
            next step boundary, with a checkpoint (:mod:`train_recipes.run.preemption`).

    Returns:
        The run summary, identical on every rank.

    Raises:
        TrainingAborted: on every rank, e.g. after ``train.max_consecutive_skips`` skips.
        RunStopped: on every rank, after the checkpoint of the step the ranks stopped at.
    """
    with SFTRecipe(config, resume=resume) as recipe:
        start = recipe.setup()
        vote = None if signals is None else stop_vote(signals)
        outcome = drive(
            recipe,
            start,
            is_main=recipe.is_main,
            format_summary=sft_summary_text,
            stop_vote=vote,
        )
        dist.barrier()
        if outcome.stopped is not None:
            raise stopped_error(outcome.stopped, config.train.output_dir)
        return recipe.result(outcome)
