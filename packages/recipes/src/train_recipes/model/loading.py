"""Meta-device init and sharded loading of a model folder.

Build the model without memory, shard it (TP, FSDP2), then read from the safetensors files only
the bytes each rank keeps.

``from_pretrained`` on every rank holds a whole copy of the model per rank (plus the memory
map of the files) before FSDP2 shards it: past a few billion parameters that is what runs a
node out of host memory. Here each rank allocates only its local shards (``to_empty``) and
fills them with positioned reads (``os.pread``) straight from the files: a tensor sharded on
dim 0 (FSDP2, column-parallel and vocabulary-parallel weights) is one contiguous byte range;
one sharded on another dim (row-parallel weights) reads the rows it needs and keeps its
columns, so the transient extra memory is at most one tensor's row range. No memory map is
used, so file pages are not counted against the process.

Non-persistent buffers (rotary ``inv_freq`` tables) are not in the files: they are recomputed
by the model's own ``_init_weights`` (what transformers does after its own meta-device load)
and checked to be finite. Tied weights (an output projection sharing the embedding) are loaded
once; a missing key that is not a tied alias is an error.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from train_recipes.run.safetensors_header import read_safetensors_header

__all__ = ["LoadStats", "build_on_meta", "load_sharded_safetensors", "safetensors_files"]

logger = logging.getLogger(__name__)

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(kw_only=True, slots=True, frozen=True)
class LoadStats:
    """What one rank read.

    Attributes:
        bytes_read: bytes read from the files by this rank.
        file_bytes: total tensor bytes in the checkpoint (one full copy).
        tensors: state-dict entries filled.
    """

    bytes_read: int
    file_bytes: int
    tensors: int


@dataclass(kw_only=True, slots=True, frozen=True)
class _Entry:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files (sharded through the index json, or one file).

    Raises:
        FileNotFoundError: the folder holds no safetensors weights.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{folder} has no model.safetensors or model.safetensors.index.json; the sharded load "
        "reads safetensors only: convert the weights or set model.sharded_load=false"
    )


def _read_headers(files: list[Path]) -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for path in files:
        header = read_safetensors_header(path)
        for name, meta in header.tensors.items():
            if meta["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
            entries[name] = _Entry(
                path=path,
                dtype=_DTYPES[meta["dtype"]],
                shape=tuple(meta["shape"]),
                offset=header.data_start + meta["data_offsets"][0],
            )
    return entries


def _rows_shape(entry: _Entry, start: int, stop: int) -> tuple[int, ...]:
    """The shape of rows [start, stop) of ``entry`` (a 0-d tensor stays 0-d)."""
    return (stop - start, *entry.shape[1:]) if entry.shape else ()


def _read_rows(
    fd: int, entry: _Entry, start: int, stop: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows [start, stop) of dim 0 (the whole tensor for a 0-d one), one positioned read.

    Args:
        fd: the open file of ``entry``.
        entry: the tensor's header entry.
        start: first row.
        stop: one past the last row.
        out: a host tensor of the rows' shape and the entry's dtype to read into (a pinned
            staging buffer); a new one when None.

    Returns:
        [stop - start, *entry.shape[1:]] tensor of the entry's dtype, on the host.
    """
    row = 1
    for size in entry.shape[1:]:
        row *= size
    if out is None:
        out = torch.empty(_rows_shape(entry, start, stop), dtype=entry.dtype)
    if out.numel() == 0:
        return out
    raw: Any = out.reshape(-1).view(torch.uint8).numpy()  # bf16 has no numpy dtype: bytes
    view = memoryview(raw).cast("B")
    itemsize = out.element_size()
    position, done = entry.offset + start * row * itemsize, 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], position + done)
        if got <= 0:
            raise OSError(f"short read of {entry.path} at byte {position + done}")
        done += got
    return out


class _PinnedStaging:
    """Two pinned host buffers that reads headed for an accelerator alternate between.

    A blocking copy from pageable host memory with a dtype change converts on the host (a
    second host copy at the wider dtype) and transfers that at pageable speed; a fresh host
    tensor per read also pays its page faults. Here each block is read into a reused pinned
    buffer, sent to the device in the file's dtype without blocking, and cast there, while the
    next block is read into the other buffer. An event per buffer says when its transfer is
    done and it may be overwritten. Host memory: two of the largest block read.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """A host tensor of ``shape``/``dtype`` in the next free buffer, and that buffer's slot."""
        slot, self._turn = self._turn, 1 - self._turn
        done = self._done[slot]
        if done is not None:
            done.synchronize()  # its previous transfer has finished reading it
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[slot] = torch.empty(
                max(nbytes, 1), dtype=torch.uint8, pin_memory=True
            )
        return slot, buffer[:nbytes].view(dtype).view(shape)

    def copy(self, slot: int, local: torch.Tensor, block: torch.Tensor) -> None:
        """``local.copy_(block)``: the transfer in ``block``'s dtype, the cast on the device."""
        on_device = block.to(self._device, non_blocking=True)
        local.copy_(on_device)
        done = torch.cuda.Event()
        done.record()
        self._done[slot] = done


