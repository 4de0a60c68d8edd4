"""Trial: a persistent TMA Triton kernel for the fused loss's weight-gradient accumulation,
against cuBLAS, at the shapes of one token chunk (CUDA, Hopper or newer).

# C tokens per chunk (the product's K), V vocabulary rows (M), H hidden columns (N)

The accumulation acc [V, H] += G.T @ h, with G [C, V] the chunk's logits gradient and h [C, H]
its hidden rows, is the fused loss's only matmul well above its FLOPs' worth: with K = C short
(768 tokens), each output tile's store (and the read of its old value) is not hidden behind
the next tile's products in cuBLAS's kernels. This kernel keeps one program per SM, walks the
output tiles with a grouped order, loads G and h tiles through TMA descriptors, and can issue
the old tile's load before the K loop (``c_first``) so that it lands while the products run;
with ``flatten`` the compiler pipelines across tile boundaries. Every configuration is checked
against an fp32 reference and timed with CUDA events next to cuBLAS ``addmm_``, the library's
two-halves batched form and the plain product without accumulation.

    python packages/vocab-parallel/bench/acc_persistent.py --chunks 768,384
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vocab_parallel._fused_linear import accumulate_weight_grad_


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    group_m: int = 8
    c_first: bool = False
    flatten: bool = True
    subtile: bool = False


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _acc_kernel(
    g_desc,
    h_desc,
    c_desc,
    M,
    N,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    STAGES: tl.constexpr,
    C_FIRST: tl.constexpr,
    FLATTEN: tl.constexpr,
    SUBTILE: tl.constexpr,
):
    start = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(start, num_m * num_n, NUM_SMS, flatten=FLATTEN, num_stages=STAGES):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        if C_FIRST:
            if SUBTILE:
                old0 = c_desc.load([off_m, off_n])
                old1 = c_desc.load([off_m, off_n + BN // 2])
            else:
                old = c_desc.load([off_m, off_n])
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for ki in range(k_tiles):
            a = g_desc.load([ki * BK, off_m])  # [BK, BM]: G's rows are the product's K
            b = h_desc.load([ki * BK, off_n])  # [BK, BN]
            acc = tl.dot(a.T, b, acc)
        if SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(halves)
            if not C_FIRST:
                old0 = c_desc.load([off_m, off_n])
                old1 = c_desc.load([off_m, off_n + BN // 2])
            c_desc.store([off_m, off_n], (acc0 + old0.to(tl.float32)).to(c_desc.dtype))
            c_desc.store([off_m, off_n + BN // 2], (acc1 + old1.to(tl.float32)).to(c_desc.dtype))
        else:
            if not C_FIRST:
                old = c_desc.load([off_m, off_n])
            c_desc.store([off_m, off_n], (acc + old.to(tl.float32)).to(c_desc.dtype))


def accumulate(acc: torch.Tensor, grad: torch.Tensor, hid: torch.Tensor, cfg: Config) -> None:
    """acc [V, H] += grad.T [V, C] @ hid [C, H], all bf16 and contiguous."""
    c, v = grad.shape
    h = hid.shape[1]
    sms = torch.cuda.get_device_properties(acc.device).multi_processor_count
    c_block_n = cfg.block_n // 2 if cfg.subtile else cfg.block_n
    g_desc = TensorDescriptor.from_tensor(grad, [cfg.block_k, cfg.block_m])
    h_desc = TensorDescriptor.from_tensor(hid, [cfg.block_k, cfg.block_n])
    c_desc = TensorDescriptor.from_tensor(acc, [cfg.block_m, c_block_n])
    tiles = triton.cdiv(v, cfg.block_m) * triton.cdiv(h, cfg.block_n)
    _acc_kernel[(min(sms, tiles),)](
        g_desc,
        h_desc,
        c_desc,
        v,
        h,
        c,
        BM=cfg.block_m,
        BN=cfg.block_n,
        BK=cfg.block_k,
        GROUP_M=cfg.group_m,
        NUM_SMS=sms,
        STAGES=cfg.stages,
        C_FIRST=cfg.c_first,
        FLATTEN=cfg.flatten,
        SUBTILE=cfg.subtile,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )


def _time_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * repeats)]
    for i in range(repeats):
        events[2 * i].record()
        fn()
        events[2 * i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[2 * i].elapsed_time(events[2 * i + 1]) for i in range(repeats))


CONFIGS = [
    Config(block_m=128, block_n=256, block_k=64, stages=3, warps=8),
    Config(block_m=128, block_n=256, block_k=64, stages=3, warps=8, c_first=True),
    Config(block_m=128, block_n=256, block_k=64, stages=3, warps=8, subtile=True),
    Config(block_m=128, block_n=256, block_k=64, stages=4, warps=8),
    Config(block_m=128, block_n=256, block_k=64, stages=3, warps=8, flatten=False),
    Config(block_m=256, block_n=128, block_k=64, stages=3, warps=8),
    Config(block_m=256, block_n=128, block_k=64, stages=4, warps=8, c_first=True),
    Config(block_m=128, block_n=128, block_k=64, stages=4, warps=4),
    Config(block_m=128, block_n=128, block_k=64, stages=4, warps=8, c_first=True),
    Config(block_m=128, block_n=256, block_k=32, stages=5, warps=8),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--chunks", default="768,384")
    parser.add_argument("--inductor", action="store_true", help="also max-autotune acc += G.T @ h")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    v, h = args.vocab, args.hidden
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    acc0 = torch.randn(v, h, device="cuda", dtype=dt, generator=gen) * 1e-3
    acc = acc0.clone()
    results = []
    for c in (int(x) for x in args.chunks.split(",")):
        grad = torch.randn(c, v, device="cuda", dtype=dt, generator=gen) * 1e-2
        hid = torch.randn(c, h, device="cuda", dtype=dt, generator=gen)
        ref = acc0.float() + grad.float().T @ hid.float()
        row: dict = {"chunk": c}
        row["cublas_addmm_"] = _time_ms(lambda grad=grad, hid=hid: acc.addmm_(grad.T, hid))
        row["cublas_halves"] = _time_ms(
            lambda grad=grad, hid=hid: accumulate_weight_grad_(acc, grad, hid, halves=True)
        )
        row["cublas_plain_no_acc"] = _time_ms(lambda grad=grad, hid=hid: grad.T @ hid)
        row["logits_same_flops"] = _time_ms(lambda hid=hid: torch.mm(hid, acc0.T))
        if args.inductor:
            # Inductor's own choice among cuBLAS and its Triton templates (persistent TMA
            # ones included) for the same in-place update, timed the same way.
            import torch._inductor.config as inductor_config

            inductor_config.triton.enable_persistent_tma_matmul = True
            inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"

            def update(a: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
                a.add_(g.T @ x)

            compiled = torch.compile(update, mode="max-autotune-no-cudagraphs", dynamic=False)
            row["inductor_max_autotune"] = _time_ms(
                lambda grad=grad, hid=hid, compiled=compiled: compiled(acc, grad, hid)
            )
        print(json.dumps({k: round(x, 4) if isinstance(x, float) else x for k, x in row.items()}))
        for cfg in CONFIGS:
            try:
                acc.copy_(acc0)
                accumulate(acc, grad, hid, cfg)
                torch.cuda.synchronize()
                err = float((acc.float() - ref).norm() / ref.norm())
                ms = _time_ms(lambda grad=grad, hid=hid, cfg=cfg: accumulate(acc, grad, hid, cfg))
                entry = {"chunk": c, "config": repr(cfg), "rel_err": err, "ms": round(ms, 4)}
            except Exception as exc:  # a config the compiler or the GPU refuses: record why
                entry = {
                    "chunk": c,
                    "config": repr(cfg),
                    "error": f"{type(exc).__name__}: {exc}"[:300],
                }
            print(json.dumps(entry), flush=True)
            results.append(entry)
        results.append(row)
        del grad, hid, ref
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
