"""Rank functions for the megatron backend (a light module: spawned ranks re-import it).

Every check builds an unmodified Hugging Face Llama (random init from a config, float64) as the
independent reference, loads its weights into a megatron-core GPTModel (float32, local spec,
the recipe's SegmentCausalAttention) at some tp, and compares per-token log-probs, the
Engine's loss, gradients, global gradient norm and clipped update with float64 autograd on the
HF model, each document run alone (no packing). megatron-core runs on CPU through the
test-only shim ``train_testing.megatron_cpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from _packing_workers import packed_batch, tiny_model

LR, CLIP = 0.5, 0.05


def _unpacked_batch(seed: int) -> tuple[dict[str, Any], list[list[Any]]]:
    """Two rows of one document each (bshd), as the recipe's batch_tensors gives them."""
    from _packing_workers import _encoded, _text_doc
    from energon_sft.batch import collate
    from train_recipes.data import energon_api as data_api

    g = torch.Generator().manual_seed(seed)
    docs = [_encoded(_text_doc(n, g), vlm=False, key=f"u{n}") for n in (9, 14)]
    fields = collate(docs, pad_token_id=0, pad_to_multiple_of=4)
    return data_api.batch_tensors(fields), [[d] for d in docs]


def _reference_token_log_probs(hf: torch.nn.Module, rows: list[list[Any]]) -> list[Tensor]:
    """float64 log p(label) of every document alone, in stream order (untrained -> 0)."""
    out = []
    for docs in rows:
        for doc in docs:
            logits = hf(input_ids=doc.input_ids[None], use_cache=False).logits[0]
            logp = torch.log_softmax(logits.double(), -1)
            keep = doc.labels != -100
            picked = logp.gather(-1, doc.labels.clamp(min=0)[:, None])[:, 0]
            out.append(torch.where(keep, picked, torch.zeros_like(picked)))
    return out


def _stream_positions(batch: dict[str, Any], rows: list[list[Any]]) -> list[Tensor]:
    """Index of each document's tokens in the flattened [B * S] stream, in stream order."""
    seq = batch["input_ids"].shape[1]
    out = []
    for r, docs in enumerate(rows):
        start = r * seq
        for doc in docs:
            n = doc.input_ids.numel()
            out.append(torch.arange(start, start + n))
            start += n
    return out


def _megatron_model(hf: torch.nn.Module, tp: int) -> Any:
    from train_recipes.megatron.convert import load_hf_weights
    from train_recipes.megatron.model import build_gpt_model

    model = build_gpt_model(hf.config, tp=tp, dtype=torch.float32)
    load_hf_weights(model, {k: v.float() for k, v in hf.state_dict().items()}, hf.config)
    return model


def check_engine_matches_hf(rank: int, world_size: int, tp: int) -> dict[str, Any]:
    """One accumulation window (a packed and an unpacked micro-batch) through the Engine.

    tp ranks shard the model; the remaining world_size / tp ranks are data-parallel replicas
    that all see the same batches (so the global token count is dp times one replica's).
    """
    from megatron.core import parallel_state
    from torch.distributed.device_mesh import init_device_mesh

    from train_engine import Engine
    from train_recipes.megatron.convert import hf_to_megatron
    from train_recipes.megatron.model import init_megatron_parallel
    from train_recipes.megatron.training import megatron_token_sum_loss, wrap_data_parallel
    from train_testing.megatron_cpu import megatron_on_cpu
    from vocab_parallel import token_log_probs

    dp = world_size // tp
    with megatron_on_cpu():
        init_megatron_parallel(tp, seed=0)
        try:
            hf = tiny_model("llama")
            model = _megatron_model(hf, tp)
            micro = [packed_batch("llama", seed=3), _unpacked_batch(seed=4)]

            # Per-document results on the packed (thd) batch: every token's log-prob equals
            # the HF model's on its document alone.
            from energon_sft import to_megatron_inputs

            batch, rows = micro[0]
            inputs = to_megatron_inputs(batch)
            with torch.no_grad():
                logits = model(
                    inputs.tokens,
                    inputs.position_ids,
                    None,
                    packed_seq_params=inputs.packed_seq_params(),
                )
                log_p = token_log_probs(
                    logits,
                    inputs.labels,
                    vocab_group=parallel_state.get_tensor_model_parallel_group(),
                )[0]
                expected = _reference_token_log_probs(hf, rows)
            for doc, (where, ref) in enumerate(
                zip(_stream_positions(batch, rows), expected, strict=True)
            ):
                torch.testing.assert_close(
                    log_p[where].double(),
                    ref,
                    atol=2e-5,
                    rtol=1e-5,
                    msg=lambda m, doc=doc: f"rank {rank} tp={tp}, packed document {doc}: {m}",
                )

            # The float64 reference window: summed token losses over both micro-batches,
            # divided by the global token count (each replica sees the same tokens).
            tokens = sum(int((b["labels"] != -100).sum()) for b, _ in micro)
            hf.zero_grad()
            ref_loss = sum(
                -torch.cat(_reference_token_log_probs(hf, rows)).sum() for _, rows in micro
            )
            (ref_loss / tokens).backward()
            ref_grads = hf_to_megatron(
                {k: p.grad for k, p in hf.named_parameters()},
                hf.config,
                tp=tp,
                tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            )
            ref_norm = torch.sqrt(sum(p.grad.double().square().sum() for p in hf.parameters()))

            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            wrapped = wrap_data_parallel(model, dp_group=mesh["dp"].get_group())
            engine = Engine(
                wrapped,
                torch.optim.SGD(model.parameters(), lr=LR),
                max_grad_norm=CLIP,
                gradient_accumulation_steps=2,
                dp_group=mesh["dp"].get_group(),
            )
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            losses = []
            for i, (batch, _) in enumerate(micro):
                loss = megatron_token_sum_loss(engine, batch)
                engine.backward(loss, num_tokens=tokens * dp)
                losses.append(float(loss))
                if i == 1:  # the window's last backward: every gradient is final here
                    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                result = engine.step()
            assert result.updated and not result.skipped, result

            torch.testing.assert_close(
                torch.tensor(sum(losses), dtype=torch.float64),
                ref_loss.detach(),
                atol=1e-4,
                rtol=1e-5,
                msg=lambda m: f"rank {rank} tp={tp} window loss: {m}",
            )
            for name, ref in ref_grads.items():
                torch.testing.assert_close(
                    grads[name].double(),
                    ref.double(),
                    atol=2e-6,
                    rtol=1e-4,
                    msg=lambda m, name=name: f"rank {rank} tp={tp} gradient of {name}: {m}",
                )
            # The global norm counts tp-sharded weights once per shard, replicated ones once.
            norm = float(result.grad_norm)
            assert abs(norm - float(ref_norm)) <= 1e-5 * float(ref_norm), (norm, float(ref_norm))
            scale = min(1.0, CLIP / (float(ref_norm) + 1e-6))
            assert scale < 1.0, "the test must exercise clipping"
            for name, p in model.named_parameters():
                expected_param = before[name].double() - LR * scale * ref_grads[name].double()
                torch.testing.assert_close(
                    p.detach().double(),
                    expected_param,
                    atol=1e-6,
                    rtol=1e-5,
                    msg=lambda m, name=name: f"rank {rank} tp={tp} clipped update of {name}: {m}",
                )
            return {"loss": sum(losses), "norm": norm}
        finally:
            parallel_state.destroy_model_parallel()


