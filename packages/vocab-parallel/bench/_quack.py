"""The fused loss's three chunk products through quack's CuTe-DSL Hopper GEMMs (bench trials
only: quack-kernels and nvidia-cutlass-dsl are not dependencies of any package).

# C tokens per chunk, H hidden, V vocabulary

A config is written ``TMxTN:KIND:CMxCN[:swap][:kS]``: the output tile, ``pp`` (ping-pong) or
``coop`` (cooperative) warp groups, the thread-block cluster, optionally A and B swapped and a
split of K over S blocks (deterministic serial reduction). The products:

    logits  [C, V] = h_c [C, H] @ W.T          (K = H)
    hgrad   [C, H] = G_c [C, V] @ W [V, H]     (K = V)
    acc     W_grad [V, H] += G_c.T @ h_c        (K = C; ``reduce``: the tile stored with a TMA
            reduce-add, summed in L2 after rounding to bf16; ``load``: the old tile loaded in the
            epilogue and summed in fp32, one rounding)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

PRODUCTS = ("logits", "hgrad", "acc")


@dataclass(frozen=True, slots=True, kw_only=True)
class QuackChoice:
    """One product's quack GEMM: its config text and, for ``acc``, the accumulation mode."""

    config: str
    mode: str = "load"


def parse_config(text: str):  # type: ignore[no-untyped-def]
    """``TMxTN:KIND:CMxCN[:swap][:kS]`` -> (quack GemmConfig, split_k)."""
    from quack.gemm_config import GemmConfig

    tile, kind, cluster, *rest = text.split(":")
    tile_m, tile_n = (int(x) for x in tile.split("x"))
    cluster_m, cluster_n = (int(x) for x in cluster.split("x"))
    split_k = next((int(r[1:]) for r in rest if r.startswith("k")), 1)
    config = GemmConfig(
        tile_m=tile_m,
        tile_n=tile_n,
        pingpong=kind == "pp",
        cluster_m=cluster_m,
        cluster_n=cluster_n,
        swap_ab="swap" in rest,
        is_dynamic_persistent=False,
        device_capacity=9,
    )
    return config, split_k


def logits_fn(text: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(h_chunk [C, H], weight [V, H]) -> logits [C, V]`` through the config ``text``."""
    from quack.gemm_interface import gemm_tuned

    config, split_k = parse_config(text)

    def run(h_chunk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty(h_chunk.shape[0], weight.shape[0], dtype=h_chunk.dtype,
                          device=h_chunk.device)  # fmt: skip
        gemm_tuned.fn(h_chunk, weight.T, out, None, config=config, split_k=split_k)
        return out

    return run


def hgrad_fn(text: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """``(grad_logits [C, V], weight [V, H], out [C, H])``: out = G @ W through ``text``."""
    from quack.gemm_interface import gemm_tuned

    config, split_k = parse_config(text)

    def run(grad_logits: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        gemm_tuned.fn(grad_logits, weight, out, None, config=config, split_k=split_k)

    return run


def acc_fn(choice: QuackChoice) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """``(accumulator [V, H], grad_logits [C, V], h_chunk [C, H])``: acc += G.T @ h."""
    from quack.gemm_interface import gemm_tuned

    config, split_k = parse_config(choice.config)
    if choice.mode not in ("reduce", "load"):
        raise ValueError(f"acc mode {choice.mode!r}: expected 'reduce' or 'load'")

    def run(accumulator: torch.Tensor, grad_logits: torch.Tensor, h_chunk: torch.Tensor) -> None:
        if choice.mode == "reduce":
            gemm_tuned.fn(grad_logits.T, h_chunk, accumulator, None, add_to_output=True,
                          config=config, split_k=split_k)  # fmt: skip
        else:
            gemm_tuned.fn(grad_logits.T, h_chunk, accumulator, accumulator, beta=1.0,
                          config=config, split_k=split_k)  # fmt: skip

    return run
