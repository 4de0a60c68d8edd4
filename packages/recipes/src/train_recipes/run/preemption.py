"""Preemption: SIGTERM and SIGINT stop a run at a step boundary, with a checkpoint of that step.

Schedulers stop jobs with SIGTERM (Slurm, Kubernetes), people with Ctrl-C (SIGINT). Either
signal, sent to the launching ``train-recipes sft`` or to the ranks themselves:

1. Each rank's :class:`SignalTrap` records the first signal; the step in flight runs on.
2. After every step the ranks agree whether to stop (:func:`stop_vote`: one all-reduce of the
   recorded signal number on a CPU group, so a GPU run adds no stream sync), so all of them
   stop after the same step, even when the signal reached them at different moments.
3. They save a checkpoint of that step, rank 0 prints one line and every rank exits with
   128 + the signal number (143 for SIGTERM, 130 for SIGINT: the shell's status of a process
   that the signal ended, so schedulers and scripts read the run as stopped, not finished).
4. A second signal, or ``train.signal_grace_s`` passing first, stops at once (the same exit
   status, one line, no traceback); ``train.checkpoint_on_signal=false`` makes the first
   signal do that.

torchrun's agent, left alone, raises ``SignalException`` in the launcher (a traceback) and
signals each rank's whole session, the data-loader workers included, which then die in the
middle of the checkpoint. So :class:`LauncherSignals` keeps the two signals away from the agent,
forwards the first one to each rank's process alone and owns the grace period: when it passes,
or at a second signal, it SIGKILLs the ranks and prints the line itself.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from train_recipes.run.launch_env import LAUNCHER_OWNS_SIGNALS

__all__ = [
    "STOP_SIGNALS",
    "LauncherSignals",
    "LoopStop",
    "RunStopped",
    "SignalTrap",
    "at_once_line",
    "hold_signals",
    "stop_exit_code",
    "stop_vote",
    "stopped_error",
]

#: The signals that stop a run (SIGHUP and SIGQUIT keep their usual meaning).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Set by the launcher for its ranks: it forwards the signals and owns the grace period.
# The launcher waits this much past the grace period before it SIGKILLs the ranks itself.
_LAUNCHER_MARGIN_S = 5.0


def stop_exit_code(signum: int) -> int:
    """The exit status of a run stopped by ``signum``: 128 + its number (143, 130)."""
    return 128 + int(signum)


def _name(signum: int) -> str:
    return signal.Signals(signum).name


def _last_checkpoint(output_dir: Path) -> str:
    from train_recipes.run.checkpoint_folder import complete_checkpoints

    try:
        newest = complete_checkpoints(output_dir)
    except OSError:
        newest = []
    return f"last checkpoint {newest[0].name}" if newest else "no checkpoint yet"


def at_once_line(signum: int, output_dir: Path, *, why: str) -> str:
    """The line of a run stopped at once (no checkpoint of the step in flight)."""
    return (
        f"stopped at once by {_name(signum)} ({why}); {_last_checkpoint(output_dir)}; "
        "continue with --resume"
    )


class RunStopped(Exception):
    """The ranks agreed to stop after a signal; raised on every rank after the checkpoint.

    Attributes:
        step: the last step trained.
        signum: the signal that stopped the run.
        checkpoint: the checkpoint a ``--resume`` continues from (None: none yet).
        exit_code: 128 + ``signum``.
    """

    def __init__(self, *, step: int, signum: int, checkpoint: str | None, saved: bool) -> None:
        self.step, self.signum, self.checkpoint = step, int(signum), checkpoint
        self.exit_code = stop_exit_code(signum)
        if saved:
            where = f"checkpoint {checkpoint}"
        elif checkpoint is not None:
            where = f"before training further; last checkpoint {checkpoint}"
        else:
            where = "before the first step; nothing trained"
        super().__init__(
            f"stopped at step {step} by {_name(signum)}; {where}; continue with --resume"
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class LoopStop:
    """A run its processes agreed to stop at a step boundary (:mod:`train_recipes.run.preemption`).

    Attributes:
        step: the last step trained.
        signum: the signal's number.
        saved: a checkpoint of ``step`` was written (False: stopped before this job's first
            step, whose newest checkpoint is the one it resumed from, if any).
    """

    step: int
    signum: int
    saved: bool


def stopped_error(stop: LoopStop, output_dir: str | Path) -> RunStopped:
    """The :class:`RunStopped` of the stop :func:`train_recipes.loop.drive.drive` reported."""
    from train_recipes.run.checkpoint_folder import checkpoint_dir, complete_checkpoints

    if stop.saved:
        name: str | None = checkpoint_dir(output_dir, stop.step).name
    else:
        newest = complete_checkpoints(output_dir)
        name = newest[0].name if newest else None
    return RunStopped(step=stop.step, signum=stop.signum, checkpoint=name, saved=stop.saved)


def _write_line(line: str) -> None:
    from tqdm.auto import tqdm

    # tqdm.write clears a progress bar on the same stream first, so the line stands alone.
    tqdm.write(f"train-recipes sft: {line}", file=sys.stderr)
    sys.stderr.flush()


class SignalTrap:
    """Records SIGTERM/SIGINT on this process; a second one (or the grace period) ends it.

    A context manager: the handlers are installed on entry (main thread only; elsewhere the
    trap stays empty) and the previous ones restored on exit.

    Args:
        output_dir: the run folder (the at-once line names its newest checkpoint).
        checkpoint: ``train.checkpoint_on_signal``; False: the first signal ends at once.
        grace_s: after the first signal, end at once when the stop has not completed within
            this many seconds; None: never (the launcher owns the grace period).
        say: print the at-once line (rank 0 without a launcher that prints it).
    """

    def __init__(
        self, *, output_dir: Path, checkpoint: bool, grace_s: float | None, say: bool
    ) -> None:
        self.output_dir = output_dir
        self.checkpoint = checkpoint
        self.grace_s = grace_s
        self.say = say
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> SignalTrap:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            if hasattr(signal, "pthread_sigmask"):  # what hold_signals() kept comes in now
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, previous in self._previous.items():
            # None: a handler not installed from Python (Ray's); the default stands in for it.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is not None:
            self._end_now(signum, f"a second {_name(signum)}")
        if not self.checkpoint:
            self._end_now(signum, "train.checkpoint_on_signal=false")
        self.received = signum
        if self.grace_s is not None:
            why = f"no checkpoint within train.signal_grace_s={self.grace_s:g}"
            self._timer = threading.Timer(self.grace_s, self._end_now, (signum, why))
            self._timer.daemon = True
            self._timer.start()

    def _end_now(self, signum: int, why: str) -> None:
        if self.say:
            _write_line(at_once_line(signum, self.output_dir, why=why))
        # Stops from the handler or the timer thread, whatever the main thread is inside of
        # (a collective, a checkpoint write: the checkpoint's .tmp is never read).
        os._exit(stop_exit_code(signum))


def hold_signals() -> None:
    """A rank under this CLI's launcher keeps SIGTERM/SIGINT pending until its trap exists.

    A signal forwarded while the rank starts (imports, config checks) then stops the run before
    its first step, instead of ending the rank with a default action or a KeyboardInterrupt.
    """
    if os.environ.get(LAUNCHER_OWNS_SIGNALS) == "1":
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def stop_vote(trap: SignalTrap) -> Callable[[int], int | None]:
    """The ranks' agreed stop decision, for :func:`train_recipes.loop.drive.drive` (collective).

    Every rank calls the returned function at the same step boundaries; it returns the same
    signal number on every rank (the largest any rank recorded: SIGTERM over SIGINT), or None
    to go on. The vote is a one-element all-reduce over every rank on a CPU (gloo) group, made
    here when the default group is not gloo (call this on every rank, at the same point).
    """
    import torch
    import torch.distributed as dist

    group: dist.ProcessGroup | None = None
    if dist.get_world_size() > 1 and dist.get_backend() != "gloo":
        made = dist.new_group(backend="gloo")
        assert isinstance(made, dist.ProcessGroup)  # every rank is a member
        group = made

    def vote(_step: int) -> int | None:
        flag = torch.tensor([trap.received or 0], dtype=torch.int32)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item()) or None

    return vote


@dataclass(kw_only=True, slots=True)
class _LauncherState:
    received: int | None = None
    at_once: str | None = None  # why the ranks were SIGKILLed


class LauncherSignals:
    """The launching process's SIGTERM/SIGINT, kept from torchrun's agent (see the module doc).

    Linux only (the ranks are found in ``/proc``); elsewhere :attr:`enabled` is False and the
    agent keeps its own handling.

    Args:
        output_dir: the run folder (the at-once line names its newest checkpoint).
        checkpoint: ``train.checkpoint_on_signal``; False: the first signal ends at once.
        grace_s: ``train.signal_grace_s``: SIGKILL the ranks this long (plus a few seconds)
            after the first signal.
    """

    def __init__(self, *, output_dir: Path, checkpoint: bool, grace_s: float) -> None:
        self.output_dir = output_dir
        self.checkpoint = checkpoint
        self.grace_s = grace_s
        self.enabled = (
            Path("/proc/self/stat").is_file()
            and threading.current_thread() is threading.main_thread()
        )
        self.state = _LauncherState()
        self._done = threading.Event()

    @property
    def agent_signals(self) -> str:
        """The agent's ``--signals-to-handle``: the others, or all four when not enabled."""
        return "SIGHUP,SIGQUIT" if self.enabled else "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

    @contextmanager
    def installed(self) -> Iterator[LauncherSignals]:
        """Install the handlers while the ranks run; restore the previous ones after."""
        if not self.enabled:
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        os.environ[LAUNCHER_OWNS_SIGNALS] = "1"
        try:
            yield self
        finally:
            self._done.set()
            os.environ.pop(LAUNCHER_OWNS_SIGNALS, None)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            logging.disable(logging.NOTSET)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        first = self.state.received is None
        self.state.received = self.state.received or signum
        # From now on the agent's reports (workers closing, "failed (exitcode: 143)") are not
        # news: the ranks or this process say what happened in one line.
        logging.disable(logging.ERROR)
        if not first:
            self.state.at_once = self.state.at_once or f"a second {_name(signum)}"
        elif not self.checkpoint:
            self.state.at_once = "train.checkpoint_on_signal=false"
        forwarded = self._pass_on(signum, set())
        if first:
            deadline = time.monotonic() + self.grace_s + _LAUNCHER_MARGIN_S
            threading.Thread(
                target=self._follow, args=(signum, deadline, forwarded), daemon=True
            ).start()

    def _pass_on(self, signum: int, forwarded: set[int]) -> set[int]:
        """Forward ``signum`` to the ranks not yet given it, or SIGKILL every rank."""
        for pid in _children():
            if self.state.at_once is not None:
                _signal(pid, signal.SIGKILL)
            elif pid not in forwarded and _listening(pid):
                _signal(pid, signum)  # the rank alone: its loader workers must live on
                forwarded.add(pid)
        return forwarded

    def _follow(self, signum: int, deadline: float, forwarded: set[int]) -> None:
        """Ranks the agent starts after the signal get it too; the grace period ends them."""
        while not self._done.wait(0.2):
            if time.monotonic() >= deadline and self.state.at_once is None:
                self.state.at_once = f"no checkpoint within train.signal_grace_s={self.grace_s:g}"
            self._pass_on(signum, forwarded)

    def outcome(self, exit_codes: list[int] | None) -> tuple[int, str | None]:
        """The launcher's exit status and line, from the ranks' exit codes (None: all 0)."""
        received = self.state.received
        if received is None:
            return (0, None) if exit_codes is None else (1, None)
        if self.state.at_once is not None:
            return stop_exit_code(received), at_once_line(
                received, self.output_dir, why=self.state.at_once
            )
        if exit_codes is None:
            return 0, None  # the signal came after the last step: the run finished
        stopped = [c for c in exit_codes if c in {stop_exit_code(s) for s in STOP_SIGNALS}]
        if stopped:
            return max(stopped), None  # rank 0 printed the line
        # The ranks ended otherwise, e.g. killed by the signal before their trap existed.
        return stop_exit_code(received), at_once_line(
            received, self.output_dir, why="the ranks were still starting"
        )


def _children() -> list[int]:
    """The PIDs of this process's children (the ranks torchrun's agent started)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            found.append(int(entry.name))
    return found


def _listening(pid: int) -> bool:
    """Whether rank ``pid`` holds or traps the stop signals yet.

    :func:`hold_signals`, then its :class:`SignalTrap`; until then a signal would end it
    (SIGTERM's default action, or a KeyboardInterrupt's traceback). Read from SIGTERM's bit in
    the blocked and caught masks: Python itself catches SIGINT from the start, SIGTERM never.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    bit = 1 << (signal.SIGTERM - 1)
    for line in status.splitlines():
        name, _, mask = line.partition(":")
        if name in ("SigBlk", "SigCgt") and int(mask, 16) & bit:
            return True
    return False


def _signal(pid: int, signum: int) -> None:
    with suppress(ProcessLookupError):  # the rank ended meanwhile
        os.kill(pid, signum)