def _local_slice(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's local tensor and its index into the global tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, n) for n in tensor.shape)
    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(
            f"local shard {tuple(local.shape)} differs from the placement's {tuple(shape)} "
            f"({tensor.placements}); this layout is not supported by the sharded load"
        )
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _checkpoint_name(name: str, entries: dict[str, _Entry]) -> str | None:
    """The file's name for state-dict entry ``name``.

    Either ``name`` itself, or (transformers saves some composite models, e.g. Qwen2.5-VL, under
    their legacy names: ``model.language_model.X`` as ``model.X``, ``model.visual.X`` as
    ``visual.X``) the one name found with a single wrapper component dropped.
    """
    if name in entries:
        return name
    parts = name.split(".")
    found = {
        candidate
        for i in range(len(parts) - 1)
        if (candidate := ".".join(parts[:i] + parts[i + 1 :])) in entries
    }
    return found.pop() if len(found) == 1 else None


@torch.no_grad()
def _recompute_buffers(model: nn.Module) -> None:
    """Refill non-persistent buffers (not in checkpoints) with the model's own initialiser."""
    init = getattr(model, "_init_weights", None)
    for module_name, module in model.named_modules():
        names = [
            n for n in getattr(module, "_non_persistent_buffers_set", ()) if n in module._buffers
        ]
        if not names:
            continue
        for name in names:
            buffer = module._buffers[name]
            if buffer is not None and buffer.is_floating_point():
                buffer.fill_(float("nan"))
        if init is not None:
            init(module)
        for name in names:
            buffer = module._buffers[name]
            if buffer is not None and buffer.is_floating_point() and not buffer.isfinite().all():
                raise RuntimeError(
                    f"non-persistent buffer {module_name}.{name} ({type(module).__name__}) is "
                    "not recomputed by the model's _init_weights after a meta-device build; "
                    "set model.sharded_load=false to load with from_pretrained"
                )


def build_on_meta(
    folder: str | Path, *, dtype: torch.dtype, attn_implementation: str, image_text: bool
) -> nn.Module:
    """The model class of ``folder``'s config.json with every tensor on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    hf_config = AutoConfig.from_pretrained(folder)
    auto: Any = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    with torch.device("meta"):
        model: nn.Module = auto.from_config(
            hf_config, dtype=dtype, attn_implementation=attn_implementation
        )
    if (Path(folder) / "generation_config.json").is_file():
        # from_config starts from defaults; keep the folder's own (end-of-turn ids, ...), as
        # from_pretrained does, so that the export carries it on.
        from transformers import GenerationConfig

        generation: Any = model
        generation.generation_config = GenerationConfig.from_pretrained(folder)
    return model


@torch.no_grad()
def load_sharded_safetensors(
    model: nn.Module, folder: str | Path, *, device: torch.device
) -> LoadStats:
    """Materialise a meta-device model (plain, TP and/or FSDP2) on ``device`` from ``folder``.

    Each rank's shards are filled from the safetensors files in ``folder``; not collective.

    The checkpoint's tensor names must be the model's state-dict names, or those names with one
    wrapper component dropped (transformers' legacy layout of composite models such as
    Qwen2.5-VL, which ``save_pretrained`` still writes); values are cast to each
    parameter's dtype as ``from_pretrained`` does, so both give the same bits.

    Raises:
        KeyError: a state-dict entry absent from the files that is not a tied alias.
        ValueError: a shape mismatch between the files and the model.
    """
    # to_empty makes a new Parameter per module when leaving the meta device, which would
    # untie shared weights (a tied output projection): note the sharing and restore it.
    sharing: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                sharing.setdefault(id(param), []).append((module, attr))
    model.to_empty(device=device)
    for places in sharing.values():
        owner, attr = places[0]
        for module, other in places[1:]:
            if module._parameters[other] is not owner._parameters[attr]:
                module._parameters[other] = owner._parameters[attr]
    entries = _read_headers(safetensors_files(folder))
    file_bytes = sum(e.dtype.itemsize * (torch.Size(e.shape).numel()) for e in entries.values())
    state = model.state_dict(keep_vars=True)
    loaded: dict[int, str] = {}
    bytes_read = 0
    fds: dict[Path, int] = {}
    staging = _PinnedStaging(torch.device(device)) if torch.device(device).type == "cuda" else None
    try:
        for name, tensor in state.items():
            file_name = _checkpoint_name(name, entries)
            entry = None if file_name is None else entries[file_name]
            if entry is None:
                alias = loaded.get(id(tensor))
                if alias is not None:
                    continue  # tied to an entry already loaded
                raise KeyError(
                    f"{name} is not in the checkpoint {folder}; the sharded load needs the "
                    "model's own parameter names (a folder saved by this transformers "
                    "version); set model.sharded_load=false to load with from_pretrained"
                )
            if tuple(entry.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {entry.shape} != model shape {tuple(tensor.shape)}"
                )
            local, index = _local_slice(tensor)
            rows = index[0] if index else slice(0, 1)
            fd = fds.get(entry.path)
            if fd is None:
                fd = fds[entry.path] = os.open(entry.path, os.O_RDONLY)
            shape = _rows_shape(entry, rows.start, rows.stop)
            slot, out = (None, None) if staging is None else staging.buffer(shape, entry.dtype)
            block = _read_rows(fd, entry, rows.start, rows.stop, out=out)
            bytes_read += block.numel() * block.element_size()
            block = block[(slice(None), *index[1:])] if index else block
            if staging is None or slot is None:
                local.copy_(block)
            else:
                staging.copy(slot, local, block)
            loaded[id(tensor)] = name
    finally:
        for fd in fds.values():
            os.close(fd)
        if staging is not None:
            torch.cuda.synchronize(device)  # the pinned buffers outlive no transfer
    _recompute_buffers(model)
    logger.info(
        "sharded load: %d tensors, %.1f MB read of %.1f MB",
        len(loaded),
        bytes_read / 1e6,
        file_bytes / 1e6,
    )
    return LoadStats(bytes_read=bytes_read, file_bytes=file_bytes, tensors=len(loaded))
