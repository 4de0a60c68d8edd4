"""Packed SFT step on one GPU: the recipe's variable-length path against the alternatives.

Model: the 1.5B Llama of ``sft_step.py`` (hidden 2048, 16 layers, 32 heads / 8 KV heads, vocab
128256, untied head), random init, FSDP2 mixed precision (bf16 compute, fp32 master weights and
reduction), the Engine with fused AdamW and clipping at 1.0. Rows: 2 x 8192 tokens, each packed
with documents of 256-4096 tokens (fixed seed); labels are shifted inside each document, so every
variant trains the same tokens. Variants, in one process one after the other:

- ``packed``: the recipe's step: ``token_sum_loss`` with cp-sharder's sharder on a one-rank cp
  mesh and the THD batch energon-sft gives (``qkv_format="thd"``, ``seq_lens`` [B, N]), i.e.
  cp-sharder's variable-length attention, no mask.
- ``unpacked``: the same token ids as plain causal rows (positions 0..S-1) through the recipe's
  ``CausalFastPath`` (attention spans whole rows: more attention work than packed).
- ``dense-mask``: the old packed path: restarting position ids and no attention mask, so
  transformers' SDPA gets a per-document ``[B, 1, S, S]`` mask derived from the position ids.
- ``varlen-direct``: a model whose attention calls ``torch.nn.attention.varlen.varlen_attn`` on
  the flattened rows with the batch's ``cu_seqlens``, bypassing cp-sharder (the reference the
  packed path should be within 5% of). On the CPU (``--quick``) torch has no varlen kernel: the
  same attention runs per document through SDPA and the row says so.

``--long``: one 65,536-token packed row instead (documents of 256-4096 tokens), the variants
``packed`` and ``varlen-direct``, with torch's checkpoint wrapper on every decoder layer
(``--no-checkpoint`` to measure without). The backward then recomputes each layer's forward, so
the step runs forward and backward inside the sharder's attention context (``token_sum_loss``
leaves it after the forward, and the recomputation must see the same attention).

Step times as in ``sft_step.py``: CUDA events between steps, read after the last one (the host
never waits between steps, as in training). Reported per variant: ms/step (median), tokens/s, peak GiB (CUDA), ratio of tokens/s to
``unpacked`` (or to ``varlen-direct`` with ``--long``) and to ``varlen-direct``, the first
step's mean loss (packed, dense-mask and varlen-direct must agree), the attention kernel. JSON
with the device name and the torch / transformers versions.

    python packages/recipes/bench/packed_step.py --out packed_step.json
    python packages/recipes/bench/packed_step.py --long --out packed_long.json
    python packages/recipes/bench/packed_step.py --quick      # tiny model on the CPU (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import itertools
import json
import platform
import random
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

# The shared bench helpers live beside this script (run as a script: its folder is on the path).
sys.path.insert(0, str(Path(__file__).parent))
from sft_step import FULL, TINY, device_name, free_memory, init_process_group, sync, timed_steps

from train_engine import Engine, FSDP2Config, apply_data_parallel, param_groups
from train_recipes.model.attention import CausalFastPath
from train_recipes.sft.run import token_sum_loss
from train_testing.bench import add_device_argument

# Name of the bench's own attention (torch's varlen_attn, called directly).
VARLEN_DIRECT = "packed_step_varlen_direct"
VARIANTS = ("packed", "unpacked", "dense-mask", "varlen-direct")
LONG_VARIANTS = ("packed", "varlen-direct")


# ----------------------------------------------------------------------------- data
def document_lengths(total: int, low: int, high: int, rng: random.Random) -> list[int]:
    """Lengths in [low, high] that add up to ``total`` (the last one takes what is left)."""
    out: list[int] = []
    left = total
    while left:
        n = min(rng.randint(low, high), left)
        if 0 < left - n < low:  # the rest would be a too-short document: fold it in
            n = left if left <= high else left - low
        out.append(n)
        left -= n
    return out


def make_batches(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """Two packed batches (stepped in turn): ids, shifted labels, both position-id forms, the
    per-row document lengths and the flat cumulative lengths."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
        labels = torch.full_like(ids, -100)
        positions = torch.zeros_like(ids)
        rows = []
        for r in range(args.batch):
            lengths = document_lengths(args.seq, args.min_doc, args.max_doc, rng)
            rows.append(lengths)
            start = 0
            for n in lengths:
                positions[r, start : start + n] = torch.arange(n)
                labels[r, start : start + n - 1] = ids[r, start + 1 : start + n]
                start += n
        docs = max(len(x) for x in rows)
        seq_lens = torch.tensor([x + [-1] * (docs - len(x)) for x in rows], dtype=torch.int32)
        flat = torch.tensor([n for x in rows for n in x])
        cu = torch.zeros(flat.numel() + 1, dtype=torch.int32)
        cu[1:] = flat.cumsum(0)
        out.append(
            {
                "input_ids": ids,
                "labels": labels,
                "position_ids": positions,
                "causal_position_ids": torch.arange(args.seq).expand(args.batch, -1).contiguous(),
                "seq_lens": seq_lens,
                "cu_seqlens": cu,
                "max_seqlen": int(flat.max()),
                "documents": int(flat.numel()),
                "num_tokens": int((labels != -100).sum()),
            }
        )
    return out


