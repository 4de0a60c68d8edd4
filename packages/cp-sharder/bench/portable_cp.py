"""Forward+backward time of the portable CP backend against the same model without CP (CPU).

Variants, all on one random-init LlamaForCausalLM and the same global batch:

Models: ``--model llama`` (default, transformers, portable backend through the attention
registry) or ``--model plain`` (plain PyTorch calling SDPA, portable backend through the SDPA
override).

- ``no_cp``: the plain model, one process (the baseline).
- ``cp1``: ContextParallelSharder with cp=1 (shard + train_ctx + verbs); goal: within 2%.
- ``cp2_portable``: two gloo processes, portable all-gather-K/V attention; the time is the
  slowest rank's median step.

Usage::

    python packages/cp-sharder/bench/portable_cp.py            # default sizes
    python packages/cp-sharder/bench/portable_cp.py --quick    # tiny sizes (CI)

Prints a table and writes JSON (``--out``). Timings on a shared or busy machine are noise;
multi-GPU scaling is measured elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from train_testing.bench import device_name, times_ms, versions, write_json


class _Out:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class PlainLM(torch.nn.Module):
    """A pre-norm causal transformer that calls SDPA directly (no transformers import)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        h = args.hidden
        self.heads = args.heads
        self.emb = torch.nn.Embedding(args.vocab, h)
        self.pos = torch.nn.Embedding(args.seq * 2, h)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "norm1": torch.nn.LayerNorm(h),
                    "qkv": torch.nn.Linear(h, 3 * h),
                    "proj": torch.nn.Linear(h, h),
                    "norm2": torch.nn.LayerNorm(h),
                    "mlp": torch.nn.Sequential(
                        torch.nn.Linear(h, 2 * h), torch.nn.GELU(), torch.nn.Linear(2 * h, h)
                    ),
                }
            )
            for _ in range(args.layers)
        )
        self.head = torch.nn.Linear(h, args.vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> _Out:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None]
        x = self.emb(input_ids) + self.pos(position_ids)
        b, s, h = x.shape
        for blk in self.blocks:
            q, k, v = (
                blk["qkv"](blk["norm1"](x))
                .view(b, s, 3, self.heads, h // self.heads)
                .permute(2, 0, 3, 1, 4)
            )
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](a.transpose(1, 2).reshape(b, s, h))
            x = x + blk["mlp"](blk["norm2"](x))
        return _Out(self.head(x))


def _model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    if args.model == "plain":
        return PlainLM(args)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq * 2,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).float()


def _batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (args.batch, args.seq), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels}


def _loss(logits: torch.Tensor, labels: torch.Tensor, count: int) -> torch.Tensor:
    return (
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
        )
        / count
    )


def _bench_no_cp(args: argparse.Namespace) -> list[float]:
    model, batch = _model(args), _batch(args)
    count = int((batch["labels"] != -100).sum())

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=batch["input_ids"]).logits
        _loss(logits, batch["labels"], count).backward()

    return times_ms(step, "cpu", warmup=args.warmup, iters=args.iters)


def _sharded_step(model: torch.nn.Module, sharder: Any, batch: dict[str, torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    ctx, local = sharder.shard(batch)
    labels = local.pop("labels")
    with ctx():
        logits = model(**local).logits
    _loss(logits, labels, int(sharder.num_label_tokens())).backward()


def _bench_cp1(args: argparse.Namespace) -> list[float]:
    from cp_sharder import ContextParallelSharder

    model, batch = _model(args), _batch(args)
    sharder = ContextParallelSharder(model, None, batch)
    return times_ms(
        lambda: _sharded_step(model, sharder, batch), "cpu", warmup=args.warmup, iters=args.iters
    )


def _cp_rank(rank: int, world: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(args.threads_per_rank)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from cp_sharder import ContextParallelSharder

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        model, batch = _model(args), _batch(args)
        sharder = ContextParallelSharder(model, mesh, batch)

        def step() -> None:
            _sharded_step(model, sharder, batch)
            dist.barrier()

        times = times_ms(step, "cpu", warmup=args.warmup, iters=args.iters)
        Path(out, f"rank{rank}.json").write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def _bench_cp(args: argparse.Namespace, world: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        mp.spawn(_cp_rank, args=(world, str(Path(tmp, "init")), args, tmp), nprocs=world)
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    # A step ends when the slowest rank ends (the barrier makes them equal up to noise).
    return [max(step) for step in zip(*per_rank, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes for CI")
    parser.add_argument(
        "--model",
        choices=["llama", "plain"],
        default="llama",
        help="transformers LlamaForCausalLM, or a plain PyTorch LM calling SDPA",
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("cp_sharder_bench.json"))
    args = parser.parse_args()
    if args.quick:
        args.seq, args.hidden, args.vocab, args.iters, args.warmup = 62, 32, 128, 3, 1
    # The baseline gets the same thread budget as one CP rank, so the ratio compares work.
    torch.set_num_threads(args.threads_per_rank)

    rows = []
    variants = [("no_cp", _bench_no_cp), ("cp1", _bench_cp1), ("cp2_portable", None)]
    base = None
    for name, fn in variants:
        times = _bench_cp(args, 2) if fn is None else fn(args)
        median = statistics.median(times)
        base = base if base is not None else median
        rows.append({"variant": name, "median_ms": median, "ratio_to_no_cp": median / base})

    print(f"{'variant':<14} {'median ms':>10} {'ratio':>7}")
    for row in rows:
        print(f"{row['variant']:<14} {row['median_ms']:>10.2f} {row['ratio_to_no_cp']:>7.3f}")
    report = {
        "device": device_name("cpu"),
        **versions(),
        "model": args.model,
        "sizes": {
            k: getattr(args, k) for k in ("batch", "seq", "hidden", "heads", "layers", "vocab")
        },
        "iters": args.iters,
        "rows": rows,
    }
    write_json(args.out, report)


if __name__ == "__main__":
    main()
