"""``train-recipes sft --controller ray`` on a local CPU Ray cluster (one start per module):
the same losses as the SPMD ranks at dp=2 and at cp=2, one loader per replica, the data plane,
a SIGKILLed actor reported in one line within a minute, and ``--resume`` continuing exactly."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from _controller_workers import metrics_losses, run_sft_plane_on_rank
from _recipes_workers import metric_rows
from conftest import unshuffled_cpu_run
from train_recipes.cli import main as cli
from train_recipes.config import SFTConfig, load_config, validate_sft
from train_recipes.controller import RayRun, import_ray, run_sft_on_ray
from train_recipes.data.demo import DemoSplit
from train_recipes.data.plane import DataPlane
from train_recipes.run.checkpoint_folder import checkpoint_dir, complete_checkpoints

STEPS = 20


def _common(split: DemoSplit, out: Path) -> list[str]:
    # A constant rate after the warm-up: the killed run's longer train.steps gives the same
    # rates, so its resume must reproduce the 20-step run.
    run = unshuffled_cpu_run(split, out, STEPS, checkpoint_every=10)
    return run.but("optim.schedule=constant", warmup_steps=5).overrides()


def _config(overrides: list[str], world_size: int) -> SFTConfig:
    config = load_config(SFTConfig, None, overrides)
    validate_sft(config, world_size=world_size)
    return config


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[ModuleType]:
    ray = import_ray()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_dp2(
    ray_cluster: ModuleType, demo_data: DemoSplit, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RayRun, dict[int, float]]:
    """The uninterrupted Ray run at dp=2, and its logged losses."""
    out = tmp_path_factory.mktemp("ray") / "dp2"
    run = run_sft_on_ray(_config(_common(demo_data, out), 2), world_size=2)
    return run, metrics_losses(out)


def _tensor(losses: dict[int, float]) -> torch.Tensor:
    assert sorted(losses) == list(range(1, STEPS + 1)), sorted(losses)
    return torch.tensor([losses[s] for s in sorted(losses)], dtype=torch.float64)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_losses_equal_spmd_at_dp2_and_cp2_with_one_loader_per_replica(
    ray_dp2: tuple[RayRun, dict[int, float]],
    rank_pool: Any,
    demo_data: DemoSplit,
    tmp_path: Path,
) -> None:
    spmd = rank_pool.run(
        2,
        run_sft_plane_on_rank,
        [*_common(demo_data, tmp_path / "spmd"), "parallel.cp=1"],
        timeout_s=300,
    )
    cp_out = tmp_path / "ray-cp2"
    # dp=1 x cp=2 with 2 micro-batches per step sees dp=2's global batches (2 logical shards).
    cp2 = run_sft_on_ray(
        _config(
            [*_common(demo_data, cp_out), "parallel.cp=2", "train.gradient_accumulation_steps=2"],
            2,
        ),
        world_size=2,
    )
    dp2, dp2_losses = ray_dp2
    reference = _tensor(spmd[0]["losses"])
    for name, losses in (("ray dp=2", dp2_losses), ("ray cp=2", metrics_losses(cp_out))):
        got = _tensor(losses)
        torch.testing.assert_close(
            got, reference, rtol=2e-4, atol=2e-5, msg=lambda m, n=name: f"{n} vs SPMD dp=2: {m}"
        )
    assert reference[-1] < reference[0], f"the loss did not go down: {reference.tolist()}"
    # The controller's cost is in the run's metrics: rank 0's time inside and between steps
    # (the first step follows setup, so it has no wait).
    rows = [r for r in metric_rows(cp_out) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["controller/step_ms"] > 0 for r in rows), rows[0]
    assert "controller/wait_ms" not in rows[0], rows[0]
    assert all(0 < r["controller/wait_ms"] < 60_000 for r in rows[1:]), rows[1]

    # One loader per replica: on dp=2 each rank is a replica; at cp=2 the cp peer built none.
    assert dp2.loaders_built == [1, 1] and cp2.loaders_built == [1, 0]
    peers = []
    for report in cp2.ranks:
        plane = DataPlane(dp_size=1)
        plane.load_state_dict(report["data_plane"])
        peers.append([plane.list_sample_ids(s) for s in plane.steps()])
    assert len(peers[0]) == STEPS and peers[0] == peers[1], "the cp ranks saw other samples"
    # Same global batches in all three jobs: the driver's plane, the SPMD ranks' planes.
    spmd_plane = DataPlane(dp_size=2)
    spmd_plane.load_state_dict([r["plane"] for r in spmd])
    for step in range(1, STEPS + 1):
        ids = sorted(dp2.data_plane.list_sample_ids(step))
        assert ids == sorted(cp2.data_plane.list_sample_ids(step)), step
        assert ids == sorted(spmd_plane.list_sample_ids(step)), step
    everything = [i for s in dp2.data_plane.steps() for i in dp2.data_plane.list_sample_ids(s)]
    assert len(everything) == STEPS * 16 == len(set(everything)), "a sample was repeated"


def _rank_actor_pids() -> list[int]:
    """PIDs of the live Ray workers running a RankActor (Ray titles them ``ray::RankActor``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if title.startswith(b"ray::RankActor"):
            pids.append(int(entry.name))
    return sorted(pids)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds actor PIDs in /proc")
def test_sigkilled_actor_is_one_line_within_a_minute_and_resume_continues_exactly(
    ray_dp2: tuple[RayRun, dict[int, float]],
    demo_data: DemoSplit,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "killed"
    argv = ["sft", "--controller", "ray", "--nproc-per-node", "2"]
    sets = [x for o in _common(demo_data, out) for x in ("--set", o)]
    code: list[int] = []
    # A long run, killed soon after its step-10 checkpoint (the same rates: constant schedule).
    job = threading.Thread(
        target=lambda: code.append(cli.main([*argv, *sets, "--set", "train.steps=400"]))
    )
    job.start()
    deadline = time.monotonic() + 400
    while checkpoint_dir(out, 10) not in complete_checkpoints(out):
        assert job.is_alive(), f"the run ended before the kill point: {capsys.readouterr()}"
        assert time.monotonic() < deadline, "step 10's checkpoint never came"
        time.sleep(0.05)
    victims = _rank_actor_pids()
    assert len(victims) == 2, victims
    os.kill(victims[-1], signal.SIGKILL)
    killed_at = time.monotonic()
    job.join(timeout=120)
    waited = time.monotonic() - killed_at
    assert not job.is_alive(), "the driver still waits on the killed actor"
    assert waited < 60, f"the driver took {waited:.0f} s to report the dead actor"
    assert code == [1]
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if line.startswith("train-recipes sft:")]
    assert len(lines) == 1 and "actor died" in lines[0] and "--resume" in lines[0], err
    assert "Traceback" not in "\n".join(lines)
    gone = time.monotonic() + 15
    while _rank_actor_pids() and time.monotonic() < gone:
        time.sleep(0.2)
    assert _rank_actor_pids() == [], "the other rank's actor was left running"

    # As if killed right after step 10: later checkpoints go (the kill came at any step).
    for path in complete_checkpoints(out):
        if path != checkpoint_dir(out, 10):
            shutil.rmtree(path)
    assert cli.main([*argv, *sets, "--resume"]) == 0
    resumed = metrics_losses(out)
    _, straight = ray_dp2
    assert {s: resumed[s] for s in range(11, STEPS + 1)} == {
        s: straight[s] for s in range(11, STEPS + 1)
    }, "the resumed losses differ from the uninterrupted run's"


def test_missing_ray_is_one_line_naming_the_extra_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from train_recipes.cli import preflight

    monkeypatch.setattr(preflight, "module_available", lambda name: name != "ray" and bool(name))
    assert cli.main(["sft", "--controller", "ray"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "'--controller'" in err and "train-recipes[ray]" in err


def test_ray_address_without_the_ray_controller_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["sft", "--ray-address", "auto"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'--ray-address'" in err and "--controller ray" in err, err


def test_without_an_address_the_job_starts_its_own_local_cluster() -> None:
    """A bare ``ray.init(num_cpus=...)`` joins the cluster named by ``RAY_ADDRESS`` or Ray's
    session file (a live ``ray start`` cluster, or the stale file of a killed one) and then
    refuses num_cpus; ``address="local"`` always starts a new one. Joining stays explicit."""
    from train_recipes.controller.ray_cluster import start_or_join

    calls: list[dict[str, Any]] = []

    class RecordingRay:
        def is_initialized(self) -> bool:
            return False

        def init(self, **kwargs: Any) -> None:
            calls.append(kwargs)

    assert start_or_join(RecordingRay(), address=None, world_size=3)
    assert calls[-1]["address"] == "local" and calls[-1]["num_cpus"] >= 3, calls
    assert start_or_join(RecordingRay(), address="auto", world_size=3)
    assert calls[-1]["address"] == "auto" and "num_cpus" not in calls[-1], calls


class _FrozenPeerGroup:
    """Stands in for the actors of a job whose rank 1 froze (SIGSTOP) at step 12.

    At ``setup`` each "rank" joins the driver's store at the address it was given, as the actors
    do (through the process group's prefixed view); rank 0's hang watchdog fires and writes its
    verdict there, then rank 0's actor exits: the first failure the driver sees is rank 0's.
    """

    def __init__(self, ray: Any, actor_class: type, *, placement: Any) -> None:
        self.watchdogs: list[Any] = []

    def call(self, method: str, *args: Any, ranks: Any = None, **kwargs: Any) -> list[Any]:
        from torch.distributed import PrefixStore, TCPStore

        if method == "endpoint":  # the rendezvous before the fix: a store rank 0 hosts
            self._own = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            return [("127.0.0.1", self._own.port)]
        if method != "setup":
            return [0] * len(ranks or (0, 1))

        from train_recipes.controller.ray_cluster import ActorFailure
        from train_recipes.loop.hang_watchdog import HangWatchdog

        host, port = args[2]
        stores = [
            PrefixStore("default_pg", TCPStore(host, port, is_master=False)) for _ in range(2)
        ]
        for rank in (1, 0):  # rank 1 beats once and freezes; rank 0 waits for it
            fired: list[str] = []
            dog = HangWatchdog(
                _root(stores[rank]),
                rank=rank,
                world_size=2,
                timeout_s=0.3,
                interval_s=0.05,
                on_hang=fired.append,
            )
            dog.enter_step(12)
            dog.start()
            self.watchdogs.append((dog, fired))
        self.watchdogs[0][0].stop()  # the SIGSTOP: no heartbeat from rank 1 from here on
        deadline = time.monotonic() + 30
        while not self.watchdogs[1][1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.watchdogs[1][1], "rank 0's watchdog did not fire"
        raise ActorFailure(
            "rank 0's actor died during setup (The actor died unexpectedly)", rank=0, died=True
        )

    def shutdown(self) -> None:
        for dog, _ in self.watchdogs:
            dog.stop()


def _root(store: Any) -> Any:
    """What ``hang_watchdog.default_store()`` gives a rank whose group store is ``store``."""
    from train_recipes.loop import hang_watchdog

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hang_watchdog.dist, "is_initialized", lambda: True)
        mp.setattr(hang_watchdog.dist.distributed_c10d, "_get_default_store", lambda: store)
        return hang_watchdog.default_store()


def test_the_driver_blames_the_rank_the_watchdog_named_not_the_first_actor_that_exited(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 43 item 9: with rank 1 stopped, rank 0's watchdog names rank 1 and ends rank 0's
    own actor; the driver's last line must name rank 1, from the verdict in the driver's store
    (rank 0's store would have ended with rank 0)."""
    from types import SimpleNamespace

    from train_recipes.controller import driver
    from train_recipes.controller.ray_cluster import ActorFailure, Placement

    fake_ray = SimpleNamespace(
        is_initialized=lambda: True,  # joined: the driver neither starts nor stops Ray
        util=SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1"),
    )
    monkeypatch.setattr(driver, "import_ray", lambda: fake_ray)
    monkeypatch.setattr(
        driver, "plan_placement", lambda *a, **k: Placement(world_size=2, use_gpus=False)
    )
    monkeypatch.setattr(driver, "RankGroup", _FrozenPeerGroup)
    config = _config([f"train.output_dir={tmp_path}", "train.device=cpu"], 2)
    assert driver.main_on_ray(config, world_size=2, resume=False, address=None) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train-recipes sft: rank 1 stopped responding"), err
    assert "rank 0's actor died" not in err[0] and "--resume" in err[0], err
    # No watchdog fired (a SIGKILLed or raising rank): the first failed actor is the line.
    died = ActorFailure("rank 1's actor died during train_step (...)", rank=1, died=True)
    assert driver.failure_line(died, None).startswith("rank 1's actor died during train_step")
