"""`SFTTaskEncoder`: cooked chat samples -> token ids, shifted labels, pixels, batches.

# L one sample's length, P image patches, D values per patch, N images.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
from megatron.energon import (
    Cooker,
    PackingDataset,
    SavableDataset,
    SkipSample,
    TaskEncoder,
    WorkerConfig,
    stateless,
)

from energon_sft.batch import (
    IGNORE_INDEX,
    EncodedSample,
    SFTBatch,
    collate,
    greedy_pack,
    pack_samples,
)
from energon_sft.cookers import check_cookers, default_cookers
from energon_sft.errors import BadSampleError, OverlongSampleError, SampleErrorHandler
from energon_sft.families import ImageFeatures, decode_image, get_model_family
from energon_sft.render import TrainOn, render_conversation
from energon_sft.schema import ChatSample, image_order

logger = logging.getLogger(__name__)

__all__ = ["SFTTaskEncoder"]

Overlong = Literal["truncate", "skip", "error"]


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class SFTTaskEncoder(TaskEncoder[ChatSample, EncodedSample, SFTBatch, SFTBatch]):
    """Encode chat samples for supervised fine-tuning (an Energon `TaskEncoder`).

    Per sample (in the loader workers): decode the images, run the model family's image
    processor, render with the tokenizer's chat template, tokenize, expand each image
    placeholder to its token count, and build shifted labels where only assistant tokens are
    targets (image tokens never are). See `energon_sft.batch` for the label contract.

    Over-long rows (more than `max_length` tokens after expansion) are, with
    `overlong="truncate"`, stripped of their media (whole image blocks are removed, never cut),
    cut to `max_length` and given weight 0 with every label -100; with `overlong="skip"` they
    are dropped (Energon's `SkipSample`: no failure budget spent); with `overlong="error"` the
    first one stops the loader (`OverlongSampleError`, naming the row). Truncated and skipped
    rows are counted (`SFTLoader.data_stats()`: `truncated`, `skipped/overlong`) and only the
    first of each kind per worker is logged. A row left with no trainable target gets weight
    0 and a counted warning; it never aborts the run.

    Args:
        processor_or_tokenizer: a fast tokenizer with a chat template, or a processor with
            `.tokenizer` (and `.image_processor` for vision families).
        model_family: a registered family (`known_model_families()`), e.g. "text".
        max_length: longest row in tokens after image expansion (also the pack capacity).
        train_on: "all_assistant" or "final_assistant".
        pad_to_multiple_of: batches are right-padded to a multiple of this (e.g. 2*cp).
        packing_buffer_size: when set, pack samples from a buffer of this many into rows of
            `max_length` tokens (first-fit decreasing on the expanded lengths).
        overlong: "truncate" (zero weight, media stripped), "skip" or "error".
        failure_tolerance: bad samples one loader worker may skip before the run fails (>= 1).
        cookers: Energon cookers; default `default_cookers()`.
    """

    # Raw bytes: images are decoded in `encode_sample`, so a corrupt one is a counted skip.
    decoder = None

    def __init__(
        self,
        processor_or_tokenizer: Any,
        *,
        model_family: str,
        max_length: int,
        train_on: TrainOn = "all_assistant",
        pad_to_multiple_of: int = 1,
        packing_buffer_size: int | None = None,
        overlong: Overlong = "truncate",
        failure_tolerance: int = 100,
        cookers: Sequence[Cooker[Any]] | None = None,
    ) -> None:
        self.adapter = get_model_family(model_family)
        self.model_family = model_family
        self.processor = processor_or_tokenizer
        self.tokenizer = self.adapter.tokenizer(processor_or_tokenizer)
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(
                f"{type(self.tokenizer).__name__} is not a fast tokenizer; energon-sft needs "
                "character offsets (PreTrainedTokenizerFast)"
            )
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; set tokenizer.chat_template")
        if max_length < 2:
            raise ValueError(f"max_length={max_length} must be >= 2 (one input, one target)")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be >= 1")
        if train_on not in ("all_assistant", "final_assistant"):
            raise ValueError(
                f"train_on={train_on!r}; expected 'all_assistant' or 'final_assistant'"
            )
        if overlong not in ("truncate", "skip", "error"):
            raise ValueError(f"overlong={overlong!r}; expected 'truncate', 'skip' or 'error'")
        if packing_buffer_size is not None and packing_buffer_size < 1:
            raise ValueError(f"packing_buffer_size={packing_buffer_size} must be >= 1 or None")
        self.max_length = max_length
        self.train_on: TrainOn = train_on
        self.pad_to_multiple_of = pad_to_multiple_of
        self.packing_buffer_size = packing_buffer_size
        self.overlong: Overlong = overlong
        self.failure_tolerance = failure_tolerance
        self.error_handler = SampleErrorHandler(failure_tolerance)
        # Energon's own consecutive-failure limit sits one above ours, so our message (which
        # names the sample and the counts) is the one that ends the run. Never 0 (= no limit).
        self.__default_failure_tolerance__ = failure_tolerance + 1
        self.cookers = list(cookers) if cookers is not None else default_cookers()
        check_cookers(self.cookers)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither pad_token_id nor eos_token_id to pad with")
        self.pad_token_id = int(pad)
        self._image_token_id: int | None = None
        self._marker_ids: frozenset[int] = frozenset()
        if self.adapter.supports_images:
            self._image_token_id = self._token_id(self.adapter.image_token)
            self._marker_ids = frozenset(
                self._token_id(t) for t in self.adapter.image_marker_tokens
            )

    def _token_id(self, token: str | None) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token) if token else None
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ValueError(
                f"model family {self.model_family!r} needs token {token!r} in the vocabulary; "
                "add it as a special token"
            )
        return int(tid)

    @property
    def qkv_format(self) -> str:
        """The batches' attention layout: "thd" (packed documents) or "bshd" (one per row)."""
        return "thd" if self.packing_buffer_size is not None else "bshd"

    # ---------------------------------------------------------------- identity
    def identity(self) -> dict[str, Any]:
        """JSON-able settings that define the encoded stream (part of the loader fingerprint)."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        vocab_src = (
            backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
        )
        return {
            "model_family": self.model_family,
            "adapter": self.adapter.identity(self.processor),
            "tokenizer_class": type(tok).__name__,
            "tokenizer_name": str(getattr(tok, "name_or_path", "")),
            "tokenizer_sha256": _sha256(vocab_src),
            "chat_template_sha256": _sha256(str(tok.chat_template)),
            "max_length": self.max_length,
            "train_on": self.train_on,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "packing_buffer_size": self.packing_buffer_size,
            "overlong": self.overlong,
            "pad_token_id": self.pad_token_id,
            "cookers": [
                {
                    "cook": getattr(c.cook, "__qualname__", repr(c.cook)),
                    "module": getattr(c.cook, "__module__", ""),
                    "has_subflavors": c.has_subflavors,
                }
                for c in self.cookers
            ],
        }

    # ---------------------------------------------------------------- one sample
    def encode_chat(self, sample: ChatSample) -> EncodedSample:
        """Encode one cooked sample (what `encode_sample` runs; callable without Energon)."""
        order = image_order(sample.messages)
        feats: ImageFeatures | None = None
        if order:
            images = [decode_image(sample.media[i]) for i in order]
            feats = self.adapter.process_images(self.processor, images)
        rendered = render_conversation(
            self.tokenizer, sample.messages, sample.tools, train_on=self.train_on
        )
        counts = feats.tokens_per_image if feats is not None else []
        ids, trained, is_image = self._expand(rendered.input_ids, rendered.trained, counts)
        weight = 1.0
        if len(ids) > self.max_length:
            # Image expansion is named only where the row has images.
            size = f"{len(ids)} tokens{' after image expansion' if counts else ''}"
            size += f" > max_length={self.max_length}"
            fix = f"raise max_length to >= {len(ids)} to train on it"
            if self.overlong == "error":
                raise OverlongSampleError.from_sample(
                    sample, f"{size} (overlong='error'); {fix}, or pass overlong='truncate'|'skip'"
                )
            if self.overlong == "skip":
                self.error_handler.note("skipped/overlong", sample, f"{size}: dropped; {fix}")
                raise SkipSample()
            stripped = "media stripped, " if counts else ""
            self.error_handler.note(
                "truncated",
                sample,
                f"{size}: {stripped}cut to {self.max_length} tokens, weight 0 (it trains "
                f"nothing); {fix}, or pass overlong='skip' to drop such samples",
            )
            drop = set(self._marker_ids)
            if self._image_token_id is not None:
                drop.add(self._image_token_id)
            ids = [t for t in ids if t not in drop][: self.max_length]
            trained = [False] * len(ids)
            is_image = [False] * len(ids)
            feats = None
            weight = 0.0
        n = len(ids)
        position_ids = torch.arange(n, dtype=torch.int64)
        image_mask = torch.tensor(is_image, dtype=torch.bool)
        grids = feats.grids if feats is not None else torch.zeros((0, 3), dtype=torch.int64)
        input_ids = torch.tensor(ids, dtype=torch.int64)
        target = torch.tensor(trained, dtype=torch.bool)
        labels = torch.full((n,), IGNORE_INDEX, dtype=torch.int64)
        # The shift, once: position t predicts token t + 1.
        labels[:-1] = torch.where(target[1:], input_ids[1:], IGNORE_INDEX)
        if weight > 0 and not bool((labels != IGNORE_INDEX).any()):
            self.error_handler.note(
                "no_trainable_tokens", sample, "no assistant target after the shift; weight 0"
            )
            weight = 0.0
        return EncodedSample.derive_from(
            sample,
            input_ids=input_ids,
            labels=labels,
            position_ids=position_ids,
            image_mask=image_mask,
            # M-RoPE families: built here, in the worker, per document (packing concatenates).
            mrope_position_ids=self.adapter.mrope_position_ids(
                self.processor, position_ids, image_mask, grids
            ),
            pixel_values=feats.pixel_values if feats is not None else None,
            image_grid_thw=grids,
            seq_lens=[n],
            sample_weights=[weight],
            source_ids=[sample.source_id],
        )

    def _expand(
        self, ids: list[int], trained: list[bool], counts: list[int]
    ) -> tuple[list[int], list[bool], list[bool]]:
        """Repeat the k-th image placeholder counts[k] times; image tokens are never trained."""
        img = self._image_token_id
        out_ids: list[int] = []
        out_trained: list[bool] = []
        out_image: list[bool] = []
        k = 0
        for tid, tr in zip(ids, trained, strict=True):
            if img is not None and tid == img:
                if k >= len(counts):
                    raise BadSampleError(
                        "image_placeholder_mismatch",
                        f"the render has more image placeholders than the {len(counts)} "
                        f"image(s) of the sample (a literal {self.adapter.image_token!r} in the "
                        "text?); remove it from the text or give each placeholder its image",
                    )
                out_ids.extend([tid] * counts[k])
                out_trained.extend([False] * counts[k])
                out_image.extend([True] * counts[k])
                k += 1
            else:
                out_ids.append(tid)
                out_trained.append(tr and tid not in self._marker_ids)
                out_image.append(False)
        if k != len(counts):
            raise BadSampleError(
                "image_placeholder_mismatch",
                f"the chat template rendered {k} image placeholder(s) for {len(counts)} "
                "image(s); reference every media item exactly once from the messages "
                "({'type': 'image', 'media_index': i})",
            )
        return out_ids, out_trained, out_image

    # ---------------------------------------------------------------- Energon hooks
    def build_batch(
        self,
        dataset: SavableDataset[Any],
        *,
        batch_size: int | None,
        batch_drop_last: bool = False,
        packing_buffer_size: int | None = None,
        worker_config: WorkerConfig,
    ) -> SavableDataset[Any]:
        """Energon hook: Energon's batching (and packing), its packing buffer filled quietly."""
        built = super().build_batch(
            dataset,
            batch_size=batch_size,
            batch_drop_last=batch_drop_last,
            packing_buffer_size=packing_buffer_size,
            worker_config=worker_config,
        )
        node: Any = built
        while node is not dataset and node is not None:
            if isinstance(node, PackingDataset):
                node._fill_reading_buffer = functools.partial(_fill_quietly, node)
            node = getattr(node, "dataset", None)
        return built

    @stateless
    def encode_sample(self, sample: ChatSample) -> EncodedSample:
        """Energon hook: :meth:`encode_chat`."""
        return self.encode_chat(sample)

    @stateless
    def select_samples_to_pack(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
        """Energon hook: greedy packs of at most ``max_length`` tokens."""
        lengths = [int(s.input_ids.numel()) for s in samples]
        return [[samples[i] for i in b] for b in greedy_pack(lengths, self.max_length)]

    @stateless
    def pack_selected_samples(self, samples: list[EncodedSample]) -> EncodedSample:
        """Energon hook: one packed sample from a selected pack."""
        return EncodedSample.derive_from(
            samples[0],
            __key__=",".join(s.__key__ for s in samples),
            __restore_key__=(),
            **pack_samples(samples),
        )

    @stateless
    def batch(self, samples: list[EncodedSample]) -> SFTBatch:
        """Energon hook: :meth:`collate`."""
        return self.collate(samples)

    def collate(self, samples: Sequence[EncodedSample]) -> SFTBatch:
        """Collate encoded samples into an `SFTBatch` (also usable outside Energon)."""
        fields = collate(
            samples,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            qkv_format=self.qkv_format,
        )
        wc = WorkerConfig.active_worker_config
        worker_id = wc.rank_worker_id() if wc is not None else 0
        return SFTBatch.from_samples(
            samples,
            **fields,
            worker_stats=self.error_handler.snapshot(),
            worker_id=worker_id,
            logical_shard=-1,
            shard_step=-1,
        )


def _fill_quietly(packing: Any, source_iter: Iterator[Any], log_progress: bool = False) -> bool:
    """Energon's ``PackingDataset._fill_reading_buffer`` without its progress bar.

    Energon draws a tqdm bar ("Filling reading buffer") for the first fill, in every loader
    worker of every rank, with no setting to turn it off; the training's own bar is the one
    to read. (A bound partial, not a subclass: Energon's saved state names the class.)
    """
    return bool(type(packing)._fill_reading_buffer(packing, source_iter, log_progress=False))
