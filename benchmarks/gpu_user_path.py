"""The user-path suite: `train-recipes sft` as users run it, over a matrix of knobs, on one GPU.

Builds models from configs (random init, ``save_pretrained``: a 1.5B and an 8B Llama-style with
the demo's character tokenizer and Llama 3's 128256-row vocabulary, a tiny Qwen3-MoE), writes
chat rows and converts them with the documented command (``energon-sft convert``), then runs
the CLI for a few steps per cell. Each cell checks: exit 0, finite losses, the last below the
first, and (where the cell asks) that SIGKILL at step k then ``--resume`` gives the
uninterrupted losses and that the export loads with ``from_pretrained``. It records tokens/s
per GPU, MFU and peak memory from the run's own ``summary.json`` / ``metrics.jsonl``, and
writes one Markdown table and a JSON file.

    python3 benchmarks/gpu_user_path.py --work /tmp/up --out $OUT [--cells a,b] [--quick]

``--quick`` runs tiny models on the CPU (the driver's own check; the CPU matrix that compares
knobs with their references is ``packages/recipes/tests/test_user_path_matrix.py``). Cells that
need several GPUs are listed with the reason they were skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-m", "train_recipes.cli"]

# Llama-style shapes (hidden, layers, heads, kv heads, intermediate), Llama 3's vocabulary.
SHAPES = {
    "1b5": (2048, 16, 32, 8, 8192),
    # The matrix's model: the 1.5B's head and vocabulary, 8 narrower layers (0.4B), so four
    # cells share one GPU.
    "0b4": (1024, 8, 16, 4, 4096),
    "8b": (4096, 32, 32, 8, 14336),
    "tiny": (64, 2, 4, 2, 128),
}
VOCAB = 128256


@dataclass(kw_only=True, slots=True, frozen=True)
class Cell:
    """One CLI run of the matrix.

    Attributes:
        name: the table's row name.
        model: a key of the prepared models ("1b5", "0b4", "8b", "moe", "vlm-demo").
        sets: ``--set`` overrides on top of the suite's base.
        resume_at: SIGKILL after this step's checkpoint, then ``--resume`` (0: no check).
        export: check the HF export loads with ``from_pretrained``.
        needs_gpus: GPUs the cell needs (more than present: listed as skipped).
        expect_refusal: a substring of a one-line pre-launch refusal the cell expects instead
            of training.
        min_gib: GPU memory the cell needs (less present: listed as skipped).
        alone: run with the GPU to itself (its tokens/s and MFU are reported); the others run
            ``--jobs`` at a time and share the GPU.
        data: "chats" (5-200 words, packed by default) or "long" (rows of about 3,900 tokens,
            the bench's shape when unpacked).
    """

    name: str
    model: str
    sets: tuple[str, ...] = ()
    resume_at: int = 0
    export: bool = False
    needs_gpus: int = 1
    expect_refusal: str | None = None
    min_gib: float = 0.0
    alone: bool = False
    data: str = "chats"


PACKED = ("data.packing=true",)
UNPACKED = ("data.packing=false",)
COMPILE = ("model.compile=true",)
EAGER = ("model.compile=false", "model.compile_memory_budget=null")
AC1 = ("model.activation_checkpointing=true", "model.activation_checkpointing_every=1")
AC2 = ("model.activation_checkpointing=true", "model.activation_checkpointing_every=2")
FSDP2 = ("parallel.data_parallel=fsdp2",)
LORA = ("lora.enabled=true",)
NO_MASTER = ("optim.master_weights=false",)

# Pairwise over packing x checkpointing (off / every layer / every 2nd) x compile x data
# parallel (none / fsdp2) x LoRA x master weights: every pair of two knobs' values appears in
# some cell, each on top of the shipped llama-1b5-1gpu config (packing, compile, no wrapper,
# master weights).
CELLS = [
    # On the 1.5B, alone: the shipped config as is, its throughput against the bench.
    Cell(name="shipped-1b5", model="1b5", export=True, alone=True),
    # The bench's shape (batch 4 x 4096 unpacked rows of ~4k tokens, one micro-batch a step):
    # the CLI's tokens/s beside sft_step.py's recipes-master in the same call.
    Cell(name="bench-shape-1b5", model="1b5", data="long", sets=UNPACKED, alone=True),
    # The matrix on the 0.4B, --jobs at a time.
    Cell(name="shipped", model="0b4", resume_at=3, export=True),
    Cell(name="ac2", model="0b4", sets=AC2),
    Cell(name="ac1-eager", model="0b4", sets=AC1 + EAGER),
    Cell(name="unpacked-ac2", model="0b4", sets=UNPACKED + AC2),
    Cell(name="unpacked-eager", model="0b4", sets=UNPACKED + EAGER + NO_MASTER),
    Cell(name="fsdp2-ac1", model="0b4", sets=FSDP2 + AC1, resume_at=3),
    Cell(name="fsdp2-unpacked-eager", model="0b4", sets=FSDP2 + UNPACKED + EAGER),
    Cell(name="lora", model="0b4", sets=LORA, export=True),
    Cell(name="lora-fsdp2-ac2-unpacked", model="0b4", sets=LORA + FSDP2 + AC2 + UNPACKED),
    Cell(name="lora-eager-ac1-no-master", model="0b4", sets=LORA + EAGER + AC1 + NO_MASTER),
    Cell(name="no-master-ac2", model="0b4", sets=NO_MASTER + AC2),
    Cell(name="moe", model="moe", sets=("model.dtype=bfloat16",), export=True),
    Cell(name="vlm", model="vlm-demo", export=True),
    Cell(
        name="8b-default-checkpoint",
        model="8b",
        sets=FSDP2 + AC2,
        expect_refusal="checkpoint",
    ),
    # The issue's 8B run: bf16 AdamW state alone is 64 GB; an H100's 80 GB does not hold it
    # with the activations.
    Cell(
        name="8b-packed-compile-ac2",
        model="8b",
        sets=NO_MASTER + AC2 + ("train.checkpoint_optimizer=false",),
        min_gib=100,
        alone=True,
    ),
    Cell(name="fsdp2-2gpu", model="1b5", sets=FSDP2, needs_gpus=2),
    Cell(name="cp2-packed", model="1b5", sets=("parallel.cp=2",), needs_gpus=2),
    Cell(name="tp2", model="1b5", sets=("parallel.tp=2",), needs_gpus=2),
    Cell(name="moe-ep2", model="moe", sets=("parallel.ep=2", *FSDP2), needs_gpus=2),
]


@dataclass(kw_only=True, slots=True)
class Outcome:
    """What one cell measured."""

    name: str
    result: str
    losses: dict[int, float] = field(default_factory=dict)
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def _words(rng: random.Random, n: int) -> str:
    pool = ["alpha", "beta", "gamma", "delta", "omega", "red", "green", "blue", "seven", "nine"]
    return " ".join(rng.choice(pool) + str(rng.randrange(100)) for _ in range(n))


def write_chats(
    path: Path, rows: int, *, seed: int = 0, max_words: int = 200, min_words: int = 5
) -> None:
    """Chat rows of ``min_words``-``max_words`` words: the answer is the question's words
    reversed (about 7.4 characters a word; 200 words stay under 4096 tokens of the char
    tokenizer, question and answer together)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            question = _words(rng, rng.randrange(min_words, max_words))
            answer = " ".join(reversed(question.split()))
            messages = [
                {"role": "user", "content": f"Reverse: {question}"},
                {"role": "assistant", "content": answer},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def save_llama(directory: Path, shape: str, device: str) -> Path:
    """A random-init Llama-style model of ``shape`` in bf16, with the demo's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from train_recipes.data.demo import build_char_tokenizer

    if (directory / "config.json").is_file():
        return directory
    hidden, layers, heads, kv_heads, ffn = SHAPES[shape]
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        vocab_size=VOCAB if shape != "tiny" else len(tokenizer),
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    return directory


def prepare(work: Path, *, quick: bool, needed: set[str]) -> dict[str, Path]:
    """Models and the converted datasets under ``work`` (reused when already there)."""
    work.mkdir(parents=True, exist_ok=True)
    device = "cpu" if quick else "cuda"
    models = {
        name: save_llama(work / f"llama-{name}", "tiny" if quick else name, device)
        for name in ("1b5", "0b4", "8b")
        if name in needed
    }
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages/recipes/tests"))
    from _moe_recipe_models import save_tiny_moe

    moe = work / "qwen3-moe"
    if not (moe / "config.json").is_file():
        save_tiny_moe("qwen3_moe", moe)
    models["moe"] = moe
    sizes = {"chats": (5, 12 if quick else 200, 300 if quick else 3000)}
    sizes["long"] = (10, 12, 64) if quick else (255, 262, 256)
    for name, (low, high, rows) in sizes.items():
        data = work / f"{name}-energon"
        if not (data / ".nv-meta").is_dir():
            chats = work / f"{name}.jsonl"
            write_chats(chats, rows, min_words=low, max_words=high)
            subprocess.run(
                [sys.executable, "-m", "energon_sft.cli", "convert", str(chats), str(data)],
                check=True,
            )
        models[f"data-{name}"] = data
    return models


def base_sets(models: dict[str, Path], cell: Cell, *, quick: bool, steps: int) -> list[str]:
    """The suite's overrides under each cell's: few steps, one micro-batch a step, logs."""
    if cell.model == "vlm-demo":
        sets = [f"train.steps={steps}", "train.device=cuda" if not quick else "train.device=cpu"]
        return [*sets, "train.log_every=1", "train.checkpoint_every=0"]
    sets = [
        f"model.path={models[cell.model]}",
        f"data.path={models[f'data-{cell.data}']}",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.gradient_accumulation_steps=1",
        "train.eval_samples=0",
        f"train.export={'true' if cell.export else 'false'}",
        "train.tensorboard=false",
        f"train.checkpoint_every={cell.resume_at}",
        "data.num_workers=2",
        # A few steps must move a random-init model: no warm-up, a fine-tuning peak rate.
        "optim.warmup_steps=0",
        "optim.lr=1e-4",
    ]
    if quick:
        sets += ["train.device=cpu", "model.dtype=float32", "data.max_length=256", *EAGER]
    if cell.model == "moe":
        sets += ["data.micro_batch_size=4"]
    return sets


def cli_args(
    models: dict[str, Path], cell: Cell, out: Path, *, quick: bool, steps: int
) -> list[str]:
    config = "vlm-shapes-cpu" if cell.model == "vlm-demo" else "llama-1b5-1gpu"
    sets = [*base_sets(models, cell, quick=quick, steps=steps), *cell.sets]
    args = [*CLI, "sft", "--config", config, "--nproc-per-node", "1", "--output-dir", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in _metrics(run_dir) if "loss" in r}


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None and math.isfinite(v))
    return values[len(values) // 2] if values else None


def _launch(args: list[str], log: Path, *, timeout: float) -> subprocess.CompletedProcess[str]:
    with log.open("w") as f:
        return subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout)


def _kill_after_checkpoint(args: list[str], run_dir: Path, step: int, log: Path) -> None:
    """Start the run and SIGKILL its process group once ``step``'s checkpoint is complete."""
    from train_engine import complete_checkpoints

    with log.open("w") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 900
        root = run_dir / "checkpoints"
        while proc.poll() is None and time.monotonic() < deadline:
            if root.is_dir() and any(
                p.name == f"step_{step:06d}" for p in complete_checkpoints(root)
            ):
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.2)
        proc.wait()


def _export_loads(run_dir: Path) -> str | None:
    code = (
        "import sys, transformers; "
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]) "
        "if 'vision_config' not in open(sys.argv[1] + '/config.json').read() else "
        "transformers.AutoModelForImageTextToText.from_pretrained(sys.argv[1]); "
        "print(sum(p.numel() for p in m.parameters()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(run_dir / "hf_model")], capture_output=True, text=True
    )
    return None if done.returncode == 0 else done.stderr.strip().splitlines()[-1]


