"""Model FLOPs of a training step, and the model-FLOPs utilisation (MFU) against a GPU's peak.

# T real tokens, L a document's length, P vision patches, W a vision window's length,
# E experts, K experts per token, d query heads x head dim

A trained weight costs 6 FLOPs per token it multiplies (2 per multiply-add forward, 2 for the
input's gradient, 2 for the weight's gradient); a frozen one 4 (no weight gradient). Per step:

- text matmuls: (6 x N_trained + 4 x N_frozen) x T. N counts every weight a token is multiplied
  by: each parameter of two or more dimensions outside the vision tower, except embedding
  tables (a lookup, no matmul); the output projection counts once (also when tied). An expert
  bank (a 3-D weight [E, ., .]) counts K/E of its weights, the experts a token reaches; routers
  and shared experts count whole. LoRA: the base weights are frozen (4 each, the forward and
  the gradient that reaches the adapters below), the adapters train (6 each).
- text attention, causal, per document: 12 x d x layers x L(L+1)/2 (QK^T and PV: 4 d FLOPs per
  attended pair forward, 3 x that trained). L is each packed document's length (``seq_lens``)
  or an unpacked row's real tokens, so two documents of L/2 cost about half of one of L.
  Multi-head latent attention (DeepSeek-V3) takes d = heads x (QK head dim + V head dim) / 2.
- vision (Qwen2-VL / Qwen2.5-VL towers, images in ``image_grid_thw``): the blocks' and the patch
  embedding's weights x P, the merger's x P / merge^2 (one merged token per merge^2 patches),
  6 each when the tower trains (4 frozen; 2 when nothing in it trains: no backward reaches it);
  attention 12 x d_vision x W^2 per window in windowed blocks and per image frame in the
  ``fullatt_block_indexes`` blocks (all blocks without windows).

Not counted: norms, activations, rotary embeddings, softmax, the loss, the optimizer, padding,
recomputation (activation checkpointing, attention backward): model FLOPs, not hardware FLOPs.
MFU = model FLOPs / training seconds / GPUs / peak; the peak is ``train.peak_tflops`` or the
dense (no sparsity) bf16 tensor-core peak of the detected GPU (:data:`PEAK_BF16_TFLOPS`).
``tests/test_throughput.py`` checks the counts by hand and against torch's FlopCounterMode.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from energon_sft import SFTBatch

__all__ = [
    "PEAK_BF16_TFLOPS",
    "FlopCounts",
    "VisionCounts",
    "attention_flops",
    "check_windows",
    "detected_peak_tflops",
    "document_lengths",
    "model_counts",
    "peak_memory_gib",
    "rate_fields",
    "resolve_peak_tflops",
    "window_lengths",
]

#: Dense (no sparsity) bf16 tensor-core peaks in TFLOPS, by a pattern of the device name
#: (``torch.cuda.get_device_name``, lower case); the first match wins.
PEAK_BF16_TFLOPS: Mapping[str, float] = {
    r"\bh100\b.*\bpcie\b": 756.0,
    r"\bh100\b.*\bnvl\b": 835.0,
    r"\bh100\b": 989.0,  # SXM ("NVIDIA H100 80GB HBM3")
    r"\bh200\b.*\bnvl\b": 835.0,
    r"\bh200\b": 989.0,
    r"\bgh200\b": 989.0,
    r"\bh800\b.*\bpcie\b": 756.0,
    r"\bh800\b": 989.0,
    r"\bb200\b": 2250.0,
    r"\ba100\b": 312.0,
    r"\ba800\b": 312.0,
    r"\bl40s\b": 362.0,
    r"\bl40\b": 181.0,
    r"\bl4\b": 121.0,
    r"\ba10\b": 125.0,
    r"\bmi300x\b": 1307.0,
}
_GIB = 1024**3


def detected_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name, None when the table does not know it."""
    name = device_name.lower()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if re.search(k, name)), None)


def resolve_peak_tflops(configured: float | None, device: torch.device) -> float | None:
    """``train.peak_tflops`` when set, else the detected GPU's peak, else None (no MFU).

    None on CPU and on a GPU the table does not know.
    """
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    return detected_peak_tflops(torch.cuda.get_device_name(device))


@dataclass(kw_only=True, slots=True, frozen=True)
class VisionCounts:
    """A Qwen2-VL-style vision tower's FLOP counts.

    Attributes:
        per_patch: trained FLOPs of the blocks' and patch embedding's weights per patch.
        per_merged: trained FLOPs of the merger's weights per merged token.
        attn_dim: the tower's d (hidden size).
        depth: vision blocks.
        full_blocks: blocks attending over whole frames (the others attend per window).
        merge: the spatial merge size (patches per merged token: merge^2).
        window_units: merged units per window side; 0 without windows (every block full).
    """

    per_patch: float
    per_merged: float
    attn_dim: int
    depth: int
    full_blocks: int
    merge: int
    window_units: int


