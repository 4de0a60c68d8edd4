"""The retrieval recipe: bi-encoder fine-tuning with in-batch-negative InfoNCE under DDP.

Its stages, as :func:`train_recipes.loop.drive.drive` calls them, and its summary; the pairs
are :mod:`train_recipes.retrieval.pairs`, the encoder and recall@k
:mod:`train_recipes.retrieval.encoder`.

# B local pairs, W ranks, H embedding width
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from train_recipes.config.retrieval import RetrievalConfig
from train_recipes.loop.drive import drive
from train_recipes.loop.records import LoopOutcome, LoopPlan, RunEnd, RunStart, StepRecord
from train_recipes.retrieval.encoder import (
    autocast_dtype,
    embed,
    load_encoder,
    recall_at_k,
    resolve_model_path,
)
from train_recipes.retrieval.pairs import docstring_pairs, jsonl_pairs, split_pairs
from train_recipes.run.process_group import init_distributed
from train_recipes.run.runtime import build_optimizer, open_run_folder, write_run_config

__all__ = ["RetrievalRecipe", "RetrievalResult", "retrieval_summary_text", "run_retrieval"]


@dataclass(kw_only=True, slots=True, frozen=True)
class RetrievalResult:
    """Recall on the held-out pairs before and after training (same on every rank)."""

    output_dir: Path
    recall_before: dict[int, float]
    recall_after: dict[int, float]
    first_loss: float | None
    last_loss: float | None


def _gather_with_grad(x: Tensor) -> Tensor:
    """[W*B, H]: every rank's rows; gradients flow back to the rank that owns each row.

    torch's autograd-aware all-gather: its backward sums every rank's gradient of this rank's
    rows.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(x.contiguous()))


def run_retrieval(config: RetrievalConfig) -> RetrievalResult:
    """Fine-tune the bi-encoder with InfoNCE over in-batch negatives from all ranks.

    The SPMD loop: every rank drives its own :class:`RetrievalRecipe` through
    :func:`train_recipes.loop.drive.drive`; rank 0 logs.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    recipe = RetrievalRecipe(config)
    start = recipe.setup()
    outcome = drive(
        recipe, start, is_main=recipe.ctx.is_main, format_summary=retrieval_summary_text
    )
    dist.barrier()
    return recipe.result(outcome)


def retrieval_summary_text(end: RunEnd, output_dir: Path, png: Path | None) -> str:
    """The retrieval run's closing lines: recall@1 and @10 before and after, the loss plot."""
    before, after = end.summary["recall_before"], end.summary["recall_after"]
    return (
        f"\nrun          {output_dir}\nranks        {end.summary['world_size']}\n"
        f"recall@1     {before[1]:.1%} -> {after[1]:.1%} (held-out)\n"
        f"recall@10    {before[10]:.1%} -> {after[10]:.1%} (held-out)\n"
        f"loss curve   {png if png is not None else '-'}"
    )


