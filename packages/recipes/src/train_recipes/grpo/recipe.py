"""The GRPO recipe: the policy update of GRPO/PPO from rollouts, on the Engine.

rollouts (the policy's own samples, or a rollout file) -> group-normalised advantages ->
old and reference log-probs -> ``update_epochs * minibatches`` optimizer steps of the clipped
policy loss (vocab-parallel's fused linear log-prob loss) through the Engine's token-sum
contract. A loop step is one optimizer step; the rollout buffer lives across the steps of its
batch and goes into the checkpoints with the source's position and generator.

:func:`run_grpo` is the SPMD loop: every rank drives its own :class:`GRPORecipe` through
:func:`train_recipes.loop.drive.drive`, in lock-step.

# N samples on this rank, S row length
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from train_recipes.config.grpo import GRPOConfig, policy_sft_config
from train_recipes.data.demo import demo_chats, read_jsonl
from train_recipes.data.energon_api import ChatRow
from train_recipes.data.processors import load_tokenizer
from train_recipes.evaluation.exact_match import exact_match_accuracy
from train_recipes.export.hf import export_hf
from train_recipes.grpo.buffer import RolloutBuffer, collate_rollouts, minibatch_tokens
from train_recipes.grpo.checkpoint import GRPORecords, restore_grpo, save_grpo
from train_recipes.grpo.rollout_file import FileRollouts, read_rollout_file
from train_recipes.grpo.rollouts import RolloutSource
from train_recipes.grpo.sampler import PolicySampler
from train_recipes.grpo.update import buffer_log_probs, step_statistics
from train_recipes.loop.drive import drive
from train_recipes.loop.records import LoopOutcome, LoopPlan, RunEnd, RunStart, StepRecord
from train_recipes.loss.fused_loss import fused_head
from train_recipes.loss.policy_loss import policy_loss_of
from train_recipes.model.build import unwrap
from train_recipes.model.parallelize import build_parallel_model
from train_recipes.model.reference import build_reference_model, check_same_vocabulary
from train_recipes.run.folder import EXPORT_DIR, publish_dir, staging_dir
from train_recipes.run.process_group import init_distributed
from train_recipes.run.runtime import build_optimizer, open_run_folder, write_run_config

if TYPE_CHECKING:
    from torch import nn

    from train_engine import Engine

__all__ = ["GRPORecipe", "GRPOResult", "grpo_summary_text", "run_grpo"]

IGNORE_INDEX = -100


@dataclass(kw_only=True, slots=True, frozen=True)
class GRPOResult:
    """What a GRPO run reports (the same on every rank).

    Attributes:
        output_dir: the run directory.
        accuracy_before: held-out exact match before the first update (None without rows).
        accuracy_after: held-out exact match after the last one.
        first_loss: the first logged loss.
        last_loss: the last logged loss.
    """

    output_dir: Path
    accuracy_before: float | None
    accuracy_after: float | None
    first_loss: float | None
    last_loss: float | None


def run_grpo(config: GRPOConfig, *, resume: bool = False) -> GRPOResult:
    """Run the GRPO recipe on the already-launched ranks (or one process).

    Args:
        config: a validated config.
        resume: continue from the newest complete checkpoint in ``train.output_dir``.
    """
    recipe = GRPORecipe(config, resume=resume)
    start = recipe.setup()
    outcome = drive(recipe, start, is_main=recipe.is_main, format_summary=grpo_summary_text)
    dist.barrier()
    return recipe.result(outcome)


def grpo_summary_text(end: RunEnd, output_dir: Path, png: Path | None) -> str:
    """The closing lines: exact match and reward before and after, the loss plot."""
    s = end.summary

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    return (
        f"\nrun          {output_dir}\nranks        {s['world_size']}\n"
        f"steps        {s['steps']} optimizer steps on {s['rollout_batches']} rollout batches "
        f"({s['source']})\n"
        f"reward       {pct(s['reward_first'])} -> {pct(s['reward_last'])} (batch mean)\n"
        f"exact match  {pct(s['accuracy_before'])} -> {pct(s['accuracy_after'])} "
        "(held-out, greedy)\n"
        f"loss curve   {png if png is not None else '-'}"
    )


class GRPORecipe:
    """The GRPO recipe on one rank, as the stages :func:`train_recipes.loop.drive.drive` calls.

    Args:
        config: a validated config.
        resume: continue from the newest complete checkpoint.
    """

    def __init__(self, config: GRPOConfig, *, resume: bool = False) -> None:
        self.config = config
        self.resume = resume
        self._buffer: RolloutBuffer | None = None
        self._records = GRPORecords()
        self._accuracy_after: float | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0 (valid after :meth:`setup`)."""
        return self.ctx.is_main

    @property
    def _updates_per_batch(self) -> int:
        return self.config.rollout.update_epochs * self.config.rollout.minibatches

    # ------------------------------------------------------------------------------- setup

    def setup(self) -> RunStart:
        """Process groups, tokenizer, policy (and reference), Engine, rollout source; resume."""
        from train_engine import Engine, LossWindow

        config, train = self.config, self.config.train
        ctx = self.ctx = init_distributed(
            device_preference=train.device, cp=1, tp=config.parallel.tp
        )
        out_dir = self.out_dir = open_run_folder(train.output_dir, is_main=ctx.is_main)
        write_run_config(out_dir, config, is_main=ctx.is_main)
        torch.manual_seed(train.seed)
        sft = policy_sft_config(config)
        self.tokenizer = load_tokenizer(sft)
        model = self.model = build_parallel_model(sft, self.tokenizer, ctx)
        optimizer, self._scheduler = build_optimizer(
            model, config.optim, device=ctx.device, total_steps=train.steps
        )
        self.engine: Engine = Engine(
            model,
            optimizer,
            self._scheduler,
            max_grad_norm=config.optim.max_grad_norm,
            nonfinite=config.optim.nonfinite,
            dp_group=ctx.mesh["dp"].get_group(),
        )
        self._head = fused_head(self.engine)
        self.reference: nn.Module | None = None
        if config.loss.kl_coef:
            self.reference = build_reference_model(
                sft,
                self.tokenizer,
                ctx,
                init_seed=train.seed if config.model.path is None else None,
            )
            check_same_vocabulary(model, self.reference)
        prompts, self._eval_rows = self._prompts()
        self.source = self._source(prompts)
        self._dp_group = ctx.mesh["dp"].get_group()
        self.window = LossWindow(train.loss_window, group=self._dp_group)
        start_step = 0
        if self.resume:
            resumed = restore_grpo(self.engine, out_dir, source=self.source, window=self.window)
            if resumed is not None:
                start_step, self._buffer = resumed.step, resumed.buffer
                self._records = resumed.records
        self._plan = LoopPlan(
            total_steps=train.steps,
            log_every=train.log_every,
            checkpoint_every=train.checkpoint_every,
        )
        lines = (f"resumed from step {start_step}",) if start_step else ()
        return RunStart(
            output_dir=out_dir,
            plan=self._plan,
            start_step=start_step,
            finished=start_step >= train.steps,
            desc="grpo",
            tensorboard=train.tensorboard,
            lines=lines,
        )

    def _prompts(self) -> tuple[list[ChatRow], list[ChatRow]]:
        data, train = self.config.data, self.config.train
        if data.prompts is None:
            prompts, held = demo_chats(
                "addition",
                train_size=data.demo_train_size,
                eval_size=data.demo_eval_size,
                seed=train.seed,
            )
        else:
            prompts = list(read_jsonl(data.prompts))
            held = list(read_jsonl(data.eval_path)) if data.eval_path else []
        return prompts, held[: train.eval_samples]

    def _source(self, prompts: list[ChatRow]) -> RolloutSource:
        config, ctx = self.config, self.ctx
        if config.rollout.source == "file":
            assert config.rollout.path is not None  # validate_grpo enforces it
            groups = read_rollout_file(
                config.rollout.path, self.tokenizer, max_length=config.data.max_length
            )
            return FileRollouts(groups, rollout=config.rollout, ctx=ctx)
        collective = config.parallel.data_parallel == "fsdp2" or ctx.tp_size > 1
        return PolicySampler(
            prompts,
            self.tokenizer,
            rollout=config.rollout,
            ctx=ctx,
            seed=config.train.seed,
            max_length=config.data.max_length,
            synced=collective and ctx.world_size > 1,
        )

    # ---------------------------------------------------------------------------- training

    def _next_buffer(self) -> RolloutBuffer:
        """Draw a rollout batch; its advantages, old log-probs (when needed) and reference's."""
        config, ctx = self.config, self.ctx
        rollout = config.rollout
        rollouts = self.source.next_batch(unwrap(self.model))
        buffer = collate_rollouts(
            rollouts,
            pad_id=int(self.tokenizer.pad_token_id),
            eps=config.loss.advantage_eps,
        )
        # Several updates on one batch: the ratio's denominator is the policy before the first.
        # One update: the ratio is the detached current log-prob's (exactly 1).
        if buffer.old_log_p is None and self._updates_per_batch > 1:
            buffer.old_log_p = buffer_log_probs(
                unwrap(self.model),
                buffer,
                minibatches=rollout.minibatches,
                device=ctx.device,
                temperature=rollout.temperature,
            )
        if self.reference is not None:
            buffer.ref_log_p = buffer_log_probs(
                self.reference,
                buffer,
                minibatches=rollout.minibatches,
                device=ctx.device,
                temperature=rollout.temperature,
            )
        rewards = torch.tensor(
            [float(buffer.rewards.sum()), float(len(rollouts))],
            dtype=torch.float64,
            device=ctx.device,
        )
        dist.all_reduce(rewards, group=self._dp_group)
        self._records.note_reward(float(rewards[0] / rewards[1]))
        return buffer

    def train_step(self, step: int) -> StepRecord:
        """One optimizer step on the next minibatch of the rollout buffer."""
        config, ctx, engine = self.config, self.ctx, self.engine
        rollout = config.rollout
        if self._buffer is None or self._buffer.steps_done >= self._updates_per_batch:
            self._buffer = self._next_buffer()
        buffer = self._buffer
        part = buffer.steps_done % rollout.minibatches
        batch = buffer.minibatch(part, rollout.minibatches, ctx.device)
        labels = batch["labels"]
        tokens = minibatch_tokens(batch)
        # The token-sum contract: this minibatch's completion tokens over all dp ranks, counted
        # on the host copy (no device sync).
        local_tokens = buffer.labels[buffer.rows_of(part, rollout.minibatches)] != IGNORE_INDEX
        num_tokens = engine.global_num_tokens(int(local_tokens.sum()))
        out = policy_loss_of(
            engine,
            self._head,
            {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]},
            labels,
            tokens,
            config.loss,
            temperature=rollout.temperature,
            chunk_tokens=config.model.fused_loss_chunk_tokens,
        )
        engine.backward(out.loss, num_tokens=num_tokens)
        engine.step()
        buffer.steps_done += 1
        self.window.update(out.loss.detach(), num_tokens)
        if not self._plan.logs(step):
            return StepRecord(step=step)
        loss, avg = self.window.last(), self.window.average()
        self._records.note_loss(loss)
        metrics: dict[str, Any] = {
            "loss": loss,
            "loss_avg_window": avg,
            "lr": self._scheduler.get_last_lr()[0],
            "grad_norm": engine.get_global_grad_norm(),
            "reward": self._records.reward_last,
            "loss_tokens": int(num_tokens),
        }
        metrics.update(step_statistics(out, labels, tokens, config.loss, group=self._dp_group))
        return StepRecord(step=step, metrics=metrics)

    # ------------------------------------------------------------ evaluate, checkpoint, end

    def _exact_match(self) -> float | None:
        """Held-out exact match (collective), None without held-out rows."""
        if not self._eval_rows:
            return None
        return exact_match_accuracy(
            unwrap(self.model),
            self.tokenizer,
            self._eval_rows,
            max_new_tokens=self.config.train.eval_max_new_tokens,
            device=self.ctx.device,
            tp=self.ctx.tp_size,
        )

    def evaluate(self, step: int) -> StepRecord:
        """Step 0 (a fresh run): held-out exact match before training."""
        if step != 0:
            return StepRecord(step=step)
        accuracy = self._records.accuracy_before = self._exact_match()
        if accuracy is None:
            return StepRecord(step=0)
        line = (
            f"held-out exact match before training: {accuracy:.1%} "
            f"({len(self._eval_rows)} questions)"
        )
        return StepRecord(step=0, metrics={"eval/exact_match": accuracy}, lines=(line,))

    def checkpoint(self, step: int) -> None:
        """Save the Engine, the rollout buffer and source, the window and records (collective)."""
        save_grpo(
            self.engine,
            self.out_dir,
            step,
            buffer=self._buffer,
            source=self.source,
            window=self.window,
            records=self._records,
            keep=self.config.train.keep_checkpoints,
            is_main=self.ctx.is_main,
        )

    def finish(self) -> RunEnd:
        """Final exact match and the HF export (collective); the summary."""
        ctx, config = self.ctx, self.config
        self._accuracy_after = self._exact_match()
        metrics = {} if self._accuracy_after is None else {"eval/exact_match": self._accuracy_after}
        export_dir = None
        if config.train.export:
            staging = staging_dir(self.out_dir / EXPORT_DIR, clear=ctx.is_main)
            written = export_hf(
                self.model,
                self.tokenizer,
                staging,
                is_main=ctx.is_main,
                lora_export=config.lora.export,
            )
            if written is not None:
                export_dir = publish_dir(written, self.out_dir / EXPORT_DIR)
        records = self._records
        summary = {
            "steps": config.train.steps,
            "source": config.rollout.source,
            "rollout_batches": records.rollout_batches,
            "first_loss": records.first_loss,
            "last_loss": records.last_loss,
            "reward_first": records.reward_first,
            "reward_last": records.reward_last,
            "accuracy_before": records.accuracy_before,
            "accuracy_after": self._accuracy_after,
            "world_size": ctx.world_size,
            "dp": ctx.dp_size,
        }
        record = StepRecord(step=config.train.steps, metrics=metrics)
        return RunEnd(record=record, summary=summary, export_dir=export_dir)

    def result(self, outcome: LoopOutcome) -> GRPOResult:
        """The run's :class:`GRPOResult` after :func:`drive` returned ``outcome``."""
        trained = outcome.end is not None
        return GRPOResult(
            output_dir=self.out_dir,
            accuracy_before=self._records.accuracy_before,
            accuracy_after=self._accuracy_after if trained else None,
            first_loss=self._records.first_loss,
            last_loss=self._records.last_loss,
        )
