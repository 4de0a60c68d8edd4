"""Problem sizes of the multi-GPU run: full size on GPUs, tiny with ``--quick``."""

from __future__ import annotations

from dataclasses import dataclass

from train_testing.bench import llama_dims


@dataclass(kw_only=True, slots=True, frozen=True)
class Sizes:
    """Problem sizes of one run (full size on GPUs, or tiny with ``--quick``).

    Attributes:
        cp_model: LlamaConfig fields of the CP model.
        cp_parity_batch: B of the parity batch.
        cp_parity_seq: S of the parity batch (not a multiple of 2*cp, so padding is exercised).
        seq_lens: S of the throughput sweep (batch 1).
        vocab_tokens: T of the vocab-parallel check and timing.
        vocab_size: V.
        vocab_hidden: H of the fused linear form.
        moe_parity_tokens: tokens of rank 0 in the parity check (other ranks hold fewer).
        moe_parity_hidden: H of the parity check.
        moe_experts: E.
        moe_top_k: K.
        moe_tokens: tokens per rank of the bandwidth sweep.
        moe_hiddens: H of the bandwidth sweep.
        engine_model: LlamaConfig fields of the SFT model.
        engine_batch: micro-batch rows per GPU.
        engine_seq: S of the SFT step.
    """

    cp_model: dict[str, int]
    cp_parity_batch: int
    cp_parity_seq: int
    seq_lens: tuple[int, ...]
    vocab_tokens: int
    vocab_size: int
    vocab_hidden: int
    moe_parity_tokens: int
    moe_parity_hidden: int
    moe_experts: int
    moe_top_k: int
    moe_tokens: tuple[int, ...]
    moe_hiddens: tuple[int, ...]
    engine_model: dict[str, int]
    engine_batch: int
    engine_seq: int


FULL = Sizes(
    # The 1.5B model's layers (hidden 2048, FFN 8192, 32 / 8 heads), 8 of them, vocabulary 32000.
    cp_model={**llama_dims(quick=False), "num_hidden_layers": 8, "vocab_size": 32000},
    cp_parity_batch=2,
    cp_parity_seq=4093,
    seq_lens=(8192, 16384, 32768, 65536, 131072),
    vocab_tokens=8192,
    vocab_size=151936,
    vocab_hidden=4096,
    moe_parity_tokens=4096,
    moe_parity_hidden=2048,
    moe_experts=64,
    moe_top_k=8,
    moe_tokens=(4096, 8192, 16384, 32768),
    moe_hiddens=(2048, 7168),
    engine_model=llama_dims(quick=False),  # the 1.5B model of packages/engine/bench/sft_llama.py
    engine_batch=2,
    engine_seq=4096,
)

QUICK = Sizes(
    cp_model={**llama_dims(quick=True), "vocab_size": 256},
    cp_parity_batch=2,
    cp_parity_seq=29,
    seq_lens=(64, 128, 256),
    vocab_tokens=64,
    vocab_size=1001,  # odd: uneven shards
    vocab_hidden=32,
    moe_parity_tokens=40,
    moe_parity_hidden=16,
    moe_experts=8,
    moe_top_k=2,
    moe_tokens=(64, 128),
    moe_hiddens=(32,),
    engine_model=llama_dims(quick=True),
    engine_batch=2,
    engine_seq=32,
)