class RetrievalRecipe:
    """The retrieval recipe on one rank, as the stages :func:`train_recipes.loop.drive.drive` calls.

    Every rank's queries are scored against the passages of the whole global batch (gathered
    with gradient), so the negatives grow with the number of ranks. The loss is the sum of the
    local queries' cross-entropies and the Engine normalises by the global number of queries
    (contract (b)), cancelling DDP's mean.

    Args:
        config: a validated config.
    """

    def __init__(self, config: RetrievalConfig) -> None:
        self.config = config
        self._first_loss: float | None = None
        self._last_loss: float | None = None

    def setup(self) -> RunStart:
        """Process group, pairs, tokenizer, encoder (DDP), Engine."""
        from transformers import AutoTokenizer

        from train_engine import Engine, LossWindow, apply_data_parallel

        config = self.config
        train, data = config.train, config.data
        ctx = self.ctx = init_distributed(device_preference=train.device, cp=1)
        out_dir = self.out_dir = open_run_folder(train.output_dir, is_main=ctx.is_main)
        write_run_config(out_dir, config, is_main=ctx.is_main)
        torch.manual_seed(train.seed)
        pairs = (
            docstring_pairs(data.modules)
            if data.source == "stdlib_docstrings"
            else jsonl_pairs(str(data.path))
        )
        self.train_pairs, self.eval_pairs = split_pairs(
            pairs, eval_size=data.eval_size, seed=train.seed
        )
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model.path))
        self.model = load_encoder(config.model, ctx.device)
        self.autocast = autocast_dtype(config.model.autocast_dtype)
        wrapped = apply_data_parallel(
            self.model, mesh=ctx.mesh["dp"], config=config.parallel.data_parallel_config()
        )
        optimizer, self._scheduler = build_optimizer(
            wrapped, config.optim, device=ctx.device, total_steps=train.steps
        )
        self.engine = Engine(
            wrapped,
            optimizer,
            self._scheduler,
            max_grad_norm=config.optim.max_grad_norm,
            nonfinite=config.optim.nonfinite,
        )
        self.window = LossWindow(train.loss_window, group=ctx.mesh["dp"].get_group())
        self._rng = random.Random(train.seed * 1000 + ctx.rank)
        plan = self._plan = LoopPlan(total_steps=train.steps, log_every=train.log_every)
        return RunStart(
            output_dir=out_dir, plan=plan, desc="retrieval", tensorboard=train.tensorboard
        )

    def _recall(self) -> dict[int, float]:
        return recall_at_k(
            self.model,
            self.tokenizer,
            self.eval_pairs,
            max_length=self.config.data.max_length,
            pooling=self.config.model.pooling,
            device=self.ctx.device,
            autocast=self.autocast,
        )

    def evaluate(self, step: int) -> StepRecord:
        """Step 0: recall@1/10 on the held-out pairs before training (no later evaluations)."""
        if step != 0:
            return StepRecord(step=step)
        self.recall_before = before = self._recall()
        line = (
            f"{len(self.train_pairs)} train / {len(self.eval_pairs)} held-out pairs; recall@1 "
            f"{before[1]:.1%}, recall@10 {before[10]:.1%} before training"
        )
        metrics = {f"eval/recall@{k}": v for k, v in before.items()}
        return StepRecord(step=0, metrics=metrics, lines=(line,))

    def train_step(self, step: int) -> StepRecord:
        """One InfoNCE step over this rank's B pairs against all ranks' passages."""
        config, ctx, engine = self.config, self.ctx, self.engine
        b = config.data.micro_batch_size
        # Each rank draws its own B pairs; together they form the global batch of W*B.
        chosen = [self.train_pairs[self._rng.randrange(len(self.train_pairs))] for _ in range(b)]
        tok = self.tokenizer(
            [q for q, _ in chosen] + [p for _, p in chosen],
            padding=True,
            truncation=True,
            max_length=config.data.max_length,
            return_tensors="pt",
        ).to(ctx.device)
        # One forward for queries and passages together: DDP sees one graph per step.
        emb = embed(engine, dict(tok), config.model.pooling, autocast=self.autocast)  # [2B, H]
        queries, passages = emb[:b], emb[b:]
        all_passages = _gather_with_grad(passages)  # [W*B, H]
        logits = queries @ all_passages.T / config.model.temperature  # [B, W*B]
        target = torch.arange(b, device=ctx.device) + ctx.rank * b
        loss_sum = F.cross_entropy(logits, target, reduction="sum")
        num = engine.global_num_tokens(b)
        engine.backward(loss_sum, num_tokens=num)
        engine.step()
        self.window.update(loss_sum.detach(), num)
        if not self._plan.logs(step):
            return StepRecord(step=step)
        loss, avg = self.window.last(), self.window.average()
        self._first_loss = loss if self._first_loss is None else self._first_loss
        self._last_loss = loss
        metrics = {
            "loss": loss,
            "loss_avg_window": avg,
            "lr": self._scheduler.get_last_lr()[0],
            "grad_norm": engine.get_global_grad_norm(),
        }
        return StepRecord(step=step, metrics=metrics)

    def checkpoint(self, step: int) -> None:
        """The retrieval recipe keeps no checkpoints (its plan never asks for one)."""

    def finish(self) -> RunEnd:
        """Recall after training; the export (``train.export``) on rank 0; the summary."""
        self.recall_after = after = self._recall()
        export_dir = None
        if self.ctx.is_main and self.config.train.export:
            export_dir = self.out_dir / "hf_model"
            self.model.save_pretrained(export_dir, safe_serialization=True)
            self.tokenizer.save_pretrained(export_dir)
        summary = {
            "recall_before": self.recall_before,
            "recall_after": after,
            "world_size": self.ctx.world_size,
        }
        metrics = {f"eval/recall@{k}": v for k, v in after.items()}
        record = StepRecord(step=self.config.train.steps, metrics=metrics)
        return RunEnd(record=record, summary=summary, export_dir=export_dir)

    def result(self, outcome: LoopOutcome) -> RetrievalResult:
        """The run's :class:`RetrievalResult` after :func:`drive` returned ``outcome``."""
        return RetrievalResult(
            output_dir=self.out_dir,
            recall_before=self.recall_before,
            recall_after=self.recall_after,
            first_loss=self._first_loss,
            last_loss=self._last_loss,
        )