@dataclass(kw_only=True, slots=True, frozen=True)
class FlopCounts:
    """What fixes a model's training FLOPs (see the module docstring).

    Attributes:
        per_token: text matmul FLOPs per real token, forward and backward.
        layers: decoder layers.
        attn_dim: d, the attention width of one attended pair.
        vision: the vision tower's counts; None for text models.
    """

    per_token: float
    layers: int
    attn_dim: float
    vision: VisionCounts | None = None

    def batch_flops(self, batch: SFTBatch | Mapping[str, object]) -> dict[str, float]:
        """FLOPs of one trained micro-batch by part, and their "total".

        The parts: "text matmul", "text attention", and for VLMs "vision matmul" and "vision
        attention".

        Args:
            batch: a recipe batch (dict) or an energon-sft batch: ``attention_mask`` [B, S],
                ``seq_lens`` [B, N] when packed, ``image_grid_thw`` [I, 3] with images.
        """
        docs = document_lengths(batch)
        parts = {
            "text matmul": self.per_token * sum(docs),
            "text attention": attention_flops(docs, layers=self.layers, dim=self.attn_dim),
        }
        if self.vision is not None:
            parts.update(_vision_flops(self.vision, _get(batch, "image_grid_thw")))
        parts["total"] = sum(parts.values())
        return parts


def _get(batch: SFTBatch | Mapping[str, object], name: str) -> torch.Tensor | None:
    found = batch.get(name) if isinstance(batch, Mapping) else getattr(batch, name, None)
    return cast("torch.Tensor | None", found)  # the tensor keys this module reads


def document_lengths(batch: SFTBatch | Mapping[str, object]) -> list[int]:
    """Each document's real tokens: ``seq_lens`` when packed, else each row's attention mask."""
    seq_lens = _get(batch, "seq_lens")
    if seq_lens is not None:
        return [int(v) for v in seq_lens.flatten().tolist() if v > 0]
    mask = cast(torch.Tensor, _get(batch, "attention_mask"))  # every batch has one
    return [int(v) for v in mask.sum(dim=-1).tolist() if v > 0]


def attention_flops(lengths: Sequence[int], *, layers: int, dim: float) -> float:
    """Causal attention of a trained step: 12 x dim x layers x sum over documents L(L+1)/2."""
    return 12.0 * dim * layers * sum(n * (n + 1) / 2 for n in lengths)


def _matmul_weights(modules: Iterator[nn.Module], *, top_k: int | None) -> tuple[float, float]:
    """(trained, frozen) weights a token is multiplied by; DTensors count their global size."""
    trained = frozen = 0.0
    for module in modules:
        if isinstance(module, nn.Embedding):
            continue
        for p in module.parameters(recurse=False):
            if p.ndim < 2:
                continue
            n = float(p.numel())
            if p.ndim == 3 and top_k:  # an expert bank (this rank's experts under ep)
                n *= top_k / p.shape[0]
            if p.requires_grad:
                trained += n
            else:
                frozen += n
    return trained, frozen


def _attention_dim(cfg: PretrainedConfig) -> float:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    qk = getattr(cfg, "qk_head_dim", None) or head_dim
    v = getattr(cfg, "v_head_dim", None) or head_dim
    return cfg.num_attention_heads * (qk + v) / 2


def model_counts(model: nn.Module) -> FlopCounts:
    """The FLOP counts of a transformers causal LM or Qwen2-VL-style VLM.

    Pass the model unwrapped from DDP; FSDP2 and tensor-parallel models count their DTensors'
    global sizes, expert-parallel ones their local experts (K/E_local of them per token).
    """
    # Found by name: LoRA's wrappers put the VLM's tower deeper than ``model.model.visual``.
    visual = next((m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == "visual"), None)
    skip = set() if visual is None else {id(m) for m in visual.modules()}
    config = cast("PretrainedConfig", model.config)
    tcfg = getattr(config, "text_config", None) or config
    top_k = getattr(tcfg, "num_experts_per_tok", None)
    text = (m for m in model.modules() if id(m) not in skip)
    trained, frozen = _matmul_weights(text, top_k=top_k)
    vision = None if visual is None else _vision_counts(visual, config.vision_config)
    return FlopCounts(
        per_token=6.0 * trained + 4.0 * frozen,
        layers=tcfg.num_hidden_layers,
        attn_dim=_attention_dim(tcfg),
        vision=vision,
    )


