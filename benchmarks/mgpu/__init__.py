"""Multi-GPU validation run: CP, TP (vocab-parallel), EP and FSDP2 on one host, one torchrun.

    torchrun --nproc-per-node 4 benchmarks/multi_gpu.py --out benchmarks/results/mgpu
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py --quick --device cpu --out /tmp/mgpu

``benchmarks/multi_gpu.py`` is the entry point; this package holds the run: ``sizes`` (problem
sizes), ``harness`` (per-rank state, output, agreed phases, collectives), one module per section
(``cp``, ``vocab``, ``moe``, ``engine``) and ``main`` (command line, environment record, loop).

Sections (``--sections cp,vocab,moe,engine``), each with parity checks against an independent
reference and timings; each prints a table on rank 0 and writes ``<out>/mgpu_<section>_w<W>.json``:

1. ``cp``: cp-sharder on a random-init transformers Llama (8 layers, hidden 2048): loss and
   gradient parity of cp=W against cp=1 (fp32; portable backend and, on CUDA, torch's ring), then
   forward+backward throughput (bf16) against the sequence length with the peak memory per GPU.
2. ``vocab``: vocab-parallel ``token_log_probs`` / ``linear_token_log_probs`` on DTensors sharded
   over W ranks against a float64 dense reference, and their time against gathering the logits.
3. ``moe``: moe-dispatch ``AllToAllDispatcher`` dispatch+combine (unequal token counts per rank)
   against a dense float64 loop, forward and backward; bandwidth at 4k-32k tokens per rank.
4. ``engine``: train-engine FSDP2 SFT step of a 1.5B Llama, tokens/s per GPU at dp=W against the
   same step on one GPU.

Every phase catches its own exception and the ranks agree on the outcome (one all-reduce), so a
failure is recorded instead of killing the run; ``--timeout-s`` bounds a collective that a rank
never joins (e.g. an out-of-memory error on one rank only in the middle of a ring exchange).

# B batch, S sequence, T tokens, H hidden, V vocabulary, E experts, K top-k, W world size
"""
