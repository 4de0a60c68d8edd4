#!/usr/bin/env bash
# Fill .whl/ for a GPU-machine call: the workspace's wheels (built without workspace sources)
# and the third-party wheels of benchmarks/device_wheels.txt for that machine's Python 3.12 on
# x86-64 Linux. Then carry .whl (ignored by git: add `/.whl/` to .git/info/exclude) and run
# `bash benchmarks/gpu_single.sh ...` there. About 35 MB.
#   usage: bash benchmarks/fetch_device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/*.whl
uv build --all-packages --wheel --no-sources --out-dir .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
grep -v '^\s*#' benchmarks/device_wheels.txt | grep -v '^\s*$' | while read -r requirement; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$requirement"
done
ls .whl | wc -l
