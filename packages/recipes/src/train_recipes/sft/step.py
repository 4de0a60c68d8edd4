"""One optimizer step of the SFT recipe: the micro-batches, the backward, the step's record.

# B batch, S sequence
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from train_recipes.data import energon_api as data_api
from train_recipes.data.energon_api import ModelBatch
from train_recipes.data.plane import DataPlane, sample_ids_of
from train_recipes.loop.hang_watchdog import HangWatchdog, default_store
from train_recipes.loop.metrics import StartupClock, TokenMeter
from train_recipes.loop.records import LoopPlan, StepRecord
from train_recipes.model.attention import CausalFastPath, rows_are_packed, sdpa_backends
from train_recipes.run.health import SkipTracker
from train_recipes.sft.rates import StepRates

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from train_engine import Engine, LossWindow
    from train_recipes.config.sft import SFTConfig
    from train_recipes.data.colocated import ColocatedLoader
    from train_recipes.loss.token_loss import TokenSumLoss
    from train_recipes.model.moe import RouterLosses
    from train_recipes.run.process_group import RankContext

__all__ = ["SFTTrainStep"]


class SFTTrainStep:
    """The training step of :class:`~train_recipes.sft.recipe.SFTRecipe`.

    The recipe builds the state below in ``setup()`` and owns the other stages.
    """

    config: SFTConfig
    ctx: RankContext
    engine: Engine
    loader: ColocatedLoader
    data_plane: DataPlane
    window: LossWindow
    vlm: bool
    _guards: contextlib.ExitStack
    _lines: list[str]
    _first_loss: float | None
    _last_loss: float | None
    _watchdog: HangWatchdog | None
    _start_step: int
    _plan: LoopPlan
    _clock: StartupClock
    _scheduler: LRScheduler
    _loss: TokenSumLoss
    _skips: SkipTracker
    _tokens: TokenMeter
    _rates: StepRates
    _router_losses: RouterLosses
    _fast_path: CausalFastPath | None
    _batches: Iterator[Any]

    def train_step(self, step: int) -> StepRecord:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches."""
        config, ctx, engine = self.config, self.ctx, self.engine
        if step == self._start_step + 1:
            self._clock.start("first step")
            self._start_watchdog()
            self._tokens.restart_clock()
        if self._watchdog is not None:
            self._watchdog.enter_step(step)
        accum = config.train.gradient_accumulation_steps
        # Host copies: counts and layouts are read there (a device read stalls the GPU queue).
        raw = [next(self._batches) for _ in range(accum)]
        self.data_plane.record(step, ctx.dp_rank, [i for b in raw for i in sample_ids_of(b)])
        host = [data_api.batch_tensors(b, vlm=self.vlm, cp=ctx.cp_size) for b in raw]
        micro = [data_api.to_device(m, ctx.device) for m in host]
        # Contract (b): the window's loss tokens over all data-parallel replicas, from the
        # loader's count (made before cp sharding: a replica's cp ranks hold the same count).
        num_tokens = engine.global_num_tokens(sum(m["num_trainable_tokens"] for m in host))
        step_loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
        router_losses = self._router_losses
        with sdpa_backends(config.model.sdpa_backends):
            for batch, host_batch in zip(micro, host, strict=True):
                self._tokens.add_inputs(
                    host_batch["attention_mask"],
                    flops=self._rates.counts.batch_flops(host_batch)["total"],
                )
                with self._forward_attention(host_batch), router_losses.collect():
                    loss_sum = self._loss(engine, batch)
                extra = router_losses.term(num_tokens)  # MoE aux/z losses (0.0 otherwise)
                engine.backward(loss_sum + extra, num_tokens=num_tokens)
                step_loss += loss_sum.detach().to(torch.float64)
                step_result = engine.step()
        self._skips.observe(step, step_result)  # the previous step's skip flag, settled by now
        if step == self._start_step + 1:
            self._clock.end()
        router_losses.after_step(ctx.device)  # DeepSeek bias balancing (no-op otherwise)
        self._tokens.add_loss_tokens(num_tokens)  # the Engine's global count, not a recount
        self.window.update(step_loss, num_tokens)
        if not self._plan.logs(step):
            return StepRecord(step=step, lines=self._take_lines())
        return StepRecord(step=step, metrics=self._step_metrics(), lines=self._take_lines())

    def _step_metrics(self) -> dict[str, Any]:
        """The metric record of a log step (collective: every rank reads the same numbers)."""
        ctx = self.ctx
        self._skips.flush()
        loss, avg = self.window.last(), self.window.average()
        window = self._tokens.read(ctx.device)
        self._first_loss = loss if self._first_loss is None else self._first_loss
        self._last_loss = loss
        record: dict[str, Any] = {
            "loss": loss,
            "loss_avg_window": avg,
            "lr": self._scheduler.get_last_lr()[0],
            "grad_norm": self.engine.get_global_grad_norm(),
            "tokens_per_s": window.tokens_per_s,
            "loss_tokens": window.loss_tokens,
            "skipped": self._skips.new_since_last_call(),
            "skipped_total": len(self._skips.skipped),
        }
        record.update(self._router_losses.metrics(ctx.device))  # collective; {} without MoE
        record.update(self._rates.fields(window))
        return record

    def _forward_attention(self, host_batch: ModelBatch) -> contextlib.AbstractContextManager[None]:
        if self._fast_path is None:
            return contextlib.nullcontext()
        return self._fast_path.selected(packed=rows_are_packed(host_batch["position_ids"]))

    def _start_watchdog(self) -> None:
        store = default_store()
        if self.ctx.world_size > 1 and store is not None:
            self._watchdog = HangWatchdog(
                store,
                rank=self.ctx.rank,
                world_size=self.ctx.world_size,
                timeout_s=self.config.train.collective_timeout_s,
            ).start()
            self._guards.callback(self._watchdog.stop)

    def _note_skip(self, step: int, empty: bool) -> None:
        why = (
            "no trained token: every label of the step was masked"
            if empty
            else f"non-finite gradient norm, optim.nonfinite={self.config.optim.nonfinite!r}"
        )
        self._lines.append(f"step {step}: optimizer update skipped ({why})")

    def _take_lines(self) -> tuple[str, ...]:
        lines, self._lines = tuple(self._lines), []
        return lines
