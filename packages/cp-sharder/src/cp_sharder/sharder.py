"""ContextParallelSharder: the single owner of CP batch preparation and token layout.

The work is split by job: :mod:`cp_sharder.planning` (and :mod:`cp_sharder.planning_thd`)
validates and pads a batch without any collective, :mod:`cp_sharder.backends` picks the
attention backend and builds ``train_ctx``, :mod:`cp_sharder.assembly` chooses the model's
inputs, :mod:`cp_sharder.shard_layout` holds the layout and moves tokens into and out of it.
This module agrees the plan across ranks, shards the batch and keeps the last layout for the
token verbs.

Dimension letters: B batch, S sequence (input), P padded sequence, W cp size, T packed tokens
(B*S), H hidden.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cp_sharder._dist import CPGroup, agree, resolve_cp_group
from cp_sharder.assembly import ForwardSignature, assemble, embed_multimodal, has_media
from cp_sharder.attention import (
    Backend,
    has_sliding_window,
    is_hf_model,
    model_hook,
    select_family,
)
from cp_sharder.backends import build_context, pick_backend
from cp_sharder.layouts import LayoutKind
from cp_sharder.planning import BatchPlan, PlanOptions, TrainContext, plan_batch
from cp_sharder.shard_layout import (
    ShardLayout,
    ShardResult,
    build_layout,
    gather_tokens,
    shard_tokens,
)

logger = logging.getLogger(__name__)

__all__ = ["ContextParallelSharder", "ShardLayout", "ShardResult"]


class ContextParallelSharder:
    """Prepares batches for context parallelism and owns the resulting token layout.

    Example::

        sharder = ContextParallelSharder(model, mesh, padding_token_id=tok.pad_token_id)
        result = sharder.shard(batch)               # or: train_ctx, batch = sharder.shard(batch)
        local_adv = sharder.shard_token_tensor(advantages, fill=0.0, layout=result.layout)
        labels = result.batch.pop("labels")
        with result.train_ctx():
            logits = model(**result.batch).logits   # [B, P/W, V]
        full = sharder.gather_token_tensor(logits, trim=True, layout=result.layout)  # [B, S, V]

    The token verbs take the layout explicitly (``layout=result.layout``); without it they use
    the layout of the last ``shard()`` (the seed API), which raises before the first one.

    Labels must already be shifted (``labels[t]`` is the target of position ``t``), so no shift
    crosses a shard boundary. Do not let a transformers model compute its own loss from the
    sharded labels: it shifts them again inside each shard; compute the loss from the logits.

    Args:
        model: the live model. Its ``prepare_model_inputs_for_cp`` hook, else Transformer Engine
            attention modules, else SDPA (portable or torch ring) decide the backend.
        device_mesh: None (cp=1), a 1-D DeviceMesh, or one with a ``"cp"`` (and optional
            ``"tp"``) dimension.
        batch: optional first batch, validated eagerly so shape errors surface at construction.
        padding_token_id: input id used to pad ``input_ids``.
        extra_seq_buffers: names of further token-aligned batch tensors and their sequence dim,
            e.g. ``{"teacher_logits": 1}``; padded with 0 and sharded with the batch.
        ignore_index: label value of padding (also the label fill).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device_mesh: Any = None,
        batch: Mapping[str, Any] | None = None,
        *,
        padding_token_id: int = 0,
        extra_seq_buffers: Mapping[str, int] | None = None,
        ignore_index: int = -100,
    ) -> None:
        self._model = model
        self._cp: CPGroup = resolve_cp_group(device_mesh)
        self._family = select_family(model)
        self._hf = is_hf_model(model)
        self._signature = ForwardSignature.of(model)
        self._extra = dict(extra_seq_buffers or {})
        self._options = PlanOptions(
            cp=self._cp.size,
            padding_token_id=padding_token_id,
            ignore_index=ignore_index,
            extra_seq_buffers=self._extra,
            te=self._family is Backend.TE,
        )
        self._last: ShardResult | None = None
        self._te_attached = False
        if batch is not None and self._family is not Backend.MODEL_HOOK:
            # Dry run: pure shape checks, no collectives, nothing recorded.
            plan_batch(dict(batch), self._options)

    # ------------------------------------------------------------------ properties
    @property
    def cp_size(self) -> int:
        """W, the number of CP ranks."""
        return self._cp.size

    @property
    def cp_rank(self) -> int:
        """This process's rank in the CP group."""
        return self._cp.rank

    @property
    def backend_family(self) -> Backend:
        """MODEL_HOOK, TE or PORTABLE (the SDPA family), derived from the model."""
        return self._family

    @property
    def layout(self) -> ShardLayout:
        """The layout captured by the last ``shard()`` (prefer ``result.layout``)."""
        return self._resolve(None, "layout")

    @property
    def local_buffers(self) -> dict[str, Tensor]:
        """The last ``shard()``'s buffers the model's forward does not take (e.g. loss_mask)."""
        return dict(self._last.local_buffers) if self._last is not None else {}

    # ------------------------------------------------------------------ shard
    def shard(self, batch: Mapping[str, Any]) -> ShardResult:
        """Pad, lay out and shard a global batch; return the attention context and local batch.

        Every CP rank must pass the same global batch. Keys handled: ``input_ids`` [B, S] or
        ``inputs_embeds`` [B, S, H] (sharded out of place, gradients flow back), ``labels``
        (pre-shifted, padded with ``ignore_index``), ``position_ids`` ([B, S], [1, S] or rotary
        [3, B, S] / [4, B, S]; synthesised when missing, continued over padding),
        ``attention_mask`` (padding mask, padded with 0), ``padding_mask`` (padded with True),
        ``loss_mask`` and ``extra_seq_buffers``. ``qkv_format == "thd"`` marks a packed batch:
        rows of sequences whose real lengths are ``seq_lens`` [B, N] (and ``seq_lens_padded``),
        flattened into one stream with per-document attention. At cp > 1, ``pixel_values``
        (``pixel_values_videos``) of a transformers VLM are turned into ``inputs_embeds`` first,
        so no placeholder token is separated from its features. Other keys pass through.

        Args:
            batch: the global batch (same on every CP rank).

        Returns:
            A :class:`ShardResult`; it unpacks as ``(train_ctx, local_batch)``.
        """
        self._last = None  # a failed shard() must not leave the previous step's layout behind
        failure: Exception | None = None
        try:
            plan = self._plan_with_hook(dict(batch))
            sequence = plan.sequence
            cu = sequence.cu_seqlens_padded
            summary = [
                sequence.padded_seq_len,
                sequence.original_seq_len,
                list(LayoutKind).index(sequence.kind),
                int(cu.sum()) if cu is not None else -1,
            ]
        except Exception as err:
            failure, summary = err, [-1, -1, -1, -1]
        what = "the padded length, original length, layout and packed boundaries"
        if failure is not None:
            # Still take part in the agreement, so ranks whose batch was fine raise instead of
            # blocking in the model's first collective; this rank reports its own error.
            with contextlib.suppress(ValueError):
                agree(summary, self._cp, what)
            raise failure
        agree(summary, self._cp, what)
        cp = self._cp
        backend = pick_backend(
            plan,
            family=self._family,
            cp=cp,
            hf=self._hf,
            sliding_window=has_sliding_window(self._model),
        )
        layout = build_layout(sequence, cp_size=cp.size, cp_rank=cp.rank, backend=backend)
        local_idx = layout.local_token_global_indices
        local: dict[str, Tensor] = {}
        for name, t in plan.tensors.items():
            if sequence.kind is LayoutKind.IDENTITY:
                local[name] = t  # cp=1: nothing moves, nothing is copied
            else:
                local[name] = t.index_select(plan.seq_dims[name], local_idx.to(t.device))
        out, buffers = assemble(local, plan, backend, self._signature, frozenset(self._extra))
        train_ctx = build_context(
            plan,
            backend,
            model=self._model,
            cp=cp,
            hf=self._hf,
            local_index=local_idx,
            all_index=layout.all_rank_indices,
            inverse_index=layout.inverse_indices,
            attach_te=self._attach_te,
        )
        logger.debug(
            "cp shard: cp=%d rank=%d layout=%s backend=%s length %d -> %d",
            cp.size,
            cp.rank,
            sequence.kind.value,
            backend.value,
            sequence.original_seq_len,
            sequence.padded_seq_len,
        )
        self._last = ShardResult(
            train_ctx=train_ctx, batch=out, layout=layout, local_buffers=buffers
        )
        return self._last

    def _attach_te(self) -> None:
        if not self._te_attached:
            from cp_sharder.attention import te

            te.attach(self._model, self._cp)
            self._te_attached = True

    def _plan_with_hook(self, batch: dict[str, Any]) -> BatchPlan:
        hook_context: TrainContext | None = None
        hook_layout: LayoutKind | None = None
        if self._family is Backend.MODEL_HOOK:
            extra = dict(
                model_hook(self._model)(
                    batch, cp_size=self._cp.size, cp_rank=self._cp.rank, cp_group=self._cp.group
                )
                or {}
            )
            hook_context = extra.pop("cp_context", None)
            wanted = extra.pop("cp_layout", None)
            hook_layout = LayoutKind(wanted) if wanted is not None else None
            batch.update(extra)
        elif self._cp.size > 1 and self._hf and has_media(batch):
            batch = embed_multimodal(self._model, batch)
        return plan_batch(batch, self._options, hook_context=hook_context, hook_layout=hook_layout)

    # ------------------------------------------------------------------ token verbs
    def _resolve(self, layout: ShardLayout | ShardResult | None, verb: str) -> ShardLayout:
        if isinstance(layout, ShardResult):
            return layout.layout
        if layout is not None:
            return layout
        if self._last is None:
            raise RuntimeError(
                f"{verb} needs the layout of a batch; call shard(batch) first (the layout is "
                "data-dependent and captured by each shard()), or pass layout=result.layout"
            )
        return self._last.layout

    def shard_token_tensor(
        self,
        t: Tensor,
        *,
        seq_dim: int = 1,
        fill: float | None = None,
        layout: ShardLayout | ShardResult | None = None,
    ) -> Tensor:
        """Give a token-aligned tensor exactly the last batch's layout (out of place).

        Accepted lengths along ``seq_dim``: the padded length P (used as is) or the original
        length S (right-padded with ``fill``, which is then required). For a packed batch a
        tensor whose leading dims are the input rows ``(B, S)`` is flattened first.

        Args:
            t: [..., S or P, ...] (or [B, S, ...] for a packed batch).
            seq_dim: the sequence dimension.
            fill: pad value for the positions added by padding.
            layout: the layout (or result) of the batch; None means the last ``shard()``'s.

        Returns:
            [..., P/W, ...] ([1, P/W, ...] for a packed batch); differentiable.
        """
        layout = self._resolve(layout, "shard_token_tensor")
        return shard_tokens(t, layout, seq_dim=seq_dim, fill=fill)

    def gather_token_tensor(
        self,
        t: Tensor,
        *,
        seq_dim: int = 1,
        trim: bool = False,
        layout: ShardLayout | ShardResult | None = None,
    ) -> Tensor:
        """Reassemble a local token tensor into global order on every rank (differentiable).

        The backward sums gradients over CP ranks and returns each token's gradient to the rank
        that owns it; a loss computed identically on every rank from the result therefore
        reaches each owner ``cp`` times: divide it by ``cp`` (or compute it on one rank, the
        others contributing zero). The inverse permutation is computed locally from the layout.

        Args:
            t: [..., P/W, ...] in this rank's layout.
            seq_dim: the sequence dimension.
            trim: drop the padding: [..., S, ...], or [B, S, ...] for a packed batch (which
                needs ``seq_dim == 1`` and a leading dim of 1).
            layout: the layout (or result) of the batch; None means the last ``shard()``'s.

        Returns:
            [..., P, ...] (or trimmed as above).
        """
        layout = self._resolve(layout, "gather_token_tensor")
        return gather_tokens(t, layout, self._cp, seq_dim=seq_dim, trim=trim)

    def num_label_tokens(
        self,
        *,
        dp_group: Any = None,
        device: torch.device | str | None = None,
        layout: ShardLayout | ShardResult | None = None,
    ) -> Tensor:
        """Label tokens of the last global batch, summed over data-parallel ranks only.

        Counted on the pre-shard batch, which every CP rank holds whole, so the sum runs over
        ``dp_group`` and never over CP ranks (that would count every token ``cp`` times). With
        ``local_loss = sum(per-token loss on local tokens) / count`` the sum of ``local_loss``
        over the CP ranks is the global token-mean loss, so **summing** gradients over CP ranks
        gives exactly the no-CP gradient; a wrapper that averages over a flattened ``dp_cp``
        group needs ``loss * dp_cp_size``. (train-engine's ``Engine.backward(loss_sum,
        num_tokens=...)`` applies that factor itself.)

        Args:
            dp_group: the data-parallel process group; None means one replica (no reduction).
            device: where the collective runs (cuda for NCCL groups); defaults to CPU.
            layout: the layout (or result) of the batch; None means the last ``shard()``'s.

        Returns:
            [] int64 tensor, identical on every rank of ``dp_group``.
        """
        layout = self._resolve(layout, "num_label_tokens")
        count = torch.tensor(layout.sequence.num_label_tokens, dtype=torch.int64, device=device)
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(count, group=dp_group)
        return count