def check_hf_export_round_trip(rank: int, world_size: int, tp: int, out_dir: str) -> str:
    """HF -> megatron (tp shards) -> gathered -> HF names: bitwise the same weights, and the
    exported folder loads with from_pretrained and gives the GPTModel's log-probs."""
    from megatron.core import parallel_state
    from transformers import LlamaForCausalLM

    from train_recipes.megatron.convert import megatron_state_dict_full, megatron_to_hf
    from train_recipes.megatron.model import init_megatron_parallel
    from train_testing.megatron_cpu import megatron_on_cpu
    from vocab_parallel import token_log_probs

    with megatron_on_cpu():
        init_megatron_parallel(tp, seed=0)
        try:
            hf = tiny_model("llama").float()
            model = _megatron_model(hf, tp)
            exported = megatron_to_hf(megatron_state_dict_full(model, hf.config), hf.config)
            original = hf.state_dict()
            assert sorted(exported) == sorted(original), set(exported) ^ set(original)
            for name, tensor in original.items():
                assert torch.equal(exported[name], tensor), f"{name} changed in the round trip"
            target = Path(out_dir) / "export"
            if rank == 0:
                fresh = LlamaForCausalLM(hf.config)
                fresh.load_state_dict(exported)
                fresh.save_pretrained(target)
            dist.barrier()
            loaded = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
            ids = torch.randint(0, 120, (2, 12), generator=torch.Generator().manual_seed(1))
            labels = ids.roll(-1, dims=1)
            with torch.no_grad():
                hf_lp = token_log_probs(loaded(input_ids=ids).logits, labels)
                mg_lp = token_log_probs(
                    model(ids, torch.arange(12).expand(2, 12), None),
                    labels,
                    vocab_group=parallel_state.get_tensor_model_parallel_group(),
                )
            torch.testing.assert_close(mg_lp, hf_lp, atol=2e-5, rtol=1e-5)
            return "ok"
        finally:
            parallel_state.destroy_model_parallel()


def run_megatron_sft_on_rank(
    rank: int, world_size: int, overrides: list[str], probe: list[list[int]]
) -> dict[str, Any]:
    """The SFT recipe with ``model.backend=megatron`` (on the CPU shim); rank 0 returns the
    logged losses, and every rank the probe logits of an HF copy of the trained weights."""
    import json

    from megatron.core import parallel_state

    from train_recipes.config import SFTConfig, load_config, validate_sft
    from train_recipes.megatron.recipe import hf_copy
    from train_recipes.sft.run import run_sft
    from train_testing.megatron_cpu import megatron_on_cpu

    config = load_config(SFTConfig, None, [*overrides, "model.backend=megatron"])
    validate_sft(config, world_size=world_size)
    with megatron_on_cpu():
        try:
            result = run_sft(config)
            with torch.no_grad():
                logits = hf_copy(result.model, device=torch.device("cpu"))(
                    input_ids=torch.tensor(probe)
                ).logits
        finally:
            parallel_state.destroy_model_parallel()
    if rank != 0:
        return {}
    rows = [
        json.loads(x)
        for x in (Path(config.train.output_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    return {
        "losses": {r["step"]: r["loss"] for r in rows if "loss" in r},
        "logits": logits,
        "accuracy_before": result.accuracy_before,
        "accuracy_after": result.accuracy_after,
        "export_dir": str(result.export_dir),
    }
