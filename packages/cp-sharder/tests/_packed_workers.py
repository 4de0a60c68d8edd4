"""Rank functions for the packed (THD) tests; also run in-process for cp=1.

Every check builds the same packed rows on every rank from a fixed seed, runs them through the
sharder on an unmodified transformers model (float64), and compares the token-sum loss and every
parameter gradient with each document run alone through a copy of the model.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from cp_sharder import ContextParallelSharder
from train_testing.reference import grads_of, token_sum_cross_entropy, worst_grad_error
from train_testing.tiny_hf import TEXT_SIZES
from train_testing.tiny_hf import tiny_model as tiny_model_of

VOCAB = TEXT_SIZES["vocab_size"]

# (name, per-row real lengths, per-row padded lengths or None, row length)
CASES: list[tuple[str, list[list[int]], list[list[int]] | None, int]] = [
    # Lengths not divisible by 2*cp, a document longer than a CP chunk (17 > 48/4), trailing
    # padding in both rows, and row 1 holding a single document.
    ("unpadded", [[5, 11, 3], [17]], None, 24),
    # Documents padded to a multiple of 2*cp=4 (per-document head/tail at cp=2), row 1 with a
    # single document and a trailing padding sequence.
    ("padded", [[5, 9], [13]], [[8, 12], [16]], 20),
]


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer random-init causal LM (hidden 32, vocab 128, GQA 4/2) in float64."""
    if arch not in ("llama", "qwen3"):
        raise ValueError(arch)
    return tiny_model_of(arch, seed=seed, dtype=torch.float64)


