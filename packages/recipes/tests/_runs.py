"""One typed builder for the tiny ``train-recipes sft`` runs of the recipes tests.

A test names what it changes (``TinyRun(data=..., out=..., steps=4, cp=2)``) and the builder
renders the overrides once: for a spawned rank (:meth:`TinyRun.overrides`) or for the CLI
(:meth:`TinyRun.cli_args`). Unset fields keep the config's default; the fixed part is a quiet
CPU run (every step logged, no checkpoint, held-out evaluation or TensorBoard), which the
tests of those features turn on through their own fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from train_recipes.data.demo import DemoSplit

__all__ = ["TinyRun", "assert_same_weights", "exported_weights"]

# field -> the override key it renders (the quiet CPU part first, then the run's shape).
_KEYS = {
    "steps": "train.steps",
    "log_every": "train.log_every",
    "checkpoint_every": "train.checkpoint_every",
    "keep_checkpoints": "train.keep_checkpoints",
    "eval_samples": "train.eval_samples",
    "tensorboard": "train.tensorboard",
    "device": "train.device",
    "export": "train.export",
    "accumulation": "train.gradient_accumulation_steps",
    "micro_batch_size": "data.micro_batch_size",
    "logical_shards": "data.num_logical_shards",
    "shuffle": "data.shuffle",
    "lr": "optim.lr",
    "warmup_steps": "optim.warmup_steps",
    "model_path": "model.path",
    "hidden_size": "model.tiny.hidden_size",
    "dtype": "model.dtype",
    "data_parallel": "parallel.data_parallel",
    "cp": "parallel.cp",
    "tp": "parallel.tp",
    "ep": "parallel.ep",
}


@dataclass(kw_only=True, slots=True, frozen=True)
class TinyRun:
    """A CPU run of ``train-recipes sft`` on a demo split; None keeps the config's default.

    Attributes:
        data: the demo split (its energon folder is ``data.path``, its eval chats
            ``data.eval_path``).
        out: the run folder (``train.output_dir``).
        accumulation: ``train.gradient_accumulation_steps``.
        logical_shards: ``data.num_logical_shards``.
        hidden_size: ``model.tiny.hidden_size``.
        lr: ``optim.lr``.
        extra: further ``key=value`` overrides, after the fields; a key a field renders is
            refused (set the field).
        The other fields are the ``train.``, ``data.``, ``optim.``, ``model.`` and
        ``parallel.`` keys of the same name (:data:`_KEYS`).
    """

    data: DemoSplit
    out: Path
    steps: int | None = None
    log_every: int | None = 1
    checkpoint_every: int | None = 0
    keep_checkpoints: int | None = None
    eval_samples: int | None = 0
    tensorboard: bool | None = False
    device: str | None = "cpu"
    export: bool | None = None
    accumulation: int | None = None
    micro_batch_size: int | None = None
    logical_shards: int | None = None
    shuffle: bool | None = None
    lr: float | None = None
    warmup_steps: int | None = None
    model_path: Path | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    data_parallel: str | None = None
    cp: int | None = None
    tp: int | None = None
    ep: int | None = None
    extra: tuple[str, ...] = ()

    def but(self, *extra: str, **changes: object) -> TinyRun:
        """This run with ``changes`` to its fields and ``extra`` overrides appended."""
        run = replace(self, **changes)  # type: ignore[arg-type]
        return replace(run, extra=(*run.extra, *extra)) if extra else run

    def overrides(self) -> list[str]:
        """The run as ``key=value`` overrides (``load_config``'s and a spawned rank's form)."""
        return [f"train.output_dir={self.out}", *self._sets()]

    def cli_args(self, *, nproc: int = 1, flags: Sequence[str] = ()) -> list[str]:
        """The arguments of ``train-recipes sft`` on ``nproc`` ranks: ``flags``, then one
        ``--set`` per override."""
        args = ["sft", "--nproc-per-node", str(nproc), "--output-dir", str(self.out), *flags]
        for item in self._sets():
            args += ["--set", item]
        return args

    def _sets(self) -> list[str]:
        rendered = {*_KEYS.values(), "train.output_dir"}
        clashes = [item for item in self.extra if item.split("=", 1)[0] in rendered]
        if clashes:
            raise ValueError(f"TinyRun.extra sets {clashes}, which fields render; set the fields")
        sets = [f"data.path={self.data.energon_dir}", f"data.eval_path={self.data.eval_jsonl}"]
        for item in fields(self):
            key = _KEYS.get(item.name)
            value = getattr(self, item.name)
            if key is None or value is None:
                continue
            sets.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
        return [*sets, *self.extra]


def exported_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a run's Hugging Face export (its ``model.safetensors``)."""
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> dict[str, torch.Tensor]:
    """The exports ``a`` and ``b`` hold the same names and bitwise equal tensors; returns
    ``a``'s."""
    wa, wb = exported_weights(a), exported_weights(b)
    assert wa.keys() == wb.keys(), sorted(wa.keys() ^ wb.keys())
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    return wa
