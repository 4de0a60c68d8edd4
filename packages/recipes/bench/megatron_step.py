"""One SFT step of the 1.5B Llama config: the megatron backend's GPTModel beside the HF model.

Both variants run the same harness, in the same process one after the other: the same weights
(the HF model's seeded random init, converted for Megatron), fp32 master weights with bf16
autocast compute on CUDA, PyTorch DDP over one rank, the Engine with fused AdamW and clipping
at 1.0, and the vocab-parallel token-sum loss on batch 4 x 4096 unpacked rows:

- ``hf``: transformers' ``LlamaForCausalLM`` with the recipe's causal SDPA fast path, eager.
- ``megatron``: megatron-core's ``GPTModel`` (local layer spec, no Transformer Engine; the
  recipe's ``SegmentCausalAttention``, SDPA), eager, tp=1.

For the tuned HF step (FSDP2 mixed precision, compiled layers) run
``sft_step.py --variants recipes`` on the same machine. MFU as in ``sft_step.py``:
the recipe's model-FLOP count (``train_recipes.loop.throughput``) against ``--peak-tflops``.

    python packages/recipes/bench/megatron_step.py --device cuda --out megatron_step.json
    python packages/recipes/bench/megatron_step.py --quick     # tiny model on the CPU (CI)

Needs megatron-core (``pip install 'train-recipes[megatron]'``). On the CPU (``--quick``) the
test-only shim ``train_testing.megatron_cpu`` stands in for megatron-core's CUDA-only calls.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from sft_step import (
    FULL,
    TINY,
    make_batches,
    print_summary,
    result_row,
    timed_steps,
    warm_up,
)
from torch.nn.parallel import DistributedDataParallel

from train_engine import Engine, param_groups
from train_recipes.model.attention import CausalFastPath
from train_recipes.sft.run import token_sum_loss
from train_testing.bench import (
    add_sft_step_arguments,
    device_name,
    free_memory,
    init_process_group,
    llama_config,
    resolve_sft_step_sizes,
    versions,
    write_json,
)

VARIANTS = ("hf", "megatron")


def build_hf(args: argparse.Namespace) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(TINY if args.quick else FULL, max_len=args.seq))


def setup(name: str, args: argparse.Namespace) -> tuple[Callable[[dict], None], int, Any]:
    """The step function of one variant, its parameter count and the HF config."""
    hf = build_hf(args)
    config = hf.config
    n_params = sum(p.numel() for p in hf.parameters())
    attention: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    if name == "hf":
        model: torch.nn.Module = hf.to(args.device)
        # The benchmark's rows are not packed: causal SDPA without transformers' mask.
        attention = partial(CausalFastPath(model).selected, packed=False)
    else:
        from train_recipes.megatron.convert import load_hf_weights
        from train_recipes.megatron.model import build_gpt_model, init_megatron_parallel

        init_megatron_parallel(1, seed=0)
        model = build_gpt_model(config, tp=1, dtype=torch.float32)
        load_hf_weights(model, hf.state_dict(), config)
        del hf
        model = model.to(args.device)
    cuda = args.device == "cuda"
    wrapped = DistributedDataParallel(
        model, device_ids=[torch.cuda.current_device()] if cuda else None, init_sync=False
    )
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-5, fused=cuda)
    engine = Engine(wrapped, opt, max_grad_norm=1.0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def step(batch: dict[str, torch.Tensor]) -> None:
        inputs = {
            "input_ids": batch["input_ids"],
            "labels": batch["shifted_labels"],
            "position_ids": batch["position_ids"],
        }
        with autocast, attention():
            loss = token_sum_loss(engine, inputs)
        engine.backward(loss, num_tokens=args.batch * (args.seq - 1))
        engine.step()

    return step, n_params, config


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    step, n_params, config = setup(name, args)
    data = make_batches(args, config.vocab_size)
    warmup_s = warm_up(step, data, args)
    times = timed_steps(step, data, args)
    return result_row(name, times, warmup_s, n_params, config, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sft_step_arguments(parser)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--quick", action="store_true", help="tiny model, CPU is fine")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    resolve_sft_step_sizes(args)
    chosen = args.variants.split(",")
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    init_process_group(args.device)
    shim: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if args.device != "cuda":
        from train_testing.megatron_cpu import megatron_on_cpu

        shim = megatron_on_cpu()
    rows = []
    with shim:
        for name in chosen:
            rows.append(run_variant(name, args))
            free_memory(args.device)
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print_summary(
        f"\nSFT step, hf vs megatron-core, batch {args.batch} x {args.seq} "
        f"({device_name(args.device)})",
        rows,
        base,
    )
    if args.out:
        import megatron.core

        meta = {
            **versions(),
            "megatron-core": megatron.core.__version__,
            "device_name": device_name(args.device),
            **{k: v for k, v in vars(args).items() if k != "out"},
        }
        write_json(args.out, {"meta": meta, "rows": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