def packed_batch(
    real: list[list[int]], padded: list[list[int]] | None, seq: int, seed: int, *, absent: int = -1
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Packed rows (labels pre-shifted, -100 on padding) and each document's tokens.

    ``seq_lens`` [B, N] (and ``seq_lens_padded``) hold ``absent`` (any negative) past a row's
    last document.
    """
    g = torch.Generator().manual_seed(seed)
    rows = len(real)
    ids = torch.zeros(rows, seq, dtype=torch.long)
    labels = torch.full((rows, seq), -100, dtype=torch.long)
    docs: list[torch.Tensor] = []
    pads = padded if padded is not None else real
    for b in range(rows):
        start = 0
        for r_len, p_len in zip(real[b], pads[b], strict=True):
            tok = torch.randint(1, VOCAB, (r_len,), generator=g)
            ids[b, start : start + r_len] = tok
            labels[b, start : start + r_len - 1] = tok[1:]
            docs.append(tok)
            start += p_len
    width = max(len(r) for r in real)
    seq_lens = torch.full((rows, width), absent)
    seq_lens_padded = torch.full((rows, width), absent)
    for b in range(rows):
        seq_lens[b, : len(real[b])] = torch.tensor(real[b])
        seq_lens_padded[b, : len(pads[b])] = torch.tensor(pads[b])
    batch: dict[str, Any] = {
        "input_ids": ids,
        "labels": labels,
        "seq_lens": seq_lens,
        "qkv_format": "thd",
    }
    if padded is not None:
        batch["seq_lens_padded"] = seq_lens_padded
    return batch, docs


def reference(model: torch.nn.Module, docs: list[torch.Tensor]) -> tuple[float, dict[str, Any]]:
    """Token-sum loss and gradients with every document run alone through a model copy."""
    ref = copy.deepcopy(model)
    ref.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    for d in docs:
        logits = ref(input_ids=d[None]).logits[0, :-1]
        total = total + token_sum_cross_entropy(logits, d[1:])
    total.backward()
    grads = grads_of(ref)
    return float(total.detach()), grads


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a dense attention mask was built on the packed path")


@contextlib.contextmanager
def no_dense_masks() -> Iterator[None]:
    """Make every dense mask builder (transformers' and cp-sharder's portable one) raise."""
    import transformers.masking_utils as mu

    from cp_sharder.attention import portable

    saved_map = dict(mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping)
    names = ("sdpa_mask", "eager_mask", "flex_attention_mask", "flash_attention_mask")
    saved_fns = {n: getattr(mu, n) for n in names if hasattr(mu, n)}
    saved_spec = portable.MaskSpec.mask
    try:
        for key in saved_map:
            mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[key] = _raise
        for n in saved_fns:
            setattr(mu, n, _raise)
        portable.MaskSpec.mask = _raise  # type: ignore[method-assign]
        yield
    finally:
        mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.update(saved_map)
        for n, fn in saved_fns.items():
            setattr(mu, n, fn)
        portable.MaskSpec.mask = saved_spec  # type: ignore[method-assign]


def packed_step(
    model: torch.nn.Module, mesh: Any, batch: dict[str, Any]
) -> tuple[float, dict[str, torch.Tensor], str, str]:
    """One packed forward/backward through the sharder; loss and grads summed over CP ranks."""
    model.zero_grad()
    sharder = ContextParallelSharder(model, mesh, padding_token_id=0)
    result = sharder.shard(batch)
    local = dict(result.batch)
    labels = local.pop("labels")
    with no_dense_masks(), result.train_ctx():
        logits = model(**local).logits
    loss = token_sum_cross_entropy(logits, labels)
    loss.backward()
    total = loss.detach().clone()
    grads = grads_of(model)
    if mesh is not None:
        group = mesh.get_group()
        dist.all_reduce(total, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return float(total), grads, result.layout.backend.value, result.layout.sequence.kind.value


def compare(
    loss: float, grads: dict[str, torch.Tensor], ref_loss: float, ref: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Relative loss error and the worst relative gradient error over all parameters."""
    missing = sorted(set(ref) ^ set(grads))
    worst, worst_name = worst_grad_error(grads, ref)
    return {
        "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
        "grad_rel_err": worst,
        "worst_param": worst_name,
        "worst_param_grad_max": float(ref[worst_name].abs().max()) if worst_name else 0.0,
        "missing_grads": missing,
    }


def packed_parity(rank: int, world_size: int, arch: str) -> dict[str, dict[str, Any]]:
    """Every CASES entry at this world size (mesh None at world size 1)."""
    mesh = None
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = tiny_model(arch)
    out: dict[str, dict[str, Any]] = {}
    for seed, (name, real, padded, seq) in enumerate(CASES):
        batch, docs = packed_batch(real, padded, seq, seed=100 + seed)
        ref_loss, ref = reference(model, docs)
        loss, grads, backend, kind = packed_step(model, mesh, batch)
        out[name] = compare(loss, grads, ref_loss, ref) | {"backend": backend, "layout": kind}
    return out


# Qwen2.5-VL special tokens of the tiny config (inside the 128-token vocabulary).
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123


def tiny_vlm(seed: int = 0) -> torch.nn.Module:
    """A tiny random-init Qwen2.5-VL (1 vision block, 2 text layers, hidden 32) in float64."""
    tokens = {
        "image_token_id": IMAGE,
        "video_token_id": VIDEO,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
    }
    vision = {"patch_size": 2, "window_size": 8}
    return tiny_model_of(
        "qwen2_5_vl",
        seed=seed,
        dtype=torch.float64,
        vision=vision,
        tie_word_embeddings=False,
        **tokens,
    )


def _vlm_doc(
    g: torch.Generator, before: int, after: int, grid: tuple[int, int, int] | None
) -> dict:
    text = [torch.randint(1, 100, (n,), generator=g) for n in (before, after)]
    if grid is None:
        return {"ids": torch.cat(text), "pixels": None, "grid": None}
    t, h, w = grid
    tokens = t * h * w // 4  # spatial_merge_size 2
    ids = torch.cat(
        [
            text[0],
            torch.tensor([VISION_START]),
            torch.full((tokens,), IMAGE),
            torch.tensor([VISION_END]),
            text[1],
        ]
    )
    pixels = torch.randn(t * h * w, 3 * 2 * 2 * 2, generator=g, dtype=torch.float64)
    return {"ids": ids, "pixels": pixels, "grid": torch.tensor([grid])}


def vlm_parity(rank: int, world_size: int) -> dict[str, Any]:
    """Packed image-text rows (THD, [4, B, S] M-RoPE ids) vs each document alone."""
    mesh = None
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = tiny_vlm()
    g = torch.Generator().manual_seed(5)
    rows_docs = [
        [_vlm_doc(g, 3, 4, (1, 4, 4)), _vlm_doc(g, 4, 3, None)],  # 13 + 7 tokens, 4 padding
        [_vlm_doc(g, 2, 9, (1, 4, 8))],  # one document of 21 tokens (8 image tokens)
    ]
    seq = 24
    rope = model.model.get_rope_index
    ids = torch.zeros(2, seq, dtype=torch.long)
    labels = torch.full((2, seq), -100)
    positions = torch.zeros(4, 2, seq, dtype=torch.long)
    seq_lens = torch.full((2, 2), -1)
    pixels, grids = [], []
    ref = copy.deepcopy(model)
    ref_total = torch.zeros((), dtype=torch.float64)
    for r, docs in enumerate(rows_docs):
        start = 0
        for i, doc in enumerate(docs):
            d, n = doc["ids"], doc["ids"].numel()
            ids[r, start : start + n] = d
            labels[r, start : start + n - 1] = d[1:]
            seq_lens[r, i] = n
            positions[0, r, start : start + n] = torch.arange(n)
            kwargs: dict[str, Any] = {}
            if doc["grid"] is not None:
                pixels.append(doc["pixels"])
                grids.append(doc["grid"])
                mrope, _ = rope(
                    d[None], image_grid_thw=doc["grid"], mm_token_type_ids=(d == IMAGE)[None].int()
                )
                kwargs = {
                    "pixel_values": doc["pixels"],
                    "image_grid_thw": doc["grid"],
                    "mm_token_type_ids": (d == IMAGE)[None].int(),
                }
            else:
                mrope = torch.arange(n).expand(3, 1, n)
            positions[1:, r, start : start + n] = mrope[:, 0]
            # Reference: the document alone; the model builds its own M-RoPE ids.
            logits = ref(input_ids=d[None], **kwargs).logits[0, :-1]
            ref_total = ref_total + token_sum_cross_entropy(logits, d[1:])
            start += n
    ref_total.backward()
    ref_grads = grads_of(ref)
    batch = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.cat(grids),
        "seq_lens": seq_lens,
        "qkv_format": "thd",
    }
    out: dict[str, Any] = {}
    # The same rows as [B, S] with documents marked only by restarting position ids and
    # zero-padded positions (energon-sft's collate).
    cases = {"bshd": {k: v for k, v in batch.items() if k not in ("seq_lens", "qkv_format")}}
    cases["thd"] = batch
    for name, case in cases.items():
        loss, grads, backend, kind = packed_step(model, mesh, case)
        out[name] = compare(loss, grads, float(ref_total.detach()), ref_grads) | {
            "backend": backend,
            "layout": kind,
            "vision_grads": sum(1 for n in grads if n.startswith("model.visual")),
        }
    return out


def cuda_packed_parity(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """CUDA bf16 (torch's varlen_attn kernel) packed rows vs the CPU float64 documents alone."""
    device = torch.device("cuda", torch.cuda.current_device())
    mesh = None
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("cp",))
    cpu_model = tiny_model("llama")
    model = copy.deepcopy(cpu_model).to(device=device, dtype=torch.bfloat16)
    out: dict[str, dict[str, Any]] = {}
    for seed, (name, real, padded, seq) in enumerate(CASES):
        batch, docs = packed_batch(real, padded, seq, seed=100 + seed)
        ref_loss, ref = reference(cpu_model, docs)
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        loss, grads, backend, kind = packed_step(model, mesh, batch)
        grads = {n: g.double().cpu() for n, g in grads.items()}
        out[name] = compare(loss, grads, ref_loss, ref) | {"backend": backend, "layout": kind}
    return out
