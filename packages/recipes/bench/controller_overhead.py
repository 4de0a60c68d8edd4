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

The third, which a loaded machine cannot blur, is measured inside the Ray run: rank 0's actor
logs ``controller/step_ms`` (time inside its ``train_step`` calls) and ``controller/wait_ms``
(time between them: the driver's round trip and logging), so wait / (step + wait) is the share
of the actor's step cycle that the controller costs. ``--repeats`` alternates which mode runs
first, so a drift of the machine's load falls on both.

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


def _median_metric(out: Path, name: str, *, skip: int = 5) -> float:
    """The median of metric ``name`` over a run's steps after the first ``skip``."""
    values = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if name in record and record.get("step", 0) > skip:
            values.append(float(record[name]))
    if not values:
        raise SystemExit(f"{out}/metrics.jsonl has no {name} after step {skip}")
    return statistics.median(values)


def _measure(mode: str, args: argparse.Namespace, extra: list[str], tmp: Path) -> dict[str, Any]:
    """One mode's short and long runs: the per-step time from the wall difference and the
    long run's median rate."""
    tag = f"{mode}-{len(list(tmp.iterdir()))}"
    walls = {
        n: _run(
            mode, n, ranks=args.ranks, out=tmp / f"{tag}-{n}", extra=extra, timeout_s=args.timeout_s
        )
        for n in (args.steps, 2 * args.steps)
    }
    long_run = tmp / f"{tag}-{2 * args.steps}"
    row: dict[str, Any] = {
        "mode": mode,
        "ranks": args.ranks,
        f"wall_{args.steps}_s": round(walls[args.steps], 2),
        f"wall_{2 * args.steps}_s": round(walls[2 * args.steps], 2),
        "step_ms": round(1000 * (walls[2 * args.steps] - walls[args.steps]) / args.steps, 2),
        "median_tokens_per_s": round(_median_metric(long_run, "tokens_per_s"), 1),
        "actor_step_ms": None,
        "actor_wait_ms": None,
    }
    if mode == "ray":  # rank 0's actor times its steps and the waits between them
        row["actor_step_ms"] = round(_median_metric(long_run, "controller/step_ms"), 2)
        row["actor_wait_ms"] = round(_median_metric(long_run, "controller/wait_ms"), 3)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (dp x cp x tp)")
    parser.add_argument("--steps", type=int, default=100, help="the short run's steps")
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of both modes, alternating which goes first"
    )
    parser.add_argument("--config", default=None, help="a config (default: the embedded demo)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    args = parser.parse_args(argv)

    extra = ["--config", args.config] if args.config else []
    extra += [x for kv in [*args.set, f"train.device={args.device}"] for x in ("--set", kv)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="controller-overhead-") as tmp:
        for repeat in range(args.repeats):
            # Alternating the order spreads a slow drift of the machine's load over both modes.
            order = ("spmd", "ray") if repeat % 2 == 0 else ("ray", "spmd")
            measured = {mode: _measure(mode, args, extra, Path(tmp)) for mode in order}
            spmd, ray = measured["spmd"], measured["ray"]
            for row in (spmd, ray):
                row["repeat"] = repeat
                row["ratio"] = (
                    round(row["step_ms"] / spmd["step_ms"], 4)
                    if spmd["step_ms"] > 0 and row["step_ms"] > 0
                    else None
                )
                row["ratio_from_rates"] = round(
                    spmd["median_tokens_per_s"] / row["median_tokens_per_s"], 4
                )
            rows += [spmd, ray]
    ray_rows = [row for row in rows if row["mode"] == "ray"]
    summary = {
        "ratio_from_rates_median": statistics.median(r["ratio_from_rates"] for r in ray_rows),
        "ratio_from_walls_median": statistics.median(
            [r["ratio"] for r in ray_rows if r["ratio"] is not None] or [float("nan")]
        ),
        "spmd_step_ms_median": statistics.median(r["step_ms"] for r in rows if r["mode"] == "spmd"),
        # Measured inside one process at one time, so the machine's load swings cancel out.
        "actor_wait_fraction_median": statistics.median(
            r["actor_wait_ms"] / (r["actor_step_ms"] + r["actor_wait_ms"]) for r in ray_rows
        ),
        "actor_step_ms_median": statistics.median(r["actor_step_ms"] for r in ray_rows),
    }
    if any(row["ratio"] is None for row in rows):
        # The longer run was not slower: other load on the machine outweighed the extra steps.
        print(
            "controller_overhead: a per-step time is not positive (the machine's other load "
            "varies more than the extra steps cost); rerun on a quiet machine or with more --steps",
            file=sys.stderr,
        )
    columns = ["repeat", *[c for c in rows[0] if c != "repeat"]]
    print_table(rows, columns, title="controller overhead per step (ratio: Ray / SPMD)")
    print(
        f"median over {args.repeats} repeat(s): Ray / SPMD step time "
        f"{summary['ratio_from_rates_median']:.4f} from the rates, "
        f"{summary['ratio_from_walls_median']:.4f} from the wall times; "
        f"SPMD step {summary['spmd_step_ms_median']:.0f} ms; the Ray actor waited "
        f"{100 * summary['actor_wait_fraction_median']:.2f}% of its step cycle for the driver "
        f"(step {summary['actor_step_ms_median']:.0f} ms)"
    )
    if args.out is not None:
        device = "cpu"
        if args.device == "cuda":
            import torch

            device = torch.cuda.get_device_name(0)
        payload = {
            "device": device,
            "versions": versions("ray", "train-recipes"),
            "config": {
                "steps": args.steps,
                "repeats": args.repeats,
                "ranks": args.ranks,
                "config": args.config,
                "set": args.set,
            },
            "summary": summary,
            "rows": rows,
        }
        args.out.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
