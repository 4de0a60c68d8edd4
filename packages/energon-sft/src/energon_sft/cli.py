"""`energon-sft` command line: convert, inspect, bench.

energon-sft convert rows.jsonl OUT_DIR [--media-root DIR] [--samples-per-shard N]
energon-sft inspect DATASET --tokenizer DIR [--image-processor DIR] --model-family F [-n 3]
energon-sft bench DATASET --tokenizer DIR --model-family F [--batch-size 8] [--num-workers 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

_GREEN, _RESET = "\x1b[32m", "\x1b[0m"


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")


class _Processor:
    """Tokenizer + image processor loaded from separate folders."""

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor


def _load_processor(args: argparse.Namespace) -> Any:
    try:
        from transformers import AutoImageProcessor, AutoTokenizer
    except ImportError as exc:
        raise SystemExit(
            "energon-sft inspect/bench load tokenizers with transformers: "
            "pip install 'energon-sft[hf]'"
        ) from exc
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    if args.image_processor:
        return _Processor(tok, AutoImageProcessor.from_pretrained(args.image_processor))
    return tok


def _encoder(args: argparse.Namespace) -> Any:
    from energon_sft.encoder import SFTTaskEncoder

    return SFTTaskEncoder(
        _load_processor(args),
        model_family=args.model_family,
        max_length=args.max_length,
        train_on=args.train_on,
    )


def _subflavors(pairs: Sequence[str]) -> dict[str, str] | None:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--subflavor {pair!r} must look like key=value")
        out[key] = value
    return out or None


def render_trained(tokenizer: Any, input_ids: list[int], labels: list[int], *, color: bool) -> str:
    """Decode a row, marking target tokens (green, or [[...]] without color).

    Token t is a target when `labels[t - 1] != -100` (labels are shifted). Runs of more than
    three identical special tokens (image placeholders) collapse to `<tok>xN`.
    """
    targets = [False] + [lab != -100 for lab in labels[:-1]]
    special = set(getattr(tokenizer, "all_special_ids", []))
    segments: list[tuple[str, bool]] = []
    i = 0
    while i < len(input_ids):
        j = i + 1
        while j < len(input_ids) and input_ids[j] == input_ids[i] and targets[j] == targets[i]:
            j += 1
        if j - i > 3 and input_ids[i] in special:
            text = f"{tokenizer.convert_ids_to_tokens(input_ids[i])}x{j - i}"
        else:
            text = tokenizer.decode(input_ids[i:j])
        if segments and segments[-1][1] == targets[i]:
            segments[-1] = (segments[-1][0] + text, targets[i])
        else:
            segments.append((text, targets[i]))
        i = j
    return "".join(_wrap(text, trained, color) for text, trained in segments)


def _wrap(text: str, trained: bool, color: bool) -> str:
    if not trained:
        return text
    return f"{_GREEN}{text}{_RESET}" if color else f"[[{text}]]"


def cmd_convert(args: argparse.Namespace) -> int:
    from energon_sft.dataset import convert_jsonl

    path = convert_jsonl(
        args.jsonl,
        args.out_dir,
        media_root=args.media_root,
        samples_per_shard=args.samples_per_shard,
    )
    _out(f"prepared Energon dataset at {path}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from energon_sft.loader import build_sft_loader

    enc = _encoder(args)
    loader = build_sft_loader(
        args.dataset,
        encoder=enc,
        batch_size=1,
        dp_rank=0,
        dp_world_size=1,
        num_workers=0,
        seed=0,
        shuffle=False,
        subflavors=_subflavors(args.subflavor),
    )
    for n, batch in enumerate(loader):
        if n == args.num_samples:
            break
        length = int(batch.attention_mask[0].sum())
        ids = batch.input_ids[0, :length].tolist()
        labels = batch.labels[0, :length].tolist()
        _out(
            f"=== {batch.source_ids[0]} (key {batch.__key__[0]}): {length} tokens, "
            f"{int(batch.num_trainable_tokens)} trained, {batch.image_grid_thw.shape[0]} image(s), "
            f"weight {float(batch.sample_weights[0])}"
        )
        _out(render_trained(enc.tokenizer, ids, labels, color=args.color))
    stats = loader.data_stats()
    if stats:
        _out(f"data stats: {json.dumps(stats, sort_keys=True)}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from energon_sft.benchmark import measure_throughput
    from energon_sft.loader import build_sft_loader

    loader = build_sft_loader(
        args.dataset,
        encoder=_encoder(args),
        batch_size=args.batch_size,
        dp_rank=0,
        dp_world_size=1,
        num_workers=args.num_workers,
        seed=0,
        shuffle_buffer_size=args.shuffle_buffer_size,
    )
    res = measure_throughput(
        loader, n_batches=args.batches, warmup=2, count=lambda b: len(b.source_ids)
    )
    _out(json.dumps({k: round(v, 3) for k, v in res.items()}))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", help="prepared Energon dataset folder (or .jsonl)")
    p.add_argument("--tokenizer", required=True, help="folder of a fast tokenizer with a template")
    p.add_argument("--image-processor", default=None, help="folder of an image processor")
    p.add_argument("--model-family", default="text")
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument(
        "--train-on", default="all_assistant", choices=["all_assistant", "final_assistant"]
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="energon-sft", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert", help="chat JSONL + media files -> prepared Energon dataset")
    p.add_argument("jsonl", nargs="+")
    p.add_argument("out_dir")
    p.add_argument("--media-root", default=None)
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.set_defaults(fn=cmd_convert)
    p = sub.add_parser("inspect", help="print encoded samples with trained tokens highlighted")
    _common(p)
    p.add_argument("-n", "--num-samples", type=int, default=3)
    p.add_argument("--subflavor", action="append", default=[], help="key=value (repeatable)")
    p.add_argument("--color", action=argparse.BooleanOptionalAction, default=sys.stdout.isatty())
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("bench", help="loader throughput (samples/s)")
    _common(p)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--shuffle-buffer-size", type=int, default=100)
    p.add_argument("--batches", type=int, default=50)
    p.set_defaults(fn=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return int(args.fn(args))


if __name__ == "__main__":
    raise SystemExit(main())
