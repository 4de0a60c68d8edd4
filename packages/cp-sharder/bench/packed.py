"""Forward+backward step of packed rows: varlen through the sharder vs dense mask vs unpacked.

One random-init LlamaForCausalLM, one device, the same documents in every variant:

- ``unpacked``: one document per row, right-padded to the longest (causal, no mask); the
  baseline.
- ``dense_mask``: the documents packed into rows marked by restarting ``position_ids``, run by
  the model itself (transformers builds a dense per-document mask): the old packed path.
- ``varlen``: the same rows as a THD batch through ``ContextParallelSharder`` at cp=1
  (per-document varlen attention: torch's ``varlen_attn`` on CUDA in bf16/fp16).

Usage::

    python packages/cp-sharder/bench/packed.py --device cuda --dtype bfloat16 \\
        --hidden 2048 --layers 8 --rows 2 --row-len 8192 --min-doc 256 --max-doc 4096
    python packages/cp-sharder/bench/packed.py --quick        # tiny sizes on CPU (CI)

Prints one table (median ms, tokens/s of real tokens, peak extra GiB on CUDA, ratio of
tokens/s to ``unpacked``) and writes the same as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from train_testing.bench import add_device_argument


def _documents(args: argparse.Namespace) -> list[list[int]]:
    """Per row, document lengths that fill the row (the last one is cut to fit)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(args.rows):
        left, row = args.row_len, []
        while left >= args.min_doc:
            n = int(torch.randint(args.min_doc, args.max_doc + 1, (1,), generator=g))
            row.append(min(n, left))
            left -= row[-1]
        rows.append(row)
    return rows


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 4),
        max_position_embeddings=max(args.row_len, args.max_doc) * 2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=args.device, dtype=getattr(torch, args.dtype))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, reduction="sum")


def _batches(args: argparse.Namespace, docs: list[list[int]]) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    dev = args.device
    rows = len(docs)
    ids = torch.zeros(rows, args.row_len, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    pos = torch.zeros_like(ids)
    flat_docs = []
    for r, row in enumerate(docs):
        start = 0
        for n in row:
            tok = torch.randint(1, args.vocab, (n,), generator=g)
            ids[r, start : start + n], pos[r, start : start + n] = tok, torch.arange(n)
            labels[r, start : start + n - 1] = tok[1:]
            flat_docs.append(tok)
            start += n
    longest = max(d.numel() for d in flat_docs)
    un_ids = torch.zeros(len(flat_docs), longest, dtype=torch.long)
    un_labels = torch.full_like(un_ids, -100)
    for i, d in enumerate(flat_docs):
        un_ids[i, : d.numel()] = d
        un_labels[i, : d.numel() - 1] = d[1:]
    width = max(len(r) for r in docs)
    seq_lens = torch.full((rows, width), -1)
    for r, row in enumerate(docs):
        seq_lens[r, : len(row)] = torch.tensor(row)
    return {
        "unpacked": {"input_ids": un_ids.to(dev), "labels": un_labels.to(dev)},
        "dense_mask": {
            "input_ids": ids.to(dev),
            "position_ids": pos.to(dev),
            "labels": labels.to(dev),
        },
        "varlen": {
            "input_ids": ids.to(dev),
            "labels": labels.to(dev),
            "seq_lens": seq_lens,
            "qkv_format": "thd",
        },
        "tokens": sum(d.numel() for d in flat_docs),
    }


def _step(model: torch.nn.Module, variant: str, batch: dict[str, Any]) -> float:
    from cp_sharder import ContextParallelSharder

    model.zero_grad(set_to_none=True)
    if variant == "varlen":
        result = ContextParallelSharder(model).shard(batch)
        local = dict(result.batch)
        labels = local.pop("labels")
        with result.train_ctx():
            loss = _loss(model(**local, use_cache=False).logits, labels)
    else:
        local = dict(batch)
        labels = local.pop("labels")
        loss = _loss(model(**local, use_cache=False).logits, labels)
    loss.backward()
    return float(loss.detach())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes on CPU (CI)")
    add_device_argument(parser)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--row-len", type=int, default=8192)
    parser.add_argument("--min-doc", type=int, default=256)
    parser.add_argument("--max-doc", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("packed_bench.json"))
    args = parser.parse_args()
    if args.quick:
        args.device, args.hidden, args.layers, args.heads, args.vocab = "cpu", 32, 2, 4, 128
        args.row_len, args.min_doc, args.max_doc, args.steps, args.warmup = 64, 4, 24, 2, 1
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    model = _model(args)
    docs = _documents(args)
    batches = _batches(args, docs)
    rows: list[dict[str, Any]] = []
    for variant in ("unpacked", "dense_mask", "varlen"):
        times, losses = [], []
        model.zero_grad(set_to_none=True)  # the previous variant's gradients are not this one's
        base = 0
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        for i in range(args.warmup + args.steps):
            _sync(args.device)
            start = time.perf_counter()
            losses.append(_step(model, variant, batches[variant]))
            _sync(args.device)
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
        median = statistics.median(times)
        peak = (
            (torch.cuda.max_memory_allocated() - base) / 2**30
            if args.device.startswith("cuda")
            else None
        )
        rows.append(
            {
                "variant": variant,
                "median_ms": median,
                "tokens_per_s": batches["tokens"] / (median / 1e3),
                "peak_extra_gib": peak,
                "loss": losses[-1],
            }
        )
    baseline = rows[0]["tokens_per_s"]
    for r in rows:
        r["ratio_to_unpacked"] = r["tokens_per_s"] / baseline
    print(f"{'variant':<12} {'median ms':>10} {'tokens/s':>12} {'peak GiB':>9} {'ratio':>6}")
    for r in rows:
        peak = "-" if r["peak_extra_gib"] is None else f"{r['peak_extra_gib']:.2f}"
        print(
            f"{r['variant']:<12} {r['median_ms']:>10.1f} {r['tokens_per_s']:>12.0f} "
            f"{peak:>9} {r['ratio_to_unpacked']:>6.2f}"
        )
    report = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "documents": docs,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
