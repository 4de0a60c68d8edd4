"""ContextParallelSharder: the single owner of CP batch preparation and token layout.

Dimension letters: B batch, S sequence (input), P padded sequence, W cp size, T packed tokens
(B*S), H hidden.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cp_sharder import layouts
from cp_sharder._dist import CPGroup, agree, all_gather_seq, resolve_cp_group
from cp_sharder.attention import (
    Backend,
    has_sliding_window,
    is_hf_model,
    model_hook,
    select_family,
)
from cp_sharder.layouts import LayoutKind
from cp_sharder.loss import global_label_tokens

logger = logging.getLogger(__name__)

# Tokens per head/tail chunk that torch's ring attention needs a multiple of (see _pick_backend).
_RING_CHUNK_ALIGN = 32

__all__ = ["ContextParallelSharder", "ShardLayout"]

TrainContext = Callable[[], contextlib.AbstractContextManager[Any]]

# Keys the sharder reads and never forwards to the model.
_SHARDER_KEYS = ("qkv_format", "seq_lens", "seq_lens_padded")
# Token-aligned keys the sharder knows: sequence dim (for [B, S] tensors) and pad value kind.
_KNOWN_TOKEN_KEYS = (
    "input_ids",
    "inputs_embeds",
    "labels",
    "position_ids",
    "attention_mask",
    "padding_mask",
    "loss_mask",
)
# Optional buffers forwarded only when the model's forward names them.
_OPTIONAL_BUFFERS = ("padding_mask", "loss_mask")


@dataclass(kw_only=True, slots=True, frozen=True)
class ShardLayout:
    """Where this rank's tokens sit in the padded global sequence, captured by ``shard()``.

    Attributes:
        kind: the layout (identity, contiguous, head/tail, THD).
        cp_size: W.
        cp_rank: this rank.
        local_token_global_indices: [P/W] int64 global position of each local token, in local
            order.
        all_rank_indices: [W, P/W] int64, row r = rank r's global positions (computed locally).
        inverse_indices: [P] int64 inverse of ``all_rank_indices.flatten()``: gathered tokens in
            rank order, indexed by it, are in global order.
        original_seq_len: S for a [B, S] batch; T = B*S for a packed (THD) batch.
        padded_seq_len: P.
        input_row_shape: (B, S) of a packed batch before flattening, else None.
        cu_seqlens_padded: [N+1] int64 padded boundaries of the packed sequences, else None.
        num_label_tokens: label tokens of the pre-shard batch (labels != ignore_index), this
            data-parallel rank only.
        backend: the attention backend the step's train_ctx enters.
    """

    kind: LayoutKind
    cp_size: int
    cp_rank: int
    local_token_global_indices: Tensor
    all_rank_indices: Tensor
    inverse_indices: Tensor
    original_seq_len: int
    padded_seq_len: int
    input_row_shape: tuple[int, int] | None = None
    cu_seqlens_padded: Tensor | None = None
    num_label_tokens: int = 0
    backend: Backend = Backend.NONE

    @property
    def local_seq_len(self) -> int:
        """P/W, the number of tokens each rank holds."""
        return self.padded_seq_len // self.cp_size


@dataclass(kw_only=True, slots=True)
class _Prepared:
    """Everything ``shard()`` derives from one batch before any collective."""

    tensors: dict[str, Tensor]  # padded global token tensors (seq dim per `seq_dims`)
    seq_dims: dict[str, int]
    passthrough: dict[str, Any]
    kind: LayoutKind
    original_seq_len: int
    padded_seq_len: int
    input_row_shape: tuple[int, int] | None
    cu_seqlens_padded: Tensor | None
    doc_ids: Tensor | None  # [B or 1, P]
    key_valid: Tensor | None  # [B, P] bool
    num_label_tokens: int
    thd: bool
    hook_context: TrainContext | None


def _pad(t: Tensor, dim: int, amount: int, value: float | bool) -> Tensor:
    if amount == 0:
        return t
    dim = dim % t.dim()
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, amount]
    if t.dtype == torch.bool:
        return F.pad(t.to(torch.uint8), pad, value=int(value)).to(torch.bool)
    return F.pad(t, pad, value=value)


def _continue_positions(pos: Tensor, amount: int) -> Tensor:
    """Extend positions along the last dim so they keep counting from the last one."""
    if amount == 0:
        return pos
    step = torch.arange(1, amount + 1, dtype=pos.dtype, device=pos.device)
    return torch.cat([pos, pos[..., -1:] + step], dim=-1)


def _docs_from_positions(pos: Tensor) -> Tensor | None:
    """[B, P] document ids where positions restart (transformers' packed-sequence rule)."""
    first = pos[:, :1] - 1
    starts = torch.diff(pos, prepend=first, dim=-1) != 1
    docs = starts.cumsum(-1)
    if bool((docs == docs[:, :1]).all()):
        return None
    return docs


def _forward_params(model: torch.nn.Module) -> tuple[frozenset[str], bool]:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return frozenset(), True
    names = frozenset(
        p.name for p in sig.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    )
    var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


class ContextParallelSharder:
    """Prepares batches for context parallelism and owns the resulting token layout.

    Example::

        sharder = ContextParallelSharder(model, mesh, padding_token_id=tok.pad_token_id)
        train_ctx, batch = sharder.shard(batch)
        local_adv = sharder.shard_token_tensor(advantages, fill=0.0)
        labels = batch.pop("labels")
        with train_ctx():
            logits = model(**batch).logits          # [B, P/W, V]
        full = sharder.gather_token_tensor(logits, trim=True)   # [B, S, V]

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
        self._params, self._var_kw = _forward_params(model)
        self._padding_token_id = padding_token_id
        self._extra = dict(extra_seq_buffers or {})
        self._ignore_index = ignore_index
        self._layout: ShardLayout | None = None
        self._local_buffers: dict[str, Tensor] = {}
        self._te_attached = False
        if batch is not None and self._family is not Backend.MODEL_HOOK:
            # Dry run: pure shape checks, no collectives, nothing recorded.
            self._prepare(dict(batch))

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
        """The layout captured by the last ``shard()``."""
        return self._require_layout("layout")

    @property
    def local_buffers(self) -> dict[str, Tensor]:
        """Sharded token-aligned buffers the model's forward does not take (e.g. loss_mask)."""
        return dict(self._local_buffers)

    # ------------------------------------------------------------------ preparation
    def _prepare(
        self,
        batch: dict[str, Any],
        hook_context: TrainContext | None = None,
        hook_layout: LayoutKind | None = None,
    ) -> _Prepared:
        batch = {k: v for k, v in batch.items() if v is not None}
        fmt = batch.pop("qkv_format", None)
        if fmt not in (None, "bshd", "thd"):
            raise ValueError(f"qkv_format must be 'bshd' or 'thd', got {fmt!r}")
        thd = fmt == "thd"
        has_ids, has_embeds = "input_ids" in batch, "inputs_embeds" in batch
        if has_ids == has_embeds:
            raise ValueError(
                "the batch must hold exactly one of input_ids and inputs_embeds, got "
                f"{'both' if has_ids else 'neither'}"
            )
        primary = batch["input_ids"] if has_ids else batch["inputs_embeds"]
        if primary.dim() < 2:
            raise ValueError(
                f"input tensor must be [B, S] (ids) or [B, S, H] (embeds), got {tuple(primary.shape)}"
            )
        bsz, seq = int(primary.shape[0]), int(primary.shape[1])
        seq_dims = {k: 1 for k in _KNOWN_TOKEN_KEYS if k in batch}
        for name, dim in self._extra.items():
            if name not in batch:
                raise KeyError(f"extra_seq_buffers names {name!r} but the batch has no such key")
            seq_dims[name] = dim
        mask = batch.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ValueError(
                f"attention_mask must be a [B, S] padding mask, got shape {tuple(mask.shape)}; "
                "the sharder builds the attention pattern itself"
            )
        pos = batch.get("position_ids")
        if pos is not None and pos.dim() == 3:
            seq_dims["position_ids"] = 2  # multi-axis rotary [3, B, S]
        for name, dim in seq_dims.items():
            if batch[name].shape[dim] != seq:
                raise ValueError(
                    f"batch[{name!r}] has length {batch[name].shape[dim]} on dim {dim}, "
                    f"expected the sequence length {seq} of the inputs"
                )
        labels = batch.get("labels")
        if labels is not None:
            num_labels = int((labels != self._ignore_index).sum())
        elif "loss_mask" in batch:
            num_labels = int(batch["loss_mask"].bool().sum())
        else:
            num_labels = 0
        passthrough = {
            k: v for k, v in batch.items() if k not in seq_dims and k not in _SHARDER_KEYS
        }
        if thd:
            return self._prepare_thd(batch, seq_dims, passthrough, bsz, seq, num_labels)
        return self._prepare_bshd(
            batch, seq_dims, passthrough, bsz, seq, num_labels, hook_context, hook_layout
        )

    def _fill(self, name: str, t: Tensor) -> float | bool:
        if name == "input_ids":
            return self._padding_token_id
        if name == "labels":
            return self._ignore_index
        if name == "padding_mask":
            return True
        return False if t.dtype == torch.bool else 0

    def _prepare_bshd(
        self,
        batch: dict[str, Any],
        seq_dims: dict[str, int],
        passthrough: dict[str, Any],
        bsz: int,
        seq: int,
        num_labels: int,
        hook_context: TrainContext | None,
        hook_layout: LayoutKind | None,
    ) -> _Prepared:
        cp = self._cp.size
        if cp == 1:
            kind, padded = LayoutKind.IDENTITY, seq
        elif hook_layout is LayoutKind.CONTIGUOUS:
            kind, padded = LayoutKind.CONTIGUOUS, layouts.round_up(seq, cp)
        else:
            kind, padded = LayoutKind.HEAD_TAIL, layouts.round_up(seq, 2 * cp)
        extra = padded - seq
        user_pos = "position_ids" in batch
        primary = batch.get("input_ids", batch.get("inputs_embeds"))
        assert primary is not None
        if not user_pos:
            # [1, S] broadcasts over the batch; a [B, S] copy would cost the model extra work.
            batch["position_ids"] = torch.arange(seq, device=primary.device)[None]
            seq_dims["position_ids"] = 1
        pos = batch["position_ids"]
        tensors: dict[str, Tensor] = {}
        for name, dim in seq_dims.items():
            t = pos if name == "position_ids" else batch[name]
            if name == "position_ids":
                tensors[name] = _continue_positions(t, extra)
            else:
                tensors[name] = _pad(t, dim, extra, self._fill(name, t))
        doc_ids = None
        if user_pos and "attention_mask" not in batch and tensors["position_ids"].dim() == 2:
            doc_ids = _docs_from_positions(tensors["position_ids"])
        key_valid = None
        if "attention_mask" in tensors:
            key_valid = tensors["attention_mask"].bool()
        return _Prepared(
            tensors=tensors,
            seq_dims=seq_dims,
            passthrough=passthrough,
            kind=kind,
            original_seq_len=seq,
            padded_seq_len=padded,
            input_row_shape=None,
            cu_seqlens_padded=None,
            doc_ids=doc_ids,
            key_valid=key_valid,
            num_label_tokens=num_labels,
            thd=False,
            hook_context=hook_context,
        )

    def _prepare_thd(
        self,
        batch: dict[str, Any],
        seq_dims: dict[str, int],
        passthrough: dict[str, Any],
        bsz: int,
        seq: int,
        num_labels: int,
    ) -> _Prepared:
        cp = self._cp.size
        if "seq_lens" not in batch:
            raise KeyError(
                "a packed batch (qkv_format='thd') needs 'seq_lens': [B, N] real lengths of the "
                "sequences packed in each row (negative entries are ignored)"
            )
        real = torch.as_tensor(batch["seq_lens"]).reshape(bsz, -1).cpu().long()
        padded_lens = (
            torch.as_tensor(batch.get("seq_lens_padded", real)).reshape(bsz, -1).cpu().long()
        )
        if padded_lens.shape != real.shape:
            raise ValueError(
                f"seq_lens_padded has shape {tuple(padded_lens.shape)}, seq_lens {tuple(real.shape)}"
            )
        seg_real: list[int] = []
        seg_padded: list[int] = []
        for b in range(bsz):
            keep = real[b] >= 0
            row_real, row_pad = real[b][keep].tolist(), padded_lens[b][keep].tolist()
            for r_len, p_len in zip(row_real, row_pad, strict=True):
                if p_len < r_len:
                    raise ValueError(
                        f"row {b}: padded length {p_len} is shorter than the real length {r_len}"
                    )
            used = sum(row_pad)
            if used > seq:
                raise ValueError(
                    f"row {b}: packed sequences take {used} tokens but the row holds {seq}"
                )
            if used < seq:
                # Trailing row padding becomes its own padding-only sequence.
                row_real.append(0)
                row_pad.append(seq - used)
            seg_real += row_real
            seg_padded += row_pad
        total = bsz * seq
        divisible = all(p % (2 * cp) == 0 for p in seg_padded)
        if self._family is Backend.TE and not divisible:
            bad = next(p for p in seg_padded if p % (2 * cp))
            raise ValueError(
                f"Transformer Engine THD context parallelism needs every packed sequence padded to a "
                f"multiple of 2*cp={2 * cp}; found a padded length {bad}. Pad each sequence "
                f"(seq_lens_padded) to a multiple of {2 * cp} (energon-sft: pad_to_multiple_of={2 * cp})"
            )
        if cp == 1:
            kind, padded = LayoutKind.IDENTITY, total
        elif divisible:
            kind, padded = LayoutKind.THD, total
        else:
            kind, padded = LayoutKind.HEAD_TAIL, layouts.round_up(total, 2 * cp)
        extra = padded - total
        if extra:
            seg_real.append(0)
            seg_padded.append(extra)
        lens = torch.tensor(seg_padded, dtype=torch.int64)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        seg_of_token = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        offset_in_seg = torch.arange(padded) - cu[:-1][seg_of_token]
        real_t = torch.tensor(seg_real, dtype=torch.int64)
        key_valid = (offset_in_seg < real_t[seg_of_token])[None]
        doc_ids = seg_of_token[None]
        primary: Tensor = batch["input_ids"] if "input_ids" in batch else batch["inputs_embeds"]
        device = primary.device
        if "position_ids" not in batch:
            batch["position_ids"] = offset_in_seg[:total].reshape(bsz, seq).to(device)
            seq_dims["position_ids"] = 1
        tensors: dict[str, Tensor] = {}
        for name, dim in seq_dims.items():
            t = batch[name]
            if name == "position_ids" and t.dim() == 3:
                flat = t.reshape(t.shape[0], 1, total)
                tensors[name] = _continue_positions(flat, extra)
                continue
            if dim != 1:
                raise ValueError(
                    f"packed batches need token buffers as [B, S, ...]; {name!r} has seq dim {dim}"
                )
            flat = t.reshape(1, total, *t.shape[2:])
            if name == "position_ids":
                tensors[name] = _continue_positions(flat, extra)
            else:
                tensors[name] = _pad(flat, 1, extra, self._fill(name, t))
            seq_dims[name] = 1
        if "position_ids" in tensors and tensors["position_ids"].dim() == 3:
            seq_dims["position_ids"] = 2
        key_valid = key_valid.to(device)
        if "attention_mask" in tensors:
            key_valid = key_valid & tensors["attention_mask"].bool()
        return _Prepared(
            tensors=tensors,
            seq_dims=seq_dims,
            passthrough=passthrough,
            kind=kind,
            original_seq_len=total,
            padded_seq_len=padded,
            input_row_shape=(bsz, seq),
            cu_seqlens_padded=cu,
            doc_ids=doc_ids.to(device),
            key_valid=key_valid,
            num_label_tokens=num_labels,
            thd=True,
            hook_context=None,
        )

    # ------------------------------------------------------------------ shard
    def _pick_backend(self, prep: _Prepared) -> Backend:
        if self._family is not Backend.PORTABLE:
            return self._family
        if self._cp.size == 1 and not prep.thd:
            return Backend.NONE
        plain_causal = (
            not prep.thd
            and prep.doc_ids is None
            and (prep.key_valid is None or bool(prep.key_valid.all()))
            and not has_sliding_window(self._model)
        )
        mesh_type = getattr(self._cp.mesh, "device_type", "cpu")
        # Only transformers models: their attention call goes through torch_ring's autograd
        # wrapper, which re-enters torch's ring dispatch for backward. A plain model's own SDPA
        # call would run backward outside train_ctx and get local-only gradients.
        # torch's ring merges per-chunk log-sum-exps that its memory-efficient kernel pads to a
        # multiple of 32 rows, so each head/tail chunk (P / 2cp tokens) must be such a multiple
        # (on an H200 with torch 2.11, P=16 at cp=2 failed inside torch's merge).
        ring_aligned = prep.padded_seq_len % (_RING_CHUNK_ALIGN * 2 * self._cp.size) == 0
        if plain_causal and ring_aligned and self._hf and mesh_type == "cuda" and self._cp.size > 1:
            return Backend.TORCH_RING
        return Backend.PORTABLE

    def shard(self, batch: Mapping[str, Any]) -> tuple[TrainContext, dict[str, Any]]:
        """Pad, lay out and shard a global batch; return the attention context and local batch.

        Every CP rank must pass the same global batch. Keys handled: ``input_ids`` [B, S] or
        ``inputs_embeds`` [B, S, H] (sharded out of place, gradients flow back), ``labels``
        (pre-shifted, padded with ``ignore_index``), ``position_ids`` ([B, S], [1, S] or rotary
        [3, B, S]; synthesised when missing, continued over padding), ``attention_mask`` (padding
        mask, padded with 0), ``padding_mask`` (padded with True), ``loss_mask`` and
        ``extra_seq_buffers``. ``qkv_format == "thd"`` marks a packed batch: rows of sequences
        whose real lengths are ``seq_lens`` [B, N] (and ``seq_lens_padded``), flattened into one
        stream with per-document masking. Other keys pass through unchanged.

        Args:
            batch: the global batch (same on every CP rank).

        Returns:
            (train_ctx, local_batch): enter ``train_ctx()`` around the model call;
            ``local_batch`` holds the keys the model's forward accepts plus ``labels``. Local
            token tensors are [B, P/W, ...] ([1, T_pad/W, ...] for packed batches).
        """
        self._layout = None  # a failed shard() must not leave the previous step's layout behind
        failure: Exception | None = None
        try:
            prep = self._prepare_with_hook(dict(batch))
            cu = prep.cu_seqlens_padded
            summary = [
                prep.padded_seq_len,
                prep.original_seq_len,
                list(LayoutKind).index(prep.kind),
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
        backend = self._pick_backend(prep)
        cp = self._cp
        all_idx = layouts.all_rank_indices(
            prep.kind,
            padded_len=prep.padded_seq_len,
            cp=cp.size,
            cu_seqlens_padded=prep.cu_seqlens_padded,
        )
        local_idx = all_idx[cp.rank]
        self._layout = ShardLayout(
            kind=prep.kind,
            cp_size=cp.size,
            cp_rank=cp.rank,
            local_token_global_indices=local_idx,
            all_rank_indices=all_idx,
            inverse_indices=layouts.inverse_permutation(all_idx.reshape(-1)),
            original_seq_len=prep.original_seq_len,
            padded_seq_len=prep.padded_seq_len,
            input_row_shape=prep.input_row_shape,
            cu_seqlens_padded=prep.cu_seqlens_padded,
            num_label_tokens=prep.num_label_tokens,
            backend=backend,
        )
        local: dict[str, Tensor] = {}
        for name, t in prep.tensors.items():
            if prep.kind is LayoutKind.IDENTITY:
                local[name] = t  # cp=1: nothing moves, nothing is copied
            else:
                local[name] = t.index_select(prep.seq_dims[name], local_idx.to(t.device))
        out, self._local_buffers = self._assemble(local, prep, backend)
        logger.debug(
            "cp shard: cp=%d rank=%d layout=%s backend=%s length %d -> %d",
            cp.size,
            cp.rank,
            prep.kind.value,
            backend.value,
            prep.original_seq_len,
            prep.padded_seq_len,
        )
        return self._context(prep, backend, local_idx, all_idx), out

    def _prepare_with_hook(self, batch: dict[str, Any]) -> _Prepared:
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
        return self._prepare(batch, hook_context, hook_layout)

    def _accepts(self, name: str, *, explicit: bool = False) -> bool:
        return name in self._params or (self._var_kw and not explicit)

    def _assemble(
        self, local: dict[str, Tensor], prep: _Prepared, backend: Backend
    ) -> tuple[dict[str, Any], dict[str, Tensor]]:
        out: dict[str, Any] = {}
        buffers: dict[str, Tensor] = {}
        for name, t in local.items():
            if name == "labels":
                out[name] = t
            elif name == "attention_mask":
                # The portable and ring backends build the pattern from global indices; TE's CP
                # kernels take no padding mask; only a model-owned hook or cp=1 consumes it.
                if backend in (Backend.MODEL_HOOK, Backend.NONE):
                    out[name] = t
                elif backend is Backend.TE and not prep.thd and not bool(t.bool().all()):
                    raise ValueError(
                        "Transformer Engine BSHD context parallelism cannot honour a padding "
                        "attention_mask with masked tokens; pack the batch (qkv_format='thd') or "
                        "right-pad and drop the mask"
                    )
                else:
                    buffers[name] = t
            elif name in _OPTIONAL_BUFFERS or name in self._extra:
                if self._accepts(name, explicit=True):
                    out[name] = t
                buffers[name] = t
            else:
                out[name] = t
        for name, value in prep.passthrough.items():
            if self._accepts(name):
                out[name] = value
        if backend is Backend.TE and prep.thd:
            from cp_sharder.attention import te

            assert prep.cu_seqlens_padded is not None
            lens = prep.cu_seqlens_padded.diff()
            keys = te.thd_batch_keys(
                prep.cu_seqlens_padded.to(local["position_ids"].device), int(lens.max())
            )
            out.update({k: v for k, v in keys.items() if self._accepts(k)})
        return out, buffers

    def _context(
        self, prep: _Prepared, backend: Backend, local_idx: Tensor, all_idx: Tensor
    ) -> TrainContext:
        cp = self._cp
        model = self._model
        if backend is Backend.MODEL_HOOK:
            return prep.hook_context or contextlib.nullcontext
        if backend is Backend.NONE:
            return contextlib.nullcontext
        if backend is Backend.TE:
            if not self._te_attached and cp.size > 1:
                from cp_sharder.attention import te

                te.attach(model, cp)
                self._te_attached = True
            return contextlib.nullcontext
        if backend is Backend.TORCH_RING:
            from cp_sharder.attention import torch_ring

            return torch_ring.make_context(model, cp, self._hf, prep.padded_seq_len)
        from cp_sharder.attention import portable

        spec = portable.MaskSpec(
            q_index=local_idx,
            k_index=all_idx.reshape(-1),
            doc_ids=prep.doc_ids,
            key_valid=prep.key_valid,
        )
        if self._hf:
            fn = portable.make_hf_attention(spec, cp)
            return lambda: portable.hf_attention_override(model, portable.HF_ATTENTION_KEY, fn)
        return lambda: portable.sdpa_override(spec, cp)

    # ------------------------------------------------------------------ token verbs
    def _require_layout(self, verb: str) -> ShardLayout:
        if self._layout is None:
            raise RuntimeError(
                f"{verb} needs the layout of a batch; call shard(batch) first (the layout is "
                "data-dependent and captured by each shard())"
            )
        return self._layout

    def shard_token_tensor(
        self, t: Tensor, *, seq_dim: int = 1, fill: float | None = None
    ) -> Tensor:
        """Give a token-aligned tensor exactly the last batch's layout (out of place).

        Accepted lengths along ``seq_dim``: the padded length P (used as is) or the original
        length S (right-padded with ``fill``, which is then required). For a packed batch a
        tensor whose leading dims are the input rows ``(B, S)`` is flattened first.

        Args:
            t: [..., S or P, ...] (or [B, S, ...] for a packed batch).
            seq_dim: the sequence dimension.
            fill: pad value for the positions added by padding.

        Returns:
            [..., P/W, ...] ([1, P/W, ...] for a packed batch); differentiable.
        """
        layout = self._require_layout("shard_token_tensor")
        if layout.input_row_shape is not None and tuple(t.shape[:2]) == layout.input_row_shape:
            t = t.reshape(1, layout.original_seq_len, *t.shape[2:])
            seq_dim = 1
        length = t.shape[seq_dim]
        if length == layout.original_seq_len and length != layout.padded_seq_len:
            if fill is None:
                raise ValueError(
                    f"tensor has the original length {length}; padding it to "
                    f"{layout.padded_seq_len} needs an explicit fill= value"
                )
            t = _pad(t, seq_dim, layout.padded_seq_len - length, fill)
        elif length != layout.padded_seq_len:
            raise ValueError(
                f"tensor has length {length} on dim {seq_dim}; expected the original length "
                f"{layout.original_seq_len} or the padded length {layout.padded_seq_len}"
            )
        return t.index_select(seq_dim, layout.local_token_global_indices.to(t.device))

    def gather_token_tensor(self, t: Tensor, *, seq_dim: int = 1, trim: bool = False) -> Tensor:
        """Reassemble a local token tensor into global order on every rank (differentiable).

        The backward sums gradients over CP ranks and returns each token's gradient to the rank
        that owns it; a replicated loss on the result therefore reaches owners ``cp`` times (see
        :mod:`cp_sharder.loss`). The inverse permutation is computed locally from the layout.

        Args:
            t: [..., P/W, ...] in this rank's layout.
            seq_dim: the sequence dimension.
            trim: drop the padding: [..., S, ...], or [B, S, ...] for a packed batch (which
                needs ``seq_dim == 1`` and a leading dim of 1).

        Returns:
            [..., P, ...] (or trimmed as above).
        """
        layout = self._require_layout("gather_token_tensor")
        seq_dim = seq_dim % t.dim()
        if t.shape[seq_dim] != layout.local_seq_len:
            raise ValueError(
                f"tensor has length {t.shape[seq_dim]} on dim {seq_dim}; expected the local "
                f"length {layout.local_seq_len} (= padded {layout.padded_seq_len} / cp {layout.cp_size})"
            )
        full = all_gather_seq(t, dim=seq_dim, cp=self._cp)
        full = full.index_select(seq_dim, layout.inverse_indices.to(t.device))
        if not trim:
            return full
        full = full.narrow(seq_dim, 0, layout.original_seq_len)
        if layout.input_row_shape is not None:
            if seq_dim != 1 or full.shape[0] != 1:
                raise ValueError(
                    "trimming a packed tensor back to rows needs it as [1, T, ...] with seq_dim=1, "
                    f"got shape {tuple(full.shape)} and seq_dim={seq_dim}"
                )
            full = full.reshape(*layout.input_row_shape, *full.shape[2:])
        return full

    def num_label_tokens(
        self, *, dp_group: Any = None, device: torch.device | str | None = None
    ) -> Tensor:
        """Label tokens of the last global batch, summed over data-parallel ranks only.

        Use it as the denominator of a token-mean loss; see :mod:`cp_sharder.loss` for the
        gradient contract.
        """
        layout = self._require_layout("num_label_tokens")
        return global_label_tokens(layout.num_label_tokens, dp_group=dp_group, device=device)
