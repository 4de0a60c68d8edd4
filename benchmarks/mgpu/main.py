"""The multi-GPU run's command line, environment record and section loop (see the package)."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mgpu
from train_testing.bench import device_name, free_memory, init_process_group, versions

from .cp import section_cp
from .engine import section_engine
from .harness import Run, emit, phase, reduce_scalar, write_section
from .moe import section_moe
from .sizes import FULL, QUICK
from .vocab import section_vocab

SECTIONS = ("cp", "vocab", "moe", "engine")


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=mgpu.__doc__.splitlines()[0] if mgpu.__doc__ else None)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU, < 2 minutes)")
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma list of " + ",".join(SECTIONS)
    )
    p.add_argument("--out", required=True, help="folder for the JSON files")
    p.add_argument("--seq-lens", type=_int_list, default=None, help="cp sweep, e.g. 8192,16384")
    p.add_argument(
        "--cp-sizes",
        type=_int_list,
        default=None,
        help="cp degrees (each divides W; default W; 1 adds the no-CP baseline)",
    )
    p.add_argument(
        "--cp-throughput-backend",
        choices=["auto", "portable"],
        default="auto",
        help="auto: the sharder's pick for a plain causal batch (torch's ring on CUDA); "
        "portable: mask one key so the portable backend runs (memory grows with S^2/cp)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps of cp / engine")
    p.add_argument("--iters", type=int, default=None, help="timed iterations of vocab / moe")
    p.add_argument("--single-gpu-tokens-per-s", type=float, default=None)
    p.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of caught errors")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    bad = [x for x in args.sections if x not in SECTIONS]
    if bad:
        p.error(f"unknown sections {bad}; choose from {list(SECTIONS)}")
    if args.steps is None:
        args.steps = 2 if args.quick else 4
    if args.iters is None:
        args.iters = 3 if args.quick else 10
    if args.device == "cpu" and not args.quick:
        p.error("full sizes need GPUs (--device cuda); use --quick on the CPU")
    return args


def main() -> None:
    args = parse_args()
    # NVLink multicast stays off: on shared hosts a program using it can take the GPUs down.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --nproc-per-node 2 " + sys.argv[0])
    init_process_group(args.device, timeout_s=args.timeout_s)
    run = Run(
        args=args,
        sizes=QUICK if args.quick else FULL,
        device=args.device,
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        out=Path(args.out),
    )
    names: list[Any] = [None] * run.world
    dist.all_gather_object(names, device_name(run.device))
    run.meta = {
        "command": " ".join(
            [
                "torchrun",
                f"--nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', run.world)}",
                *sys.argv,
            ]
        ),
        "world_size": run.world,
        "device": run.device,
        "device_names": names,
        "versions": versions(
            "transformers", "cp-sharder", "vocab-parallel", "moe-dispatch", "train-engine"
        ),
        "quick": args.quick,
        "steps": args.steps,
        "iters": args.iters,
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "sizes": asdict(run.sizes),
    }
    emit(
        run,
        f"multi_gpu: W={run.world} on {run.device} ({names[0]}), torch {torch.__version__}, "
        f"sections {args.sections}{' (quick)' if args.quick else ''}",
    )
    runners = {
        "cp": section_cp,
        "vocab": section_vocab,
        "moe": section_moe,
        "engine": section_engine,
    }
    summary = {}
    for section in args.sections:
        start = time.perf_counter()
        out = phase(run, section, lambda section=section: runners[section](run))
        payload = out.value if out.ok else {"errors": out.errors}
        payload["seconds"] = reduce_scalar(run, time.perf_counter() - start, dist.ReduceOp.MAX)
        payload["failed"] = not out.ok or bool(payload.get("errors"))
        write_section(run, section, payload)
        summary[section] = (payload["failed"], payload["seconds"])
        emit(
            run,
            f"[{section}] done in {payload['seconds']:.1f} s"
            + (" (with errors)" if payload["failed"] else ""),
        )
        free_memory(run.device)
    emit(
        run,
        "\nsummary: "
        + ", ".join(f"{k}={'ERRORS' if f else 'ok'} ({t:.0f} s)" for k, (f, t) in summary.items())
        + f"; JSON in {run.out}",
    )
    dist.destroy_process_group()
