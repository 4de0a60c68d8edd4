#!/usr/bin/env bash
# One call on a one-GPU machine whose python3 already has torch (and triton, transformers):
# install the wheels of .whl/ (the workspace's and the third-party ones the image lacks, filled
# beforehand by `bash benchmarks/fetch_device_wheels.sh`), run the CUDA tests, then the
# packages' GPU benchmarks. Logs and JSON go to $OUT (default /tmp/gpu-out).
#   usage: bash benchmarks/gpu_single.sh [tests|bench|all|round4|round4-tests|round4-bench]
# (round4 = round4-tests then round4-bench; each half fits one 10-minute device call)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
what=${1:-all}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
log="$OUT/gpu.log"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee -a "$log"
step() { local limit=$1; shift; echo "=== $*" | tee -a "$log"; timeout "$limit" "$@" 2>&1 | tee -a "$log" | tail -25; }
if [[ $what == tests || $what == all ]]; then
  # One pytest per file, each under its own time limit.
  for t in vocab-parallel/tests/test_vp_triton.py vocab-parallel/tests/test_vp_dist.py \
           engine/tests/test_engine_cuda.py cp-sharder/tests/test_sharder_cuda.py \
           moe-dispatch/tests/test_dispatch_cuda.py testing/tests/test_markers.py recipes/tests/test_recipes_cuda.py; do
    step 240 python3 -m pytest -q -rs -p no:cacheprovider "packages/$t"
  done
fi
if [[ $what == bench || $what == all ]]; then
  for t in 8192 16384; do
    step 150 python3 packages/vocab-parallel/bench/log_probs.py --device cuda --tokens $t --vocab 151936 --out "$OUT/vocab_parallel_T$t.json"
  done
  step 120 python3 packages/moe-dispatch/bench/dispatch_throughput.py --device cuda --tokens 16384 --hidden 2048 --experts 64 --top-k 8 --dtype bfloat16 --json "$OUT/moe_dispatch.json"
  step 90 python3 packages/engine/bench/overhead.py --device cuda --out "$OUT/engine_overhead.json"
  step 120 python3 packages/engine/bench/overhead.py --device cuda --hidden 4096 --batch 8192 --steps 5 --fused --out "$OUT/engine_overhead_gpu_bound_fused.json"
  step 60 python3 packages/engine/bench/clip.py --device cuda --out "$OUT/engine_clip.json"
  step 240 python3 packages/engine/bench/sft_llama.py --device cuda --baseline --out "$OUT/engine_sft_llama.json"
  step 420 python3 packages/recipes/bench/sft_step.py --variants fsdp2,fsdp2+compile,recipes,recipes-hf-mask,recipes-cp1 --profile recipes --board --out "$OUT/sft_step.json"
  # Needs megatron-energon and its dependencies importable (carry their wheels; see packages/recipes/README.md).
  step 360 python3 packages/recipes/bench/loader_vs_step.py --device cuda --out "$OUT/loader_vs_step.json"
fi
if [[ $what == round4 || $what == round4-tests ]]; then
  # Issue 21, fourth round (prepared without a GPU; run first thing when one is lent):
  # the Triton MasterWeightAdamW kernel and the no-sync trained-rows loss on CUDA, then the
  # one-GPU SFT step without FSDP2 (recipes-master) against the FSDP2 step and the Liger peer,
  # and the VLM step with and without the trained-rows head.
  step 300 python3 -m pytest -q -rs -p no:cacheprovider packages/engine/tests/test_engine_cuda.py
  step 300 python3 -m pytest -q -rs -p no:cacheprovider packages/recipes/tests/test_recipes_cuda.py
  step 400 python3 -m pytest -q -rs -p no:cacheprovider packages/vocab-parallel/tests/test_vp_triton.py
  step 120 python3 packages/engine/bench/master_adamw.py --device cuda --hidden 2048 --layers 16 --out "$OUT/master_adamw.json"
fi
if [[ $what == round4 || $what == round4-bench ]]; then
  step 480 python3 packages/recipes/bench/sft_step.py --variants recipes-lean-chunk,recipes-master,fsdp2+liger --lean-loss-chunk 8192 --steps 10 --warmup 2 --board --out "$OUT/sft_step_round4.json"
  step 420 python3 packages/recipes/bench/loader_vs_step.py --device cuda --step-only --step-variants varlen+linearpatch+fusedadam+compile,varlen+linearpatch+fusedadam+compile+allpositions --out "$OUT/vlm_trained_rows.json"
fi
