"""`energon-sft` command line: convert, inspect, bench.

energon-sft convert INPUT [INPUT ...] OUT_DIR [--format messages|sharegpt|alpaca]
    [--media-root DIR] [--samples-per-shard N] [--max-bad-fraction F] [--check-images]
    [--overwrite]
energon-sft inspect DATASET|rows.jsonl --tokenizer DIR [--image-processor DIR] --model-family F
    [-n 3] [--format F] [--media-root DIR]
energon-sft bench DATASET --tokenizer DIR --model-family F [--batch-size 8] [--num-workers 2]

An INPUT is a chat JSONL, a Parquet file or a `datasets.save_to_disk` folder.
User mistakes (a missing file, a bad option value) print one line and exit 2; a conversion
refused for its rows exits 1 after the counts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from energon_sft.sources import RowSource

__all__ = ["main"]


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")


def _err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class UsageError(Exception):
    """A user mistake: printed as one line (no traceback), exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`prog: error: ...`, exit 2) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        _err(f"{self.prog}: error: {message} (see --help)")
        raise SystemExit(2)


class _Processor:
    """Tokenizer + image processor loaded from separate folders."""

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor


def _load_processor(args: argparse.Namespace) -> Any:
    try:
        from transformers import AutoImageProcessor, AutoTokenizer
    except ImportError:
        raise UsageError(
            "inspect and bench load tokenizers with transformers: pip install 'energon-sft[hf]'"
        ) from None
    try:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as exc:
        where = "a folder without a tokenizer" if Path(args.tokenizer).is_dir() else "no folder"
        msg = f"--tokenizer {args.tokenizer} ({where}): cannot load a tokenizer: {_first(exc)}"
        raise UsageError(msg) from None
    if args.image_processor:
        try:
            ip = AutoImageProcessor.from_pretrained(args.image_processor)
        except (OSError, ValueError) as exc:
            msg = f"--image-processor {args.image_processor}: cannot load it: {_first(exc)}"
            raise UsageError(msg) from None
        return _Processor(tok, ip)
    return tok


def _first(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _encoder(args: argparse.Namespace) -> Any:
    from energon_sft.encoder import SFTTaskEncoder

    processor = _load_processor(args)
    try:
        return SFTTaskEncoder(
            processor,
            model_family=args.model_family,
            max_length=args.max_length,
            train_on=args.train_on,
        )
    except ValueError as exc:
        raise UsageError(_first(exc)) from None


def _subflavors(pairs: Sequence[str]) -> dict[str, str] | None:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise UsageError(f"--subflavor {pair!r} must look like key=value")
        out[key] = value
    return out or None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1]") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is outside [0, 1] (a share of the rows)")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _input_sources(paths: Sequence[str]) -> list[RowSource]:
    from energon_sft.sources import open_source

    try:
        return [open_source(p) for p in paths]
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def cmd_convert(args: argparse.Namespace) -> int:
    from energon_sft.convert import BadRowsError, convert_files
    from energon_sft.progress import ConvertProgress
    from energon_sft.sources import count_rows

    sources = _input_sources(args.jsonl)
    progress = None
    try:
        if args.progress is not False:
            bar = sys.stderr.isatty() if args.progress is None else True
            progress = ConvertProgress(count_rows(sources), bar=bar)
        report = convert_files(
            [s.path for s in sources],
            args.out_dir,
            row_format=args.format,
            media_root=args.media_root,
            samples_per_shard=args.samples_per_shard,
            max_bad_fraction=args.max_bad_fraction,
            check_images=args.check_images,
            overwrite=args.overwrite,
            progress=progress,
            on_prepare=progress.indexing if progress is not None else None,
        )
    except (FileExistsError, FileNotFoundError, ImportError) as exc:
        raise UsageError(str(exc)) from None
    except BadRowsError as exc:
        if progress is not None:
            progress.close()
        for line in exc.report.summary_lines():
            _out(line)
        _err(f"energon-sft convert: error: {exc}")
        return 1
    finally:
        if progress is not None:
            progress.close()
    for line in report.summary_lines():
        _out(line)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from energon_sft.inspection import show_jsonl, show_loader
    from energon_sft.loader import build_sft_loader

    path = Path(args.dataset)
    if not path.exists():
        raise UsageError(f"dataset {path} does not exist")
    if path.suffix == ".jsonl":
        root = Path(args.media_root) if args.media_root else path.parent
        if not root.is_dir():
            raise UsageError(f"--media-root {root} is not a folder")
        show_jsonl(
            path,
            _encoder(args),
            row_format=args.format or "messages",
            media_root=root,
            num_samples=args.num_samples,
            color=args.color,
            out=_out,
        )
        return 0
    if args.format is not None:
        raise UsageError(
            "--format applies to a JSONL file; a prepared dataset of ShareGPT rows is read "
            "with --subflavor sft_format=sharegpt"
        )
    _check_prepared(path)
    enc = _encoder(args)
    loader = build_sft_loader(
        path,
        encoder=enc,
        batch_size=1,
        dp_rank=0,
        dp_world_size=1,
        num_workers=0,
        seed=0,
        shuffle=False,
        subflavors=_subflavors(args.subflavor),
    )
    show_loader(loader, enc.tokenizer, num_samples=args.num_samples, color=args.color, out=_out)
    return 0


