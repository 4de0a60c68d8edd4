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
import torch.nn.functional as F

from cp_sharder import ContextParallelSharder

VOCAB = 128

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
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(**common)).double()
    if arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(seed)
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8)).double()
    raise ValueError(arch)


def packed_batch(
    real: list[list[int]], padded: list[list[int]] | None, seq: int, seed: int
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Packed rows (labels pre-shifted, -100 on padding) and each document's tokens."""
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
    seq_lens = torch.full((rows, width), -1)
    seq_lens_padded = torch.full((rows, width), -1)
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
        total = total + F.cross_entropy(logits, d[1:], reduction="sum")
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
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


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over labelled tokens of -log p(label)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


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
    loss = token_sum(logits, labels)
    loss.backward()
    total = loss.detach().clone()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if mesh is not None:
        group = mesh.get_group()
        dist.all_reduce(total, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return float(total), grads, result.layout.backend.value, result.layout.kind.value


def compare(
    loss: float, grads: dict[str, torch.Tensor], ref_loss: float, ref: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Relative loss error and the worst relative gradient error over all parameters."""
    missing = sorted(set(ref) ^ set(grads))
    worst, worst_name = 0.0, ""
    for name, r in ref.items():
        g = grads.get(name, torch.zeros_like(r))
        err = float((g - r).abs().max()) / (float(r.abs().max()) + 1e-12)
        if err > worst:
            worst, worst_name = err, name
    return {
        "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
        "grad_rel_err": worst,
        "worst_param": worst_name,
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
