"""Rank functions for the recipes' distributed tests (a light module: ranks re-import it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def metric_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of a run folder's ``metrics.jsonl``, in order (blank lines skipped)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def logged_losses(rows: list[dict[str, Any]]) -> dict[int, float]:
    """{step: loss} of the metric rows that log a training loss."""
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def run_sft_on_rank(
    rank: int,
    world_size: int,
    overrides: list[str],
    probe: list[list[int]],
    resume: bool = False,
) -> dict[str, Any]:
    """Run the SFT recipe on this rank (``resume``: from the output folder's newest checkpoint);
    rank 0 returns the logged losses and probe logits."""
    from train_recipes.config import SFTConfig, load_config, validate_sft
    from train_recipes.sft.run import run_sft

    config = load_config(SFTConfig, None, overrides)
    validate_sft(config, world_size=world_size)
    result = run_sft(config, resume=resume)
    # Every rank runs the probe forward: an FSDP2 model's forward is collective.
    with torch.no_grad():
        result.model.eval()
        logits = result.model(input_ids=torch.tensor(probe)).logits
        if hasattr(logits, "full_tensor"):  # vocab-sharded DTensor (tp > 1): gather, collective
            logits = logits.full_tensor()
    if rank != 0:
        return {}
    rows = metric_rows(config.train.output_dir)
    return {
        "losses": logged_losses(rows),
        "metrics": rows[-1],
        "logits": logits,
        "accuracy_before": result.accuracy_before,
        "accuracy_after": result.accuracy_after,
        "export_dir": str(result.export_dir),
    }


def run_retrieval_on_rank(rank: int, world_size: int, overrides: list[str]) -> dict[str, Any]:
    """Run the retrieval recipe; every rank returns its recall numbers (they must agree)."""
    from train_recipes.config import RetrievalConfig, load_config, validate_retrieval
    from train_recipes.retrieval.recipe import run_retrieval

    config = load_config(RetrievalConfig, None, overrides)
    validate_retrieval(config, world_size=world_size)
    result = run_retrieval(config)
    return {
        "before": result.recall_before,
        "after": result.recall_after,
        "first_loss": result.first_loss,
        "last_loss": result.last_loss,
    }


def run_lora_on_rank(
    rank: int, world_size: int, overrides: list[str], probe: list[list[int]], adapter_dir: str
) -> dict[str, Any]:
    """A LoRA SFT run; rank 0 also writes the adapter-only export and checks frozen weights."""
    from train_recipes.config import SFTConfig, load_config, validate_sft
    from train_recipes.data.demo import build_char_tokenizer
    from train_recipes.export.hf import export_hf
    from train_recipes.model.build import build_model
    from train_recipes.sft.run import run_sft

    config = load_config(SFTConfig, None, overrides)
    validate_sft(config, world_size=world_size)
    result = run_sft(config)
    if rank != 0:
        return {}
    model: Any = result.model
    with torch.no_grad():
        model.eval()
        logits = model(input_ids=torch.tensor(probe)).logits
    export_hf(model, build_char_tokenizer(), adapter_dir, is_main=True, lora_export="adapter")
    # The base weights stay at their seeded initial values; only the adapters moved.
    torch.manual_seed(config.train.seed)
    fresh = build_model(config, build_char_tokenizer()).state_dict()
    base = model.get_base_model().state_dict()
    frozen_equal = all(
        torch.equal(fresh[k], v) for k, v in base.items() if "lora_" not in k and k in fresh
    )
    lora_names = [n for n, p in model.named_parameters() if p.requires_grad]
    rows = metric_rows(config.train.output_dir)
    return {
        "losses": logged_losses(rows),
        "logits": logits,
        "frozen_equal": frozen_equal,
        "trainable": lora_names,
        "export_dir": str(result.export_dir),
    }


def compiled_layers_under_fsdp2(
    rank: int, world_size: int, memory_budget: float | None = None
) -> dict[str, Any]:
    """Loss and gradients of a tiny Llama with compiled decoder layers under FSDP2, and of the
    same model eager and unwrapped (float64 reference). With ``memory_budget`` the layers are
    partitioned under it (aot_eager_decomp_partition: the min-cut partitioner, no codegen)."""
    from torch.distributed.device_mesh import init_device_mesh

    from train_engine import FSDP2Config, apply_data_parallel
    from train_recipes.model.build import compile_decoder_layers
    from train_recipes.sft.run import token_sum_loss
    from train_testing.tiny_hf import tiny_model

    config = {"vocab_size": 97, "num_hidden_layers": 3, "use_cache": False}
    torch.manual_seed(rank)
    ids = torch.randint(0, 97, (2, 12))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(12).expand(2, 12)}

    reference = tiny_model("llama", dtype=torch.float64, **config)
    ref_loss = token_sum_loss(reference, batch)
    ref_loss.backward()

    model = tiny_model("llama", **config)
    names_before = [n for n, _ in model.named_parameters()]
    if memory_budget is None:
        compiled = compile_decoder_layers(model, backend="aot_eager")
    else:
        compiled = compile_decoder_layers(
            model, backend="aot_eager_decomp_partition", memory_budget=memory_budget
        )
    mesh = init_device_mesh("cpu", (world_size,))
    model = apply_data_parallel(model, mesh=mesh, config=FSDP2Config())
    losses = []
    for _ in range(2):  # the second call reuses the traced graph
        model.zero_grad()
        loss = token_sum_loss(model, batch)
        loss.backward()
        losses.append(float(loss))
    grads = {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    from torch._dynamo.utils import counters

    return {
        "compiled": compiled,
        "names_unchanged": names_before == [n for n, _ in model.named_parameters()],
        "loss_err": max(abs(x - float(ref_loss)) / abs(float(ref_loss)) for x in losses),
        # FSDP2 averages gradients over ranks, each rank had its own batch: compare the mean.
        "grads": grads,
        "ref_grads": ref_grads,
        "unique_graphs": counters["stats"]["unique_graphs"],
    }