def _vision_counts(visual: nn.Module, vcfg: PretrainedConfig) -> VisionCounts:
    merger = getattr(visual, "merger", None)
    merger_ids = set() if merger is None else {id(m) for m in merger.modules()}
    tower = _matmul_weights((m for m in visual.modules() if id(m) not in merger_ids), top_k=None)
    merged = (0.0, 0.0) if merger is None else _matmul_weights(merger.modules(), top_k=None)
    # Without a trained weight in the tower, no backward reaches it: the forward alone.
    frozen_factor = 4.0 if tower[0] + merged[0] else 2.0
    window = getattr(vcfg, "window_size", 0) or 0
    merge = vcfg.spatial_merge_size
    full = getattr(vcfg, "fullatt_block_indexes", None) or ()
    return VisionCounts(
        per_patch=6.0 * tower[0] + frozen_factor * tower[1],
        per_merged=6.0 * merged[0] + frozen_factor * merged[1],
        attn_dim=vcfg.hidden_size,
        depth=vcfg.depth,
        full_blocks=len(full) if window else vcfg.depth,
        merge=merge,
        window_units=window // merge // vcfg.patch_size,
    )


def _chunks(n: int, size: int) -> Iterator[int]:
    for start in range(0, n, size):
        yield min(size, n - start)


def window_lengths(grid_thw: list[list[int]], *, merge: int, units: int) -> list[int]:
    """Patches per attention window, in transformers' order (frame, window row, window column)."""
    out: list[int] = []
    for t, h, w in grid_thw:
        rows, cols = h // merge, w // merge
        per_frame = [
            r * c * merge * merge for r in _chunks(rows, units) for c in _chunks(cols, units)
        ]
        out.extend(per_frame * t)
    return out


def check_windows(
    grid_thw: list[list[int]], vision_config: PretrainedConfig, counts: FlopCounts
) -> None:
    """Raise if :func:`window_lengths` disagrees with transformers' window index (when present)."""
    try:
        from transformers.vision_utils import get_vision_window_index
    except ImportError:  # older transformers: the tower computes windows itself
        return
    assert counts.vision is not None
    _, cu = get_vision_window_index(
        torch.tensor(grid_thw),
        spatial_merge_size=vision_config.spatial_merge_size,
        window_size=vision_config.window_size,
        patch_size=vision_config.patch_size,
    )
    theirs = [int(v) for v in (cu[1:] - cu[:-1]).tolist() if v > 0]
    ours = window_lengths(grid_thw, merge=counts.vision.merge, units=counts.vision.window_units)
    if ours != theirs:
        raise AssertionError(f"window lengths {ours} differ from transformers' {theirs}")


def _vision_flops(vision: VisionCounts, grid_thw: torch.Tensor | None) -> dict[str, float]:
    grid = [] if grid_thw is None else [[int(v) for v in row] for row in grid_thw.tolist()]
    patches = sum(t * h * w for t, h, w in grid)
    frames = [h * w for t, h, w in grid for _ in range(t)]
    pairs = vision.full_blocks * sum(n * n for n in frames)
    if vision.window_units:
        windows = window_lengths(grid, merge=vision.merge, units=vision.window_units)
        pairs += (vision.depth - vision.full_blocks) * sum(n * n for n in windows)
    return {
        "vision matmul": vision.per_patch * patches
        + vision.per_merged * patches / (vision.merge * vision.merge),
        "vision attention": 12.0 * vision.attn_dim * pairs,
    }


def rate_fields(
    *, tokens: float, flops: float, seconds: float, devices: int, peak_tflops: float | None
) -> dict[str, float]:
    """``tokens_per_s_per_gpu`` and, with a peak, ``mfu`` (a fraction) from global counts.

    Args:
        tokens: real input tokens over all ranks (each replica's once).
        flops: their model FLOPs (:meth:`FlopCounts.batch_flops`), over all ranks.
        seconds: the training time they took.
        devices: the ranks (one GPU each).
        peak_tflops: one device's peak; None leaves ``mfu`` out.
    """
    per_gpu_s = max(seconds, 1e-9) * devices
    fields = {"tokens_per_s_per_gpu": tokens / per_gpu_s}
    if peak_tflops is not None:
        fields["mfu"] = flops / per_gpu_s / (peak_tflops * 1e12)
    return fields


def peak_memory_gib(device: torch.device) -> float | None:
    """The largest ``torch.cuda.max_memory_allocated`` over the ranks, in GiB; None off CUDA.

    Collective on CUDA: every rank calls it at the same point.
    """
    if device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / _GIB], device=device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)