def run_cell(
    cell: Cell, models: dict[str, Path], work: Path, *, quick: bool, steps: int
) -> Outcome:
    """Run one cell and its checks."""
    outcome = Outcome(name=cell.name, result="ok")
    run_dir = work / "runs" / cell.name
    args = [*cli_args(models, cell, run_dir, quick=quick, steps=steps), "--overwrite"]
    started = time.monotonic()
    done = _launch(args, work / f"{cell.name}.log", timeout=1200)
    outcome.seconds = time.monotonic() - started
    text = (work / f"{cell.name}.log").read_text()
    if "Traceback" in text:
        outcome.notes.append("traceback in the output")
    if cell.expect_refusal is not None:
        lines = [line for line in text.splitlines() if line.strip()]
        refused = done.returncode != 0 and cell.expect_refusal in text and len(lines) <= 3
        outcome.result = "refused before launch" if refused else f"FAIL (exit {done.returncode})"
        outcome.notes.append(lines[-1][:200] if lines else "no output")
        return outcome
    if done.returncode != 0:
        outcome.result = f"FAIL (exit {done.returncode})"
        outcome.notes.append(text.strip().splitlines()[-1][:300] if text.strip() else "")
        return outcome
    outcome.losses = _losses(run_dir)
    values = list(outcome.losses.values())
    if not values or not all(math.isfinite(v) for v in values):
        outcome.result = "FAIL (non-finite loss)"
    elif values[-1] >= values[0]:
        outcome.result = "FAIL (loss did not fall)"
    rows = _metrics(run_dir)
    # The first step compiles and warms caches: the median of the later ones.
    outcome.tokens_per_s = _median(
        [r.get("tokens_per_s_per_gpu", r.get("tokens_per_s")) for r in rows[1:] if "loss" in r]
    )
    outcome.mfu = _median([r.get("mfu") for r in rows[1:] if "mfu" in r])
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        outcome.peak_gib = summary.get("peak_memory_gib")
        if outcome.mfu is None:
            outcome.mfu = summary.get("mfu")
    if cell.export:
        error = _export_loads(run_dir)
        if error is not None:
            outcome.result = "FAIL (export)"
            outcome.notes.append(error[:200])
    if cell.resume_at:
        resumed = work / "runs" / f"{cell.name}-resumed"
        resume_args = cli_args(models, cell, resumed, quick=quick, steps=steps)
        _kill_after_checkpoint(
            [*resume_args, "--overwrite"], resumed, cell.resume_at, work / f"{cell.name}-killed.log"
        )
        again = _launch([*resume_args, "--resume"], work / f"{cell.name}-resume.log", timeout=1200)
        got = _losses(resumed)
        worst = _worst_diff(got, outcome.losses, after=cell.resume_at)
        outcome.notes.append(f"resume at {cell.resume_at}: max |loss diff| {worst:.3g}")
        if again.returncode != 0:
            outcome.result = "FAIL (resume)"
            text = (work / f"{cell.name}-resume.log").read_text().strip()
            outcome.notes.append(text.splitlines()[-1][:300] if text else "")
        elif worst != 0.0:
            # GPU kernels whose backward accumulates with atomics (cuDNN/flash attention) make
            # two uninterrupted runs differ too: measure that spread with a second one.
            again_dir = work / "runs" / f"{cell.name}-again"
            _launch(
                [*cli_args(models, cell, again_dir, quick=quick, steps=steps), "--overwrite"],
                work / f"{cell.name}-again.log",
                timeout=1200,
            )
            spread = _worst_diff(_losses(again_dir), outcome.losses, after=cell.resume_at)
            outcome.notes.append(f"two uninterrupted runs differ by {spread:.3g}")
            shutil.rmtree(again_dir, ignore_errors=True)
            if not worst <= 4 * spread:
                outcome.result = "FAIL (resume not exact)"
        shutil.rmtree(resumed, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints of 5-20 GB a cell fill the disk
    return outcome


def _worst_diff(got: dict[int, float], want: dict[int, float], *, after: int) -> float:
    """The largest |loss difference| over ``want``'s steps after ``after`` (inf: one missing)."""
    diffs = [abs(got.get(s, math.inf) - v) for s, v in want.items() if s > after]
    return max(diffs) if diffs else math.inf


def table(outcomes: list[Outcome], skipped: list[tuple[Cell, str]]) -> str:
    lines = [
        "| cell | result | tokens/s/GPU | MFU | peak GiB | loss first -> last | s | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        loss = "-"
        if o.losses:
            first, last = o.losses[min(o.losses)], o.losses[max(o.losses)]
            loss = f"{first:.3f} -> {last:.3f}"
        tps = "-" if o.tokens_per_s is None else f"{o.tokens_per_s:,.0f}"
        mfu = "-" if o.mfu is None else f"{100 * o.mfu:.1f}%"
        peak = "-" if o.peak_gib is None else f"{o.peak_gib:.1f}"
        notes = "; ".join(o.notes).replace("|", "/")
        lines.append(
            f"| {o.name} | {o.result} | {tps} | {mfu} | {peak} | {loss} | {o.seconds:.0f} | {notes} |"
        )
    for cell, why in skipped:
        lines.append(f"| {cell.name} | skipped | - | - | - | - | - | {why} |")
    return "\n".join(lines)


def run_bench(out: Path, *, quick: bool) -> dict[str, Any] | None:
    """sft_step.py's recipes-master variant (the shipped config's step, random unpacked rows of
    4 x 4096): the bench's tokens/s beside the CLI's bench-shape cell."""
    bench = Path(__file__).resolve().parents[1] / "packages/recipes/bench/sft_step.py"
    args = [sys.executable, str(bench), "--variants", "recipes-master", "--no-check"]
    args += ["--out", str(out / "sft_step.json")] + (["--quick"] if quick else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    (out / "sft_step.log").write_text(done.stdout + done.stderr)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return rows[-1] if done.returncode == 0 and rows else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/user-path"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/user-path")))
    parser.add_argument("--cells", default="", help="comma-separated cell names (default: all)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--jobs", type=int, default=4, help="matrix cells run at once")
    parser.add_argument("--bench", action="store_true", help="also run sft_step.py recipes-master")
    parser.add_argument("--quick", action="store_true", help="tiny models on the CPU")
    parser.add_argument(
        "--set",
        dest="extra_sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override added to every cell's, after the suite's (e.g. data.num_workers=8)",
    )
    args = parser.parse_args()
    wanted = set(filter(None, args.cells.split(",")))
    unknown = wanted - {c.name for c in CELLS}
    if unknown:
        parser.error(f"unknown cells {sorted(unknown)}; choose from {[c.name for c in CELLS]}")
    gpus, gib = 0, 0.0
    if not args.quick:
        import torch

        gpus = torch.cuda.device_count()
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpus else 0.0
    chosen, skipped = [], []
    for cell in CELLS:
        if wanted and cell.name not in wanted:
            continue
        cell = replace(cell, sets=(*cell.sets, *args.extra_sets))
        if not args.quick and cell.needs_gpus > gpus:
            skipped.append((cell, f"needs {cell.needs_gpus} GPUs, {gpus} present"))
        elif not args.quick and cell.min_gib > gib:
            skipped.append((cell, f"needs {cell.min_gib:.0f} GiB of GPU memory, {gib:.0f} here"))
        else:
            chosen.append(cell)
    models = prepare(args.work, quick=args.quick, needed={c.model for c in chosen})
    outcomes: list[Outcome] = []

    def one(cell: Cell) -> None:
        outcome = run_cell(cell, models, args.work, quick=args.quick, steps=args.steps)
        for suffix in ("", "-resumed", "-again"):  # a failed cell's checkpoints too
            shutil.rmtree(args.work / "runs" / f"{cell.name}{suffix}", ignore_errors=True)
        if not cell.alone and args.jobs > 1:
            outcome.notes.append(f"shared the GPU with up to {args.jobs - 1} cells")
        outcomes.append(outcome)
        print(table([outcome], []).splitlines()[-1], flush=True)
        _write(args.out, outcomes, skipped)  # a run cut short keeps the cells it finished

    # The cells that own the GPU first (their throughput is reported), then the matrix.
    for cell in (c for c in chosen if c.alone):
        one(cell)
    if args.bench:
        row = run_bench(args.out, quick=args.quick)
        shape = next((o for o in outcomes if o.name == "bench-shape-1b5"), None)
        note = "sft_step.py recipes-master failed (see sft_step.log)"
        if row is not None:
            note = f"sft_step.py recipes-master: {row['tokens/s']:,.0f} tokens/s, MFU {row['MFU %']:.1f}%"
            if shape is not None and shape.tokens_per_s:
                note += f"; the CLI's bench-shape cell: {shape.tokens_per_s / row['tokens/s']:.3f}x"
        print(note, flush=True)
        (args.out / "bench_vs_cli.txt").write_text(note + "\n")
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, [c for c in chosen if not c.alone]))
    report = _write(args.out, outcomes, skipped)
    print(report)


def _write(out: Path, outcomes: list[Outcome], skipped: list[tuple[Cell, str]]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    report = table(outcomes, skipped)
    (out / "user_path.md").write_text(report + "\n")
    rows = [{k: getattr(o, k) for k in Outcome.__slots__} for o in outcomes]  # type: ignore[attr-defined]
    (out / "user_path.json").write_text(json.dumps(rows, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