def _check_prepared(path: Path) -> None:
    """A loader input: a folder with `.nv-meta`, an indexed JSONL, or a metadataset YAML."""
    if path.is_dir() and not (path / ".nv-meta").is_dir():
        raise UsageError(
            f"{path} is not a prepared Energon dataset (no .nv-meta); "
            "create one with energon-sft convert"
        )
    if path.suffix == ".jsonl" and not path.with_suffix(".jsonl.idx").is_file():
        raise UsageError(
            f"{path} has no index ({path.name}.idx); convert it with energon-sft convert "
            "(bench reads prepared datasets; inspect reads JSONL directly)"
        )
    from energon_sft.shard_files import check_shard_files

    check_shard_files(path)  # before the tokenizer loads: a damaged shard index, named


def cmd_bench(args: argparse.Namespace) -> int:
    from energon_sft.benchmark import measure_throughput
    from energon_sft.loader import build_sft_loader

    path = Path(args.dataset)
    if not path.exists():
        raise UsageError(f"dataset {path} does not exist")
    _check_prepared(path)
    loader = build_sft_loader(
        path,
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


def _common(p: argparse.ArgumentParser, dataset_help: str) -> None:
    p.add_argument("dataset", help=dataset_help)
    p.add_argument("--tokenizer", required=True, help="folder of a fast tokenizer with a template")
    p.add_argument("--image-processor", default=None, help="folder of an image processor")
    p.add_argument("--model-family", default="text")
    p.add_argument("--max-length", type=_positive, default=4096)
    p.add_argument(
        "--train-on", default="all_assistant", choices=["all_assistant", "final_assistant"]
    )


def build_parser() -> argparse.ArgumentParser:
    from energon_sft.formats import FORMATS

    parser = _Parser(prog="energon-sft", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "convert",
        help="chat JSONL / Parquet / save_to_disk folder + media files -> prepared Energon "
        "dataset (every row validated)",
        description="Validate chat JSONL rows against the schema the loader trains on, map "
        "them to `messages` rows, write tar shards and run energon prepare. Prints rows read, "
        "written and rejected (with the line and reason of the first few).",
    )
    p.add_argument(
        "jsonl",
        nargs="+",
        metavar="INPUT",
        help="chat JSONL file(s), Parquet file(s) (extra energon-sft[parquet]) or "
        "datasets.save_to_disk folder(s)",
    )
    p.add_argument("out_dir", help="dataset folder to create (new or empty)")
    p.add_argument(
        "--format",
        default="messages",
        choices=FORMATS,
        help="input rows: messages {messages, media?, tools?} (default), sharegpt "
        "{conversations: [{from, value}], images?} or alpaca {instruction, input?, output, "
        "system?}",
    )
    p.add_argument(
        "--media-root", default=None, help="base of relative media paths (default: JSONL's folder)"
    )
    p.add_argument("--samples-per-shard", type=_positive, default=1000)
    p.add_argument(
        "--max-bad-fraction",
        type=_fraction,
        default=0.0,
        help="largest share of rejected rows that still converts, dropping them (default 0)",
    )
    p.add_argument(
        "--check-images",
        action="store_true",
        help="decode every image (slower; finds corrupt files)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an earlier convert's output in OUT_DIR"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: on a terminal; elsewhere a line every 10 s)",
    )
    p.set_defaults(fn=cmd_convert)
    p = sub.add_parser(
        "inspect",
        help="print encoded samples with trained tokens highlighted",
        description="A prepared dataset is read through the loader; a chat JSONL file (the "
        "convert input) is read directly: every row is validated, the first -n are encoded "
        "and shown, then the row count and the validation summary.",
    )
    _common(p, "prepared Energon dataset folder, or a chat JSONL file")
    p.add_argument("-n", "--num-samples", type=int, default=3)
    p.add_argument("--subflavor", action="append", default=[], help="key=value (repeatable)")
    p.add_argument(
        "--format", default=None, choices=FORMATS, help="JSONL input only (default messages)"
    )
    p.add_argument(
        "--media-root", default=None, help="JSONL input only: base of relative media paths"
    )
    p.add_argument("--color", action=argparse.BooleanOptionalAction, default=sys.stdout.isatty())
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("bench", help="loader throughput (samples/s)")
    _common(p, "prepared Energon dataset folder")
    p.add_argument("--batch-size", type=_positive, default=8)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--shuffle-buffer-size", type=int, default=100)
    p.add_argument("--batches", type=_positive, default=50)
    p.set_defaults(fn=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``energon-sft`` command line; the exit status (user errors print one line)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    from energon_sft.shard_files import ShardFileError

    try:
        return int(args.fn(args))
    except UsageError as exc:
        _err(f"energon-sft {args.command}: error: {exc}")
        return 2
    except ShardFileError as exc:  # a damaged dataset: the file and the fix, one line
        _err(f"energon-sft {args.command}: error: {exc}")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