# ----------------------------------------------------------------------------- varlen-direct
@functools.cache
def _varlen_attn() -> tuple[Callable[..., Any], frozenset[str]] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _direct_kernel(device: str) -> str:
    return "varlen_attn" if device == "cuda" and _varlen_attn() else "per-document sdpa (no varlen)"


def varlen_direct_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    cu_seq_lens_q: Tensor,
    max_length_q: int,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention over one flattened packed stream, per document, causal.

    Args:
        query: [1, H, T, D]; key, value: [1, Hkv, T, D] (transformers' layout).
        cu_seq_lens_q: [N + 1] int32 document offsets into T (passed through the model's kwargs).

    Returns:
        ([1, T, H, D], None), as transformers' attention functions return.
    """
    if attention_mask is not None:
        raise RuntimeError("the varlen-direct attention got a mask; it takes documents only")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    found = _varlen_attn()
    if query.is_cuda and found is not None:
        fn, params = found
        extra: dict[str, Any] = {"scale": scaling} if "scale" in params else {}
        # The causal flag moved: is_causal (torch 2.10) -> window_size=(-1, 0) (2.11 on).
        extra.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
        if "enable_gqa" in params and k.shape[1] != q.shape[1]:
            extra["enable_gqa"] = True
        cu = cu_seq_lens_q.to(q.device, torch.int32)
        out = fn(q, k, v, cu, cu, max_length_q, max_length_q, **extra)
        out = out[0] if isinstance(out, tuple) else out
    else:
        bounds = cu_seq_lens_q.tolist()
        parts = []
        for a, b in itertools.pairwise(bounds):
            part = torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1),
                k[a:b].transpose(0, 1),
                v[a:b].transpose(0, 1),
                is_causal=True,
                scale=scaling,
                enable_gqa=k.shape[1] != q.shape[1],
            )
            parts.append(part.transpose(0, 1))
        out = torch.cat(parts)
    return out[None], None


# ----------------------------------------------------------------------------- model + step
def build_model(args: argparse.Namespace, attn: str) -> Any:
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    if attn == VARLEN_DIRECT:
        AttentionInterface.register(VARLEN_DIRECT, varlen_direct_attention)
    config = LlamaConfig(
        **(TINY if args.quick else FULL),
        max_position_embeddings=max(args.seq, 8192),
        tie_word_embeddings=False,
        attn_implementation=attn,
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        return LlamaForCausalLM(config)


def apply_checkpointing(model: torch.nn.Module) -> int:
    """Wrap every decoder layer in torch's (non-reentrant) activation checkpoint wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    layer_type = type(model.model.layers[0])
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda m: isinstance(m, layer_type),
    )
    return len(model.model.layers)


def setup(name: str, args: argparse.Namespace) -> tuple[Callable[[dict[str, Any]], float], str]:
    """Model, Engine and the step function of one variant; returns (step, kernel)."""
    attn = VARLEN_DIRECT if name == "varlen-direct" else "sdpa"
    model = build_model(args, attn)
    kernel = {
        "packed": "cp-sharder varlen (cp=1)",
        "unpacked": "causal sdpa (CausalFastPath)",
        "dense-mask": "sdpa + [B,1,S,S] document mask",
        "varlen-direct": _direct_kernel(args.device),
    }[name]
    fast_path = CausalFastPath(model)  # used by the "unpacked" variant only
    if args.checkpoint:
        apply_checkpointing(model)
    bf16 = torch.bfloat16 if args.device == "cuda" else torch.float32
    mesh = init_device_mesh(args.device, (1,))
    fsdp = FSDP2Config(param_dtype=bf16, reduce_dtype=torch.float32, reshard_after_forward=False)
    model = apply_data_parallel(model, mesh=mesh, config=fsdp)
    opt = torch.optim.AdamW(
        param_groups(model, weight_decay=0.1), lr=1e-5, fused=args.device == "cuda"
    )
    engine = Engine(model, opt, max_grad_norm=1.0)
    sharder = None
    if name == "packed":
        from cp_sharder import ContextParallelSharder

        sharder = ContextParallelSharder(model, mesh, padding_token_id=0)
        if args.checkpoint:
            sharder = _BackwardInContext(sharder)

    def step(batch: dict[str, Any]) -> float:
        num_tokens = batch["num_tokens"]  # counted on the host: no device read per step
        inputs: dict[str, Any] = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        if name == "unpacked":
            inputs["position_ids"] = batch["causal_position_ids"]
            with fast_path.selected(packed=False):
                loss = token_sum_loss(engine, inputs)
        elif name == "dense-mask":
            inputs["position_ids"] = batch["position_ids"]
            loss = token_sum_loss(engine, inputs)
        elif name == "packed":
            inputs.update(
                position_ids=batch["position_ids"], qkv_format="thd", seq_lens=batch["seq_lens"]
            )
            with _maybe(sharder):
                loss = token_sum_loss(engine, inputs, sharder=sharder)
                engine.backward(loss, num_tokens=num_tokens)
            engine.step()
            return float(loss.detach()) / num_tokens if args.read_loss else 0.0
        else:  # varlen-direct: one flattened stream, the documents as cu_seqlens
            flat = {k: v.reshape(1, -1) for k, v in inputs.items()}
            cu = batch["cu_seqlens"]
            loss = _direct_loss(
                engine, flat, batch["position_ids"].reshape(1, -1), cu, batch["max_seqlen"]
            )
        engine.backward(loss, num_tokens=num_tokens)
        engine.step()
        return float(loss.detach()) / num_tokens if args.read_loss else 0.0

    return step, kernel


def _direct_loss(
    engine: Any, flat: dict[str, Tensor], positions: Tensor, cu: Tensor, max_len: int
) -> Tensor:
    """The recipe's token-sum loss, the documents handed to the attention as kwargs."""
    from vocab_parallel import token_log_probs

    logits = engine(
        input_ids=flat["input_ids"],
        position_ids=positions,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max_len,
        max_length_k=max_len,
        use_cache=False,
    ).logits
    return -token_log_probs(logits, flat["labels"]).sum()


class _BackwardInContext:
    """A sharder whose attention context stays open until :func:`_maybe` exits.

    ``token_sum_loss`` leaves the sharder's context after the forward; with activation
    checkpointing the backward recomputes each layer's forward and must see the same attention,
    so the bench keeps the context open across ``engine.backward`` (the step's own scope).
    """

    def __init__(self, sharder: Any) -> None:
        self._sharder = sharder
        self._stack: contextlib.ExitStack | None = None

    def shard(self, batch: dict[str, Any]) -> tuple[Callable[[], Any], dict[str, Any]]:
        ctx, local = self._sharder.shard(batch)
        assert self._stack is not None, "shard() outside _maybe()"
        self._stack.enter_context(ctx())
        return contextlib.nullcontext, local


@contextlib.contextmanager
def _maybe(sharder: Any) -> Iterator[None]:
    if not isinstance(sharder, _BackwardInContext):
        yield
        return
    with contextlib.ExitStack() as stack:
        sharder._stack = stack
        try:
            yield
        finally:
            sharder._stack = None


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    step, kernel = setup(name, args)
    data = [
        {
            k: v.to(args.device) if isinstance(v, Tensor) and k != "seq_lens" else v
            for k, v in b.items()
        }
        for b in make_batches(args, (TINY if args.quick else FULL)["vocab_size"])
    ]
    args.read_loss = True
    first_loss = step(data[0])
    args.read_loss = False
    for i in range(1, args.warmup):
        step(data[i % 2])
    sync(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = timed_steps(step, data, args)
    seconds = statistics.median(times)
    return {
        "variant": name,
        "kernel": kernel,
        "ms/step": seconds * 1e3,
        "tokens/s": args.batch * args.seq / seconds,
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
        "first loss": first_loss,
        "documents": data[0]["documents"],
    }


def versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--min-doc", type=int, default=256)
    parser.add_argument("--max-doc", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default=None, help="comma-separated; default: all")
    parser.add_argument("--long", action="store_true", help="one 65,536-token packed row")
    parser.add_argument(
        "--no-checkpoint",
        dest="checkpoint",
        action="store_false",
        default=None,
        help="no activation checkpointing (default: on with --long only)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, CPU is fine")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if args.long:
        args.batch, args.seq = 1, 65536
    if args.checkpoint is None:
        args.checkpoint = args.long
    if args.quick:
        args.seq = 128 if args.long else 64
        args.min_doc, args.max_doc = (8, 48) if args.long else (4, 24)
        args.steps, args.warmup = 2, 1
    elif args.device != "cuda":
        raise SystemExit("the full-size benchmark needs --device cuda; use --quick on the CPU")
    names = (
        args.variants.split(",")
        if args.variants
        else list(LONG_VARIANTS if args.long else VARIANTS)
    )
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    init_process_group(args.device)
    rows = []
    for name in names:
        rows.append(run_variant(name, args))
        free_memory(args.device)
        print(json.dumps(rows[-1]), flush=True)
    by_name = {r["variant"]: r for r in rows}
    for base in ("unpacked", "varlen-direct"):
        if base in by_name:
            for r in rows:
                r[f"vs {base}"] = r["tokens/s"] / by_name[base]["tokens/s"]
    columns = ["variant", "kernel", "ms/step", "tokens/s", "peak GiB", "first loss"]
    columns += [c for c in ("vs unpacked", "vs varlen-direct") if c in rows[0]]
    shape = f"{args.batch} x {args.seq}" + (
        " (activation checkpointing)" if args.checkpoint else ""
    )
    print(
        f"\npacked SFT step, {shape}, {rows[0]['documents']} documents ({device_name(args.device)})"
    )
    for r in rows:
        print("  ".join(f"{c}={_fmt(r.get(c))}" for c in columns))
    if args.out:
        meta = {
            **versions(),
            "python": platform.python_version(),
            "device_name": device_name(args.device),
            **{k: v for k, v in vars(args).items() if k not in ("out", "read_loss")},
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    dist.destroy_process_group()


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
