"""Helpers every package's benchmark scripts share (``bench/*.py``, ``benchmarks/``).

A library package may not import another, so what its benchmarks have in common lives here, in
the unpublished test helper every workspace environment (and the GPU machine's wheel folder)
has. Importing this package imports torch, never pytest; the ``--quick`` runner of the tests is
:mod:`train_testing.bench.quick`.

- output: :func:`fmt`, :func:`format_table`, :func:`print_table`, :func:`print_lines`,
  :func:`write_json`, :func:`report`, :func:`device_name`, :func:`versions`,
  :func:`environment`.
- runtime: :func:`add_device_argument`, :func:`init_process_group`, :func:`sync`,
  :func:`free_memory`, :func:`peak_gib`, :func:`time_ms`, :func:`times_ms`,
  :func:`event_ms`, :func:`event_median_ms` (CUDA events), :func:`alternating_medians`.
- board: :func:`board_samples` (the GPU's power draw and SM clock during a timed part),
  :func:`smi_gpu_id`.
- the SFT-step model: :data:`LLAMA_1P5B`, :data:`LLAMA_TINY`, :func:`llama_dims`,
  :func:`llama_config`, :func:`flops_per_token`, :func:`add_sft_step_arguments`,
  :func:`resolve_sft_step_sizes`.
"""

from train_testing.bench.board import board_samples, smi_gpu_id
from train_testing.bench.llama import (
    LLAMA_1P5B,
    LLAMA_TINY,
    add_sft_step_arguments,
    flops_per_token,
    llama_config,
    llama_dims,
    resolve_sft_step_sizes,
)
from train_testing.bench.output import (
    device_name,
    environment,
    fmt,
    format_table,
    print_lines,
    print_table,
    report,
    versions,
    write_json,
)
from train_testing.bench.runtime import (
    GIB,
    add_device_argument,
    alternating_medians,
    event_median_ms,
    event_ms,
    free_memory,
    init_process_group,
    peak_gib,
    sync,
    time_ms,
    times_ms,
)

__all__ = [
    "GIB",
    "LLAMA_1P5B",
    "LLAMA_TINY",
    "add_device_argument",
    "add_sft_step_arguments",
    "alternating_medians",
    "board_samples",
    "device_name",
    "environment",
    "event_median_ms",
    "event_ms",
    "flops_per_token",
    "fmt",
    "format_table",
    "free_memory",
    "init_process_group",
    "llama_config",
    "llama_dims",
    "peak_gib",
    "print_lines",
    "print_table",
    "report",
    "resolve_sft_step_sizes",
    "smi_gpu_id",
    "sync",
    "time_ms",
    "times_ms",
    "versions",
    "write_json",
]
