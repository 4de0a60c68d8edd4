"""`build_sft_loader`: a resumable Energon loader for one data-parallel replica."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from energon_sft.batch import SFTBatch
from energon_sft.encoder import SFTTaskEncoder
from energon_sft.errors import OverlongSampleError, TooManyBadSamplesError
from energon_sft.shard_files import check_shard_files, diagnose_read_error
from energon_sft.state import (
    FORMAT_VERSION,
    StateMismatchError,
    dataset_identity,
    fingerprint,
    pack_state,
    unpack_state,
    validate_envelope,
)
from energon_sft.topology import logical_shards_for

logger = logging.getLogger(__name__)

__all__ = ["LoaderOptions", "SFTLoader", "build_sft_loader"]


@dataclass(kw_only=True, slots=True, frozen=True)
class LoaderOptions:
    """Operational Energon loader settings: they may change between save and resume.

    Each field is the `megatron.energon.get_savable_loader` keyword of the same name, passed as is.

    Attributes:
        prefetch_factor: batches each worker prepares ahead.
        checkpoint_every_sec: how often workers take an internal checkpoint; a resume replays
            at most this much work.
        checkpoint_every_min_n_samples: minimum samples between internal checkpoints; None
            lets Energon choose (2 x workers).
        watchdog_timeout_seconds: stall warning after this long without a batch; None disables.
        watchdog_initial_timeout_seconds: the same for the first batch (a large shuffle buffer
            fills completely at start and on resume); None uses `watchdog_timeout_seconds`.
        fail_on_timeout: abort the process on a watchdog timeout.
        gc_collect_every_n_steps: Python GC cadence inside workers.
    """

    prefetch_factor: int = 2
    checkpoint_every_sec: float = 60.0
    checkpoint_every_min_n_samples: int | None = None
    watchdog_timeout_seconds: float | None = 60.0
    watchdog_initial_timeout_seconds: float | None = None
    fail_on_timeout: bool = False
    gc_collect_every_n_steps: int = 10


class SFTLoader:
    """Batches of one dp replica, from its logical shards in turn, with an exact-resume state.

    Iterate it for `SFTBatch`es. Each batch records its `logical_shard` and `shard_step`.
    `state_dict()` may be called between batches; `load_state_dict()` only before iterating.
    """

    def __init__(
        self,
        *,
        dataset_path: Path,
        encoder: SFTTaskEncoder,
        shards: list[int],
        loaders: list[Any],
        stream: dict[str, Any],
        operational: dict[str, Any],
        virtual_epoch_length: int | None,
    ) -> None:
        self.dataset_path = dataset_path
        self.encoder = encoder
        self.shards = shards
        self._loaders = dict(zip(shards, loaders, strict=True))
        self._consumed = dict.fromkeys(shards, 0)
        self.stream = stream
        self.operational = operational
        self.virtual_epoch_length = virtual_epoch_length
        self._started = False
        self._closed = False
        self._iters: dict[int, Iterator[Any]] = {}
        self._worker_stats: dict[tuple[int, int], dict[str, int]] = {}

    def close(self) -> None:
        """Stop the worker processes now.

        Energon's workers keep a command thread alive, so a dropped loader's workers only go
        away when torch's shutdown times out (about 5 s per worker). This stops the command
        threads, then the workers. The loader cannot be iterated afterwards.
        """
        self._closed = True
        self._iters.clear()
        for loader in self._loaders.values():
            for queue in getattr(loader, "cmd_queues", None) or []:
                queue.put((None,))
            inner = getattr(loader, "_iterator", None)
            shutdown = getattr(inner, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    def __enter__(self) -> SFTLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        if self.virtual_epoch_length is None:
            raise TypeError("the loader is infinite; pass virtual_epoch_length to give it a length")
        return self.virtual_epoch_length * len(self.shards)

    def __iter__(self) -> Iterator[SFTBatch]:
        """One epoch: `virtual_epoch_length` batches per logical shard, or forever."""
        if self._closed:
            raise RuntimeError("the loader was closed; build a new one")
        self._started = True
        active = list(self.shards)
        self._iters = {}
        while active:
            # The shard that has given the fewest batches goes next (ties: lowest id), so the
            # order follows from the consumed counts alone and survives a resume.
            shard = min(active, key=lambda s: (self._consumed[s], s))
            try:
                # A shard's Energon iterator is made when the shard is first read: Energon
                # counts its workers as started from iter() on, though they start at the first
                # batch, and a state_dict() before then waited forever for their answer.
                if shard not in self._iters:
                    self._iters[shard] = iter(self._loaders[shard])
                batch = next(self._iters[shard])
            except StopIteration:
                active.remove(shard)
                continue
            except (TooManyBadSamplesError, OverlongSampleError):
                raise  # about samples, and they name them
            except Exception as err:
                # A damaged shard or index fails inside Energon (often in a worker process)
                # naming no file: look at the files, and name the one at fault if there is one.
                damaged = diagnose_read_error(self.dataset_path, err)
                if damaged is None:
                    raise
                raise damaged from None
            batch.logical_shard = shard
            batch.shard_step = self._consumed[shard]
            self._consumed[shard] += 1
            self._worker_stats[(shard, batch.worker_id)] = dict(batch.worker_stats)
            yield batch

    def data_stats(self) -> dict[str, int]:
        """Bad-sample counters summed over this loader's workers (skips, truncations, ...)."""
        total: Counter[str] = Counter()
        for stats in self._worker_stats.values():
            total.update(stats)
        return dict(total)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The envelope for this replica's logical shards (see `energon_sft.state`)."""
        shards = {}
        for s in self.shards:
            blob, sha = pack_state(self._loaders[s].save_state_rank())
            shards[str(s)] = {"consumed": self._consumed[s], "sha256": sha, "state": blob}
        return {
            "format_version": FORMAT_VERSION,
            "fingerprint": fingerprint(self.stream),
            "stream": self.stream,
            "operational": self.operational,
            "shards": shards,
        }

    def load_state_dict(
        self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]], *, group: Any = None
    ) -> None:
        """Restore from one envelope or from the envelopes of all old ranks (any dp size).

        Args:
            state: one envelope, or a list of envelopes (e.g. all ranks' of the saved job).
            group: optional process group; when given, the ranks agree before restoring: if
                any rank's state is refused, every rank raises (none is left waiting).

        Raises:
            RuntimeError: iteration has already started.
            StateMismatchError: a stream-defining field differs (with the per-field diff), the
                payload is corrupt, or a logical shard this replica owns is missing.
        """
        error: Exception | None = None
        try:
            restored = self._validated_states(state)
        except Exception as exc:  # every rank must reach the agreement below
            error = exc
        if group is not None:
            import torch
            import torch.distributed as dist

            flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group)
            if error is None and int(flag.item()) > 0:
                raise StateMismatchError(
                    f"{int(flag.item())} other rank(s) refused their loader state; see their error"
                )
        if error is not None:
            raise error
        for s in self.shards:
            self._loaders[s].restore_state_rank(restored[s][0])
            self._consumed[s] = restored[s][1]
        logger.info(
            "energon-sft: restored logical shards %s at steps %s",
            self.shards,
            [self._consumed[s] for s in self.shards],
        )

    def _validated_states(
        self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> dict[int, tuple[Any, int]]:
        if self._started:
            raise RuntimeError(
                "load_state_dict() after iteration started; restore into a fresh loader "
                "before the first iter()"
            )
        envelopes = [state] if isinstance(state, Mapping) else list(state)
        if not envelopes:
            raise StateMismatchError("no loader state given")
        merged: dict[int, Mapping[str, Any]] = {}
        for env in envelopes:
            validate_envelope(env, self.stream)
            for key, entry in env["shards"].items():
                shard = int(key)
                if shard in merged and merged[shard]["sha256"] != entry["sha256"]:
                    raise StateMismatchError(
                        f"two envelopes carry different states for logical shard {shard}"
                    )
                merged[shard] = entry
        missing = [s for s in self.shards if s not in merged]
        if missing:
            raise StateMismatchError(
                f"the given state lacks logical shards {missing} of this replica (it has "
                f"{sorted(merged)}); pass the envelopes of all ranks of the saved job"
            )
        # Only now, with everything validated, is any payload unpickled.
        return {
            s: (
                unpack_state(merged[s]["state"], merged[s]["sha256"], shard=s),
                int(merged[s]["consumed"]),
            )
            for s in self.shards
        }


def build_sft_loader(
    dataset_path: str | Path,
    *,
    encoder: SFTTaskEncoder,
    batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    num_workers: int,
    seed: int,
    shuffle: bool = True,
    virtual_epoch_length: int | None = None,
    num_logical_shards: int | None = None,
    shuffle_buffer_size: int = 100,
    max_samples_per_sequence: int = 100,
    split_part: str = "train",
    subflavors: Mapping[str, Any] | None = None,
    drop_last: bool = True,
    options: LoaderOptions | None = None,
) -> SFTLoader:
    """An Energon savable loader for one data-parallel replica.

    Args:
        dataset_path: a prepared Energon dataset (folder with `.nv-meta`) or metadataset YAML.
        encoder: the task encoder (its failure tolerance is >= 1; Energon's 0 is never used).
        batch_size: rows per batch (packs when the encoder packs).
        dp_rank: this replica.
        dp_world_size: the number of replicas.
        num_workers: loader worker processes per logical shard (0 = in process).
        seed: Energon `seed_offset`; defines the shuffle.
        shuffle: False gives a fixed, repeatable order (no shard-slice shuffle, one shard
            iterator, no sample buffer).
        virtual_epoch_length: batches per logical shard per `iter()` (None = infinite).
        num_logical_shards: fixed loader shards (default dp_world_size); a state resumes on
            any dp size that divides it.
        shuffle_buffer_size: samples in the shuffle buffer (0 = none); ignored when not shuffling.
        max_samples_per_sequence: samples read in a row from one shard slice when shuffling.
        split_part: dataset split.
        subflavors: routed to the cookers (e.g. {"sft_format": "sharegpt"}).
        drop_last: drop a final partial batch.
        options: operational settings (may change on resume).
    """
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
    from megatron.energon import __version__ as energon_version

    path = Path(dataset_path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be >= 0")
    if virtual_epoch_length is not None and virtual_epoch_length < 1:
        raise ValueError(
            f"virtual_epoch_length={virtual_epoch_length} must be >= 1 or None (infinite)"
        )
    check_shard_files(path)  # a missing or truncated shard index, named before any worker
    n_shards = dp_world_size if num_logical_shards is None else num_logical_shards
    shards = logical_shards_for(dp_rank, dp_world_size, n_shards)
    opts = options or LoaderOptions()
    buffer = shuffle_buffer_size if shuffle and shuffle_buffer_size > 0 else None
    stream = {
        "dataset": dataset_identity(path),
        "split_part": split_part,
        "subflavors": dict(subflavors) if subflavors else None,
        "energon_version": str(energon_version),
        "encoder": encoder.identity(),
        "batch_size": batch_size,
        "drop_last": drop_last,
        "seed": seed,
        "shuffle": shuffle,
        "shuffle_buffer_size": buffer,
        "max_samples_per_sequence": max_samples_per_sequence if shuffle else None,
        "virtual_epoch_length": virtual_epoch_length,
        "num_workers": num_workers,
        "num_logical_shards": n_shards,
    }
    operational = {
        "dataset_path": str(path),
        "dp_rank": dp_rank,
        "dp_world_size": dp_world_size,
        "failure_tolerance": encoder.failure_tolerance,
        **asdict(opts),
    }
    extra: dict[str, Any] = {}
    if subflavors:
        extra["subflavors"] = dict(subflavors)
    if not shuffle:
        # A fixed order needs both: no shard-slice shuffle and a single shard iterator
        # (several parallel iterators make Energon assert on the first next()).
        extra["parallel_shard_iters"] = 1
    # Energon's loader always asks torch to pin batches; without an accelerator torch only
    # warns that it cannot, once per loader and rank. Pin only where pinning exists.
    pin = torch.accelerator.is_available()
    loaders = []
    for shard in shards:
        wc = WorkerConfig(
            rank=shard,
            world_size=n_shards,
            num_workers=num_workers,
            seed_offset=seed,
            global_error_handler=encoder.error_handler,
        )
        ds = get_train_dataset(
            path,
            split_part=split_part,
            worker_config=wc,
            batch_size=batch_size,
            batch_drop_last=drop_last,
            packing_buffer_size=encoder.packing_buffer_size,
            shuffle_buffer_size=buffer,
            max_samples_per_sequence=max_samples_per_sequence if shuffle else None,
            virtual_epoch_length=virtual_epoch_length or 0,
            shuffle_over_epochs_multiplier=1 if shuffle else None,
            task_encoder=encoder,
            **extra,
        )
        # LoaderOptions' fields are get_savable_loader's keywords (test_loader checks the names).
        loader = get_savable_loader(ds, **asdict(opts))
        loader.pin_memory = pin
        loaders.append(loader)
    return SFTLoader(
        dataset_path=path,
        encoder=encoder,
        shards=shards,
        loaders=loaders,
        stream=stream,
        operational=operational,
        virtual_epoch_length=virtual_epoch_length,
    )
