"""The fused loss's three chunk products through quack's CuTe-DSL Hopper GEMMs against cuBLAS
(CUDA only; a trial: quack-kernels and nvidia-cutlass-dsl are not dependencies).

# C tokens per chunk, H hidden, V vocabulary

For each chunk size and product (``_quack.py``: logits, hidden gradient, weight-gradient
accumulation in ``reduce`` and ``load`` modes), cuBLAS's form as the library runs it and each
quack config of ``--configs``. Each row: the median CUDA-event time of ``--repeats`` calls, the
first call's seconds (the CuTe-DSL compile), and the relative error against float64 products
(for the accumulation, over the chunk's own contribution: ``|out - ref|_F / |ref - old|_F``).
The JSON's ``best`` names the fastest quack config of each product and chunk, for
``fused_linear_ab.py --quack-from``.

    python packages/vocab-parallel/bench/quack_gemms.py --chunks 768,384 --out quack_gemms.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable

import torch
from _quack import QuackChoice, acc_fn, hgrad_fn, logits_fn

from train_testing.bench import event_median_ms
from vocab_parallel._fused_linear import accumulate_weight_grad_

log = logging.getLogger("quack_gemms")

CONFIGS = (
    "128x192:pp:2x1,128x256:coop:2x1,128x256:coop:1x2,256x128:coop:2x1,256x128:coop:1x2,"
    "256x192:coop:2x1,128x192:pp:1x2"
)
SWAPPED = "128x192:pp:2x1:swap,128x256:coop:2x1:swap,256x128:coop:2x1:swap"
SPLIT_K = "128x192:pp:2x1:k2,128x256:coop:2x1:k2,128x192:pp:1x2:k2"


def _rel(out: torch.Tensor, ref: torch.Tensor, base: torch.Tensor | None = None) -> float:
    scale = ref if base is None else ref - base
    return float((out.double() - ref).norm() / scale.norm())


def _sweep_chunk(
    args: argparse.Namespace,
    chunk: int,
    weight: torch.Tensor,
    acc: torch.Tensor,
    gen: torch.Generator,
    extra: dict[str, list[str]],
    rows: list[dict[str, object]],
    began: float,
) -> dict[str, object]:
    """Time every product at one chunk size into ``rows``; return the fastest quack configs."""
    v, h = weight.shape
    dt = weight.dtype
    old = acc.clone()
    configs = [c for c in args.configs.split(",") if c]
    grad = torch.randn(chunk, v, device="cuda", dtype=dt, generator=gen) * 1e-3
    hid = torch.randn(chunk, h, device="cuda", dtype=dt, generator=gen)
    hgrad_out = torch.empty(chunk, h, device="cuda", dtype=dt)
    refs = {
        "logits": hid.double() @ weight.double().T,
        "hgrad": grad.double() @ weight.double(),
        "acc": old.double() + grad.double().T @ hid.double(),
    }
    fastest: dict[str, tuple[float, object]] = {}

    def record(product: str, name: str, run: Callable[[], torch.Tensor], quack: object) -> None:
        row: dict[str, object] = {"chunk": chunk, "product": product, "name": name}
        if time.perf_counter() - began > args.budget_s:
            row["error"] = "skipped: past --budget-s"
            rows.append(row)
            return
        try:
            acc.copy_(old)
            started = time.perf_counter()
            out = run()
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - started, 1)
            base = old.double() if product == "acc" else None
            row["rel_err"] = _rel(out, refs[product], base)
            acc.copy_(old)
            row["ms"] = round(event_median_ms(run, repeats=args.repeats), 4)
        except Exception as err:  # a trial config may not build: say so, go on
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        else:
            if quack is not None:
                key = product if product != "acc" else f"acc_{quack.mode}"  # type: ignore[attr-defined]
                if key not in fastest or row["ms"] < fastest[key][0]:  # type: ignore[operator]
                    fastest[key] = (row["ms"], quack)  # type: ignore[assignment]
        log.info(json.dumps(row))
        rows.append(row)

    def logits_cublas() -> torch.Tensor:
        return hid @ weight.T

    def hgrad_cublas() -> torch.Tensor:
        return torch.mm(grad, weight, out=hgrad_out)

    def acc_halves() -> torch.Tensor:
        accumulate_weight_grad_(acc, grad, hid)
        return acc

    def acc_plain() -> torch.Tensor:
        return acc.addmm_(grad.T, hid)

    for product in args.products.split(","):
        if product == "logits":
            record(product, "cublas", logits_cublas, None)
            for text in configs + extra[product]:
                fn = logits_fn(text)
                record(product, f"quack_{text}", lambda fn=fn: fn(hid, weight), text)
        elif product == "hgrad":
            record(product, "cublas", hgrad_cublas, None)
            for text in configs + extra[product]:
                fn = hgrad_fn(text)

                def run(fn=fn) -> torch.Tensor:  # type: ignore[no-untyped-def]
                    fn(grad, weight, hgrad_out)
                    return hgrad_out

                record(product, f"quack_{text}", run, text)
        elif product == "acc":
            record(product, "cublas_halves", acc_halves, None)
            record(product, "cublas_addmm", acc_plain, None)
            for text in configs:
                for mode in ("reduce", "load"):
                    choice = QuackChoice(config=text, mode=mode)
                    fn = acc_fn(choice)

                    def run(fn=fn) -> torch.Tensor:  # type: ignore[no-untyped-def]
                        fn(acc, grad, hid)
                        return acc

                    record(product, f"quack_{mode}_{text}", run, choice)
        else:
            raise SystemExit(f"--products {product}: expected acc, logits or hgrad")
    return {
        key: (value.config if isinstance(value, QuackChoice) else value)
        for key, (_, value) in fastest.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--chunks", default="768,384")
    parser.add_argument("--products", default="acc,logits,hgrad")
    parser.add_argument("--configs", default=CONFIGS)
    parser.add_argument("--swapped", default=SWAPPED, help="extra configs for logits and hgrad")
    parser.add_argument("--split-k", default=SPLIT_K, help="extra configs for hgrad")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=400.0, help="skip the rows left after")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("quack_gemms.py times Hopper GEMMs; run it on a GPU machine")
    try:
        import quack.gemm_interface  # noqa: F401
    except ImportError as err:
        raise SystemExit(
            f"quack_gemms.py needs quack-kernels and nvidia-cutlass-dsl (not dependencies of "
            f"this workspace; install them next to torch): {err}"
        ) from None
    v, h = args.vocab, args.hidden
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(v, h, device="cuda", dtype=dt, generator=gen) / h**0.5
    acc = torch.randn(v, h, device="cuda", dtype=dt, generator=gen) * 1e-2
    rows: list[dict[str, object]] = []
    best: dict[str, dict[str, object]] = {}
    began = time.perf_counter()
    extra = {
        "logits": [c for c in args.swapped.split(",") if c],
        "hgrad": [c for c in (args.swapped + "," + args.split_k).split(",") if c],
        "acc": [],
    }

    for chunk in (int(c) for c in args.chunks.split(",")):
        best[str(chunk)] = _sweep_chunk(args, chunk, weight, acc, gen, extra, rows, began)
        log.info("best at %d: %s", chunk, json.dumps(best[str(chunk)]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"vocab": v, "hidden": h, "rows": rows, "best": best}, f, indent=1)


if __name__ == "__main__":
    main()
