"""Ray controller overhead per step: ``sft --controller ray`` against the SPMD (torchrun) ranks.

Each mode runs the same command line (``train-recipes sft``, same config and seed) twice, for
``--steps`` and for ``2 * --steps`` optimizer steps, in fresh run folders; the per-step time is
the difference of the two wall times divided by ``--steps``, so process start-up, Ray's
cluster start, model building and the final evaluation cancel out. The ratio Ray / SPMD of the
per-step times is the controller's overhead (goal: <= 1.03 at a 300 ms step).

A second, steadier estimate comes from the runs' own ``metrics.jsonl`` (``train.log_every=1``):
the median ``tokens_per_s`` over the long run's steps after the first five. Both modes train the
same tokens per step, so SPMD's median rate over Ray's is the ratio of their step times; rank 0
measures the time from one step's record to the next, which includes waiting for the driver.

    python packages/recipes/bench/controller_overhead.py --out overhead.json      # CPU demo
    python packages/recipes/bench/controller_overhead.py --device cuda --ranks 1 \\
        --config llama-1b5-1gpu --set model.path=/models/m --set data.path=/data/d --steps 20

Prints one table (mode, ranks, wall times, per-step ms, ratio) and writes it as JSON with the
device and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from train_testing.bench import print_table, versions


def _run(
    mode: str, steps: int, *, ranks: int, out: Path, extra: list[str], timeout_s: float
) -> float:
    """Wall seconds of one ``train-recipes sft`` run of ``steps`` steps."""
    cmd = [sys.executable, "-m", "train_recipes.cli", "sft", "--nproc-per-node", str(ranks)]
    if mode == "ray":
        cmd += ["--controller", "ray"]
    cmd += [
        *extra,
        "--set",
        f"train.output_dir={out}",
        "--set",
        f"train.steps={steps}",
        "--set",
        "train.checkpoint_every=0",
        "--set",
        "train.eval_samples=0",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.export=false",
        "--set",
        "train.tensorboard=false",
        "--set",
        "train.log_every=1",
    ]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall


def _median_rate(out: Path, *, skip: int = 5) -> float:
    """The median ``tokens_per_s`` of a run's steps after the first ``skip``."""
    rates = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if "tokens_per_s" in record and record.get("step", 0) > skip:
            rates.append(float(record["tokens_per_s"]))
    if not rates:
        raise SystemExit(f"{out}/metrics.jsonl has no tokens_per_s after step {skip}")
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (dp x cp x tp)")
    parser.add_argument("--steps", type=int, default=100, help="the short run's steps")
    parser.add_argument("--config", default=None, help="a config (default: the embedded demo)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    args = parser.parse_args(argv)

    extra = ["--config", args.config] if args.config else []
    extra += [x for kv in [*args.set, f"train.device={args.device}"] for x in ("--set", kv)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="controller-overhead-") as tmp:
        for mode in ("spmd", "ray"):
            walls = {
                n: _run(
                    mode,
                    n,
                    ranks=args.ranks,
                    out=Path(tmp) / f"{mode}-{n}",
                    extra=extra,
                    timeout_s=args.timeout_s,
                )
                for n in (args.steps, 2 * args.steps)
            }
            per_step = (walls[2 * args.steps] - walls[args.steps]) / args.steps
            rate = _median_rate(Path(tmp) / f"{mode}-{2 * args.steps}")
            rows.append(
                {
                    "mode": mode,
                    "ranks": args.ranks,
                    f"wall_{args.steps}_s": round(walls[args.steps], 2),
                    f"wall_{2 * args.steps}_s": round(walls[2 * args.steps], 2),
                    "step_ms": round(1000 * per_step, 2),
                    "median_tokens_per_s": round(rate, 1),
                }
            )
    base = rows[0]["step_ms"]
    for row in rows:
        row["ratio"] = round(row["step_ms"] / base, 4) if base > 0 and row["step_ms"] > 0 else None
        row["ratio_from_rates"] = round(
            rows[0]["median_tokens_per_s"] / row["median_tokens_per_s"], 4
        )
    if any(row["ratio"] is None for row in rows):
        # The longer run was not slower: other load on the machine outweighed the extra steps.
        print(
            "controller_overhead: a per-step time is not positive (the machine's other load "
            "varies more than the extra steps cost); rerun on a quiet machine or with more --steps",
            file=sys.stderr,
        )
    print_table(rows, list(rows[0]), title="controller overhead per step (ratio: Ray / SPMD)")
    if args.out is not None:
        device = "cpu"
        if args.device == "cuda":
            import torch

            device = torch.cuda.get_device_name(0)
        payload = {"device": device, "versions": versions("ray", "train-recipes"), "rows": rows}
        args.out.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
