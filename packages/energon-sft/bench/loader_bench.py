"""Loader benchmark: energon-sft (Energon) vs a plain torch DataLoader, and resume latency.

Full path per sample: read, decode the image, chat template, tokenize, mask, collate. Both
loaders run the same SFTTaskEncoder on the same rows: energon-sft reads prepared tar shards,
the baseline reads the JSONL rows and image files directly.

    python packages/energon-sft/bench/loader_bench.py            # default sizes
    python packages/energon-sft/bench/loader_bench.py --quick    # tiny, for CI

Prints one table per measurement and writes JSON (--out). CPU only; timings on a shared
machine are noisy.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from train_testing.bench import device_name, print_lines, versions, write_json

TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- else -%}{{ p['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
WORDS = [
    "the",
    "a",
    "red",
    "blue",
    "green",
    "square",
    "circle",
    "picture",
    "shows",
    "there",
    "is",
    "one",
    "two",
    "three",
    "cat",
    "dog",
    "on",
]


def build_processor(side: int) -> Any:
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers import Qwen2VLImageProcessor

    from train_testing.tiny_hf import tiny_tokenizer

    fast = tiny_tokenizer(
        [" ".join(WORDS)] * 20 + ["user assistant system"],
        vocab_size=600,
        chat_template=TEMPLATE,
    )

    class Proc:
        tokenizer = fast
        image_processor = Qwen2VLImageProcessor(
            min_pixels=28 * 28 * 4, max_pixels=side * side, patch_size=14, merge_size=2,
            temporal_patch_size=2,
        )  # fmt: skip

    return Proc()


def make_rows(root: Path, n: int, side: int) -> Path:
    from PIL import Image

    rng = random.Random(0)
    media = root / "media"
    media.mkdir(parents=True)
    lines = []
    for i in range(n):
        img = Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3)))
        buf = io.BytesIO()
        img.save(buf, format="JPEG")
        (media / f"{i}.jpg").write_bytes(buf.getvalue())
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40)))
        lines.append(json.dumps({
            "id": f"r{i}",
            "messages": [
                {"role": "user", "content": [{"type": "image", "media_index": 0}, {"type": "text", "text": "What is shown?"}]},
                {"role": "assistant", "content": text},
            ],
            "media": [f"{i}.jpg"],
        }))  # fmt: skip
    jsonl = media / "rows.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    return jsonl


class PlainDataset:
    """Baseline: JSONL rows + image files, same encoder, plain torch DataLoader."""

    def __init__(self, jsonl: Path, encoder: Any) -> None:
        self.rows = [json.loads(x) for x in jsonl.read_text().splitlines() if x]
        self.root = jsonl.parent
        self.encoder = encoder

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        from energon_sft import ChatSample, MediaItem

        row = self.rows[i]
        media = [MediaItem(name=m, data=(self.root / m).read_bytes()) for m in row["media"]]
        sample = ChatSample(
            __key__=row["id"], __restore_key__=(), messages=row["messages"], media=media,
            tools=None, source_id=row["id"],
        )  # fmt: skip
        return self.encoder.encode_chat(sample)


def bench_throughput(
    args: argparse.Namespace, ds: Path, jsonl: Path, proc: Any
) -> list[dict[str, Any]]:
    import torch

    from energon_sft import SFTTaskEncoder, build_sft_loader
    from energon_sft.benchmark import measure_throughput

    rows = []
    for workers in args.workers:
        for name in ("energon-sft", "torch DataLoader"):
            enc = SFTTaskEncoder(proc, model_family="qwen2_5_vl", max_length=8192)
            vals = []
            for rep in range(args.repeats):
                if name == "energon-sft":
                    loader: Any = build_sft_loader(
                        ds, encoder=enc, batch_size=args.batch_size, dp_rank=0, dp_world_size=1,
                        num_workers=workers, seed=rep, shuffle_buffer_size=args.buffer,
                    )  # fmt: skip
                else:
                    loader = torch.utils.data.DataLoader(
                        PlainDataset(jsonl, enc), batch_size=args.batch_size, shuffle=True,
                        num_workers=workers, collate_fn=enc.collate, drop_last=True,
                        persistent_workers=workers > 0,
                    )  # fmt: skip
                    loader = _repeat(loader)
                res = measure_throughput(
                    loader, n_batches=args.batches, warmup=2, count=lambda b: len(b.source_ids)
                )
                vals.append(res["samples_per_s"])
            rows.append({
                "loader": name, "workers": workers, "samples_per_s": statistics.median(vals),
                "min": min(vals), "max": max(vals),
            })  # fmt: skip
    return rows


def _repeat(loader: Any) -> Any:
    while True:
        yield from loader


def bench_resume(args: argparse.Namespace, ds: Path, proc: Any) -> list[dict[str, Any]]:
    from energon_sft import LoaderOptions, SFTTaskEncoder, build_sft_loader
    from energon_sft.benchmark import measure_time_to_first_batch

    rows = []
    for buffer in args.resume_buffers:
        enc = SFTTaskEncoder(proc, model_family="qwen2_5_vl", max_length=8192)

        def make(enc: Any = enc, buffer: int = buffer) -> Any:
            return build_sft_loader(
                ds, encoder=enc, batch_size=args.batch_size, dp_rank=0, dp_world_size=1,
                num_workers=args.resume_workers, seed=0, shuffle_buffer_size=buffer,
                options=LoaderOptions(checkpoint_every_sec=5.0),
            )  # fmt: skip

        loader = make()
        it = iter(loader)
        for _ in range(args.resume_after):
            next(it)
        state = loader.state_dict()

        def restore(state: Any = state, make: Any = make) -> Any:
            fresh = make()
            fresh.load_state_dict(state)
            return fresh

        times = [measure_time_to_first_batch(restore) for _ in range(args.repeats)]
        rows.append({
            "shuffle_buffer": buffer, "workers": args.resume_workers,
            "restore_to_first_batch_s": statistics.median(times),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (CI)")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--image-side", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--buffer", type=int, default=100)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--resume-buffers", type=int, nargs="+", default=[0, 100, 1000])
    p.add_argument("--resume-workers", type=int, default=2)
    p.add_argument("--resume-after", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("energon_sft_bench.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.samples, args.image_side, args.batch_size, args.batches = 24, 56, 2, 3
        args.buffer, args.workers, args.repeats = 8, [0], 1
        args.resume_buffers, args.resume_workers, args.resume_after = [0, 8], 0, 2

    from energon_sft import convert_jsonl

    proc = build_processor(args.image_side)
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = make_rows(Path(tmp), args.samples, args.image_side)
        t0 = time.perf_counter()
        ds = convert_jsonl(jsonl, Path(tmp) / "ds", samples_per_shard=max(8, args.samples // 16))
        convert_s = time.perf_counter() - t0
        thr = bench_throughput(args, ds, jsonl, proc)
        res = bench_resume(args, ds, proc)

    import megatron.energon

    base = {r["workers"]: r["samples_per_s"] for r in thr if r["loader"] == "torch DataLoader"}
    print(f"\nthroughput: {args.samples} rows, {args.image_side}px JPEG, batch {args.batch_size}, "
          f"{args.batches} timed batches, median of {args.repeats}")  # fmt: skip
    print(f"{'loader':<18}{'workers':>8}{'samples/s':>12}{'min':>10}{'max':>10}{'vs plain':>10}")
    for r in thr:
        ratio = r["samples_per_s"] / base[r["workers"]]
        print(f"{r['loader']:<18}{r['workers']:>8}{r['samples_per_s']:>12.1f}{r['min']:>10.1f}"
              f"{r['max']:>10.1f}{ratio:>10.2f}")  # fmt: skip
    print(f"\nresume: restore -> first batch (workers {args.resume_workers}, after "
          f"{args.resume_after} batches)")  # fmt: skip
    print(f"{'shuffle buffer':<16}{'seconds':>10}")
    for r in res:
        print(f"{r['shuffle_buffer']:<16}{r['restore_to_first_batch_s']:>10.3f}")
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device": "cpu",
        "cpu": device_name("cpu"),
        **versions(),
        "energon": megatron.energon.__version__,
        "convert_s": convert_s,
        "throughput": thr,
        "resume": res,
    }
    print_lines(f"\nwrote {write_json(args.out, report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
