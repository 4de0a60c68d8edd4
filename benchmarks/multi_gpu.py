"""Multi-GPU validation run: CP, TP (vocab-parallel), EP and FSDP2 on one host, one torchrun.

    torchrun --nproc-per-node 4 benchmarks/multi_gpu.py --out benchmarks/results/mgpu
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py --quick --device cpu --out /tmp/mgpu

The entry point only: the run lives in the ``mgpu`` package next to this file (see its
docstring and benchmarks/README.md).
"""

from mgpu.main import main

if __name__ == "__main__":
    main()
