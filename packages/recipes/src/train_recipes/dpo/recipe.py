"""The DPO recipe: offline preference tuning of a causal LM through the Engine.

pairs (JSONL or the demo's) -> chat template -> 2P rows per micro-batch -> policy sequence
log-probs through vocab-parallel (:mod:`train_recipes.loss.sequence_log_probs`) and the frozen
reference's (:mod:`train_recipes.model.reference`, or the rows' columns) -> sigmoid DPO or
SimPO (:mod:`train_recipes.loss.preference_loss`) -> ``engine.backward(loss_sum,
num_tokens=global pairs)`` (DDP or FSDP2).

:func:`run_dpo` is the SPMD loop: every rank drives its own :class:`DPORecipe` through
:func:`train_recipes.loop.drive.drive`.

# P pairs per micro-batch, S sequence
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from train_recipes.config.dpo import DPOConfig, policy_config
from train_recipes.data.demo import read_jsonl
from train_recipes.data.processors import load_tokenizer
from train_recipes.dpo.demo_pairs import demo_heldout_rows, demo_pair_rows
from train_recipes.dpo.pairs import PairSampler, collate_pairs, encode_pair, read_pair_rows
from train_recipes.dpo.step import DPOMetrics, dpo_micro_batch
from train_recipes.dpo.summary import DPOResult, dpo_summary_text
from train_recipes.evaluation.exact_match import exact_match_accuracy
from train_recipes.export.hf import export_hf
from train_recipes.loop.drive import drive
from train_recipes.loop.records import LoopOutcome, LoopPlan, RunEnd, RunStart, StepRecord
from train_recipes.loss.fused_loss import fused_head
from train_recipes.model.build import unwrap
from train_recipes.model.parallelize import build_parallel_model
from train_recipes.model.reference import build_reference_model, check_same_vocabulary
from train_recipes.run import checkpoints
from train_recipes.run.folder import EXPORT_DIR, publish_dir, rank0_printer, staging_dir
from train_recipes.run.process_group import init_distributed, process_group_timeout_s
from train_recipes.run.runtime import (
    build_optimizer,
    choose_optimizer,
    open_run_folder,
    write_run_config,
)

if TYPE_CHECKING:
    from train_engine import Engine
    from train_recipes.data.colocated import ColocatedLoader
    from train_recipes.dpo.pairs import EncodedPair, PairRow

__all__ = ["DPORecipe", "run_dpo"]


class DPORecipe:
    """The DPO recipe on one rank, as the stages :func:`train_recipes.loop.drive.drive` calls.

    Args:
        config: a validated config (:func:`train_recipes.config.dpo.validate_dpo`).
        resume: continue from the newest complete checkpoint.
    """

    def __init__(self, config: DPOConfig, *, resume: bool = False) -> None:
        self.config = config
        self.sft = policy_config(config)  # what builds, wraps and checkpoints the policy
        self.resume = resume
        self._first_loss: float | None = None
        self._last_loss: float | None = None
        self._accuracy_before: float | None = None
        self._accuracy_after: float | None = None
        self._last_metrics: dict[str, float] = {}

    def setup(self) -> RunStart:
        """Process group, tokenizer, policy and reference, Engine, pairs; a resume's state."""
        from train_engine import Engine, LossWindow

        config, sft = self.config, self.sft
        train = config.train
        ctx = self.ctx = init_distributed(
            device_preference=train.device, cp=1, timeout_s=process_group_timeout_s(600.0)
        )
        out_dir = self.out_dir = open_run_folder(train.output_dir, is_main=ctx.is_main)
        torch.manual_seed(train.seed)
        tokenizer = self.tokenizer = load_tokenizer(sft)
        self.model = build_parallel_model(sft, tokenizer, ctx)
        choice = choose_optimizer(self.model, config.optim, device=ctx.device)
        optimizer, self._scheduler = build_optimizer(
            self.model, config.optim, device=ctx.device, total_steps=train.steps, choice=choice
        )
        self.engine: Engine = Engine(
            self.model,
            optimizer,
            self._scheduler,
            max_grad_norm=config.optim.max_grad_norm,
            nonfinite=config.optim.nonfinite,
            gradient_accumulation_steps=train.gradient_accumulation_steps,
            dp_group=ctx.mesh["dp"].get_group(),
        )
        self._head = fused_head(self.engine)
        rows = self._pair_rows()
        self.pairs: list[EncodedPair] = [
            encode_pair(tokenizer, row, max_length=config.data.max_length, where=f"pair {i}")
            for i, row in enumerate(rows)
        ]
        columns = all(p.reference is not None for p in self.pairs)
        self.reference = None
        if config.loss.loss_type == "sigmoid" and not columns:
            self.reference = build_reference_model(sft, tokenizer, ctx, init_seed=train.seed)
            check_same_vocabulary(self.model, self.reference)
        self._reference_head = None if self.reference is None else fused_head(self.reference)
        self.sampler = PairSampler(
            len(self.pairs),
            micro_batch_size=config.data.micro_batch_size,
            seed=train.seed,
            shuffle=config.data.shuffle,
        )
        self.window = LossWindow(train.loss_window, group=ctx.mesh["dp"].get_group())
        self._eval_rows = self._held_out_rows()
        self._metrics = DPOMetrics(ctx.device)
        start_step = self._restore()
        plan = self._plan = LoopPlan(
            total_steps=train.steps,
            log_every=train.log_every,
            checkpoint_every=train.checkpoint_every,
            checkpoint_last=True,
        )
        if ctx.is_main:
            write_run_config(out_dir, config, is_main=True)
            tokenizer.save_pretrained(out_dir / "tokenizer")
        source = "reference model" if self.reference is not None else "columns"
        if config.loss.loss_type == "simpo":
            source = "none (reference-free)"
        lines: tuple[str, ...] = (
            f"dpo: {len(self.pairs)} pairs, loss {config.loss.loss_type} "
            f"(beta={config.loss.beta}), reference log-probs: {source}; "
            f"{choice.line}",
        )
        if start_step:
            lines += (f"resumed at step {start_step}",)
        return RunStart(
            output_dir=out_dir,
            plan=plan,
            start_step=start_step,
            finished=start_step >= train.steps,
            desc=f"dpo dp={ctx.dp_size}",
            tensorboard=train.tensorboard,
            run_config=None,
            lines=lines,
        )

    def _pair_rows(self) -> list[PairRow]:
        config = self.config
        if config.data.path is not None:
            return read_pair_rows(config.data.path)
        return demo_pair_rows(
            unwrap(self.model),
            self.tokenizer,
            num_pairs=config.data.demo_pairs,
            eval_size=config.data.demo_eval_size,
            seed=config.train.seed,
            device=self.ctx.device,
            max_new_tokens=config.train.eval_max_new_tokens,
        )

    def _held_out_rows(self) -> list[dict[str, Any]]:
        config = self.config
        if config.train.eval_samples == 0:
            return []
        if config.data.eval_path is not None:
            rows = list(read_jsonl(config.data.eval_path))
        elif config.data.path is None:
            rows = list(
                demo_heldout_rows(eval_size=config.data.demo_eval_size, seed=config.train.seed)
            )
        else:
            return []
        return rows[: config.train.eval_samples]

    def _restore(self) -> int:
        if not self.resume:
            return 0
        restored = checkpoints.restore(
            self.engine,
            cast("ColocatedLoader", self.sampler),  # the sampler's state stands for a loader's
            self.window,
            self.sft,
            dp_size=self.ctx.dp_size,
            is_main=self.ctx.is_main,
            say=rank0_printer(self.ctx.is_main),
        )
        if restored is None:
            return 0
        self._accuracy_before = restored.accuracy_before
        self._first_loss = restored.first_loss
        self._last_loss = restored.last_loss
        return restored.step

    def _exact_match(self) -> float | None:
        if not self._eval_rows:
            return None
        return exact_match_accuracy(
            unwrap(self.model),
            self.tokenizer,
            self._eval_rows,
            max_new_tokens=self.config.train.eval_max_new_tokens,
            device=self.ctx.device,
        )

    def evaluate(self, step: int) -> StepRecord:
        """Step 0: held-out exact match before training (the only evaluation before the end)."""
        if step != 0:
            return StepRecord(step=step)
        accuracy = self._accuracy_before = self._exact_match()
        if accuracy is None:
            return StepRecord(step=0)
        line = f"held-out exact match before training: {accuracy:.1%} ({len(self._eval_rows)} questions)"
        return StepRecord(step=0, metrics={"eval/exact_match": accuracy}, lines=(line,))

    def train_step(self, step: int) -> StepRecord:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches of P pairs."""
        config, ctx, engine = self.config, self.ctx, self.engine
        accum = config.train.gradient_accumulation_steps
        # Contract (b) with pairs as the unit: the Engine divides the loss sum by all of them.
        num_pairs = engine.global_num_tokens(accum * config.data.micro_batch_size)
        step_loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
        for m in range(accum):
            indices = self.sampler.micro_batch(
                step, rank=ctx.dp_rank, dp=ctx.dp_size, accumulation=accum, m=m
            )
            batch = collate_pairs(
                [self.pairs[i] for i in indices], pad_token_id=int(self.tokenizer.pad_token_id)
            )
            batch = {k: v.to(ctx.device) for k, v in batch.items()}
            loss_sum = dpo_micro_batch(
                engine,
                self._head,
                batch,
                loss=config.loss,
                reference=self.reference,
                reference_head=self._reference_head,
                metrics=self._metrics,
                chunk_tokens=config.model.fused_loss_chunk_tokens,
            )
            engine.backward(loss_sum, num_tokens=num_pairs)
            step_loss += loss_sum.detach().to(torch.float64)
            engine.step()
        self.window.update(step_loss, num_pairs)
        if not self._plan.logs(step):
            return StepRecord(step=step)
        loss, avg = self.window.last(), self.window.average()
        self._first_loss = loss if self._first_loss is None else self._first_loss
        self._last_loss = loss
        self._last_metrics = self._metrics.read_and_reset()  # collective over the ranks
        record: dict[str, Any] = {
            "loss": loss,
            "loss_avg_window": avg,
            "lr": self._scheduler.get_last_lr()[0],
            "grad_norm": engine.get_global_grad_norm(),
            **self._last_metrics,
        }
        return StepRecord(step=step, metrics=record)

    def checkpoint(self, step: int) -> None:
        """Save the Engine, the loss window and the run's records of ``step`` (collective)."""
        checkpoints.save(
            self.engine,
            self.out_dir,
            step=step,
            loader=cast("ColocatedLoader", self.sampler),
            window=self.window,
            config=self.sft,
            dp_size=self.ctx.dp_size,
            accuracy_before=self._accuracy_before,
            first_loss=self._first_loss,
            is_main=self.ctx.is_main,
            last_loss=self._last_loss,
        )

    def finish(self) -> RunEnd:
        """Held-out exact match after training, the HF export (collective); the summary."""
        ctx, train = self.ctx, self.config.train
        self._accuracy_after = self._exact_match()
        metrics: dict[str, Any] = {}
        if self._accuracy_after is not None:
            metrics["eval/exact_match"] = self._accuracy_after
        export_dir = None
        if train.export:
            staging = staging_dir(self.out_dir / EXPORT_DIR, clear=ctx.is_main)
            written = export_hf(
                self.model,
                self.tokenizer,
                staging,
                is_main=ctx.is_main,
                lora_export=self.config.lora.export,
            )
            if written is not None:
                export_dir = publish_dir(written, self.out_dir / EXPORT_DIR)
        summary = {
            "steps": train.steps,
            "pairs": len(self.pairs),
            "loss_type": self.config.loss.loss_type,
            "first_loss": self._first_loss,
            "last_loss": self._last_loss,
            "accuracy_before": self._accuracy_before,
            "accuracy_after": self._accuracy_after,
            "world_size": ctx.world_size,
            "dp": ctx.dp_size,
            **self._last_metrics,
        }
        record = StepRecord(step=train.steps, metrics=metrics)
        return RunEnd(record=record, summary=summary, export_dir=export_dir)

    def result(self, outcome: LoopOutcome) -> DPOResult:
        """The run's :class:`DPOResult` after :func:`drive` returned ``outcome``."""
        trained = outcome.end is not None
        return DPOResult(
            output_dir=self.out_dir,
            first_loss=self._first_loss,
            last_loss=self._last_loss if trained else None,
            accuracy_before=self._accuracy_before,
            accuracy_after=self._accuracy_after if trained else None,
            metrics=dict(self._last_metrics),
        )


def run_dpo(config: DPOConfig, *, resume: bool = False) -> DPOResult:
    """Run the DPO recipe on the already-launched ranks (or one process).

    Returns:
        The run's result, identical on every rank.
    """
    recipe = DPORecipe(config, resume=resume)
    start = recipe.setup()
    outcome = drive(recipe, start, is_main=recipe.ctx.is_main, format_summary=dpo_summary_text)
    dist.barrier()
    return recipe.result(outcome)
