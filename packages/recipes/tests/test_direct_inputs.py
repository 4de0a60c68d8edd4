"""Direct inputs: chat files as data.path (converted once, reused), data.eval_split, eval files
in other formats, Hub ids as model.path (offline), and the --model/--data shorthand.

The conversions run in this process (no ranks); one CLI test trains on a chat file through a
Hub id for real and resumes on the reused conversion.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from _recipes_workers import metric_rows
from conftest import CLI, QUIET_CPU_RUN, cli_env
from train_recipes.cli import launch
from train_recipes.cli import main as cli
from train_recipes.cli.preflight import run_preflight
from train_recipes.config import ConfigError, SFTConfig, load_config
from train_recipes.data.direct_inputs import resolve_inputs, resolve_model_path
from train_recipes.data.input_cache import CACHE_ENV
from train_recipes.run.launch_env import RESOLVED_INPUTS

DATA = Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The conversion cache in this test's folder; no resolution inherited from another test."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(RESOLVED_INPUTS, raising=False)
    return tmp_path / "cache"


def _chat(a: int, b: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": f"{a}+{b}="},
            {"role": "assistant", "content": str(a + b)},
        ]
    }


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trained_rows(dataset: str | Path) -> list[dict[str, Any]]:
    """The rows a converted dataset's shards hold."""
    rows = []
    for shard in sorted(Path(dataset).glob("chat-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    data = tar.extractfile(member)
                    assert data is not None
                    rows.append(json.loads(data.read()))
    return rows


def _resolve(*overrides: str) -> SFTConfig:
    """The config of these overrides resolved as a launching process resolves it."""
    return resolve_inputs(load_config(SFTConfig, None, list(overrides)))


def _again(monkeypatch: pytest.MonkeyPatch, *overrides: str) -> SFTConfig:
    """The same, as the next launch would (without the previous launch's resolution)."""
    monkeypatch.delenv(RESOLVED_INPUTS, raising=False)
    return _resolve(*overrides)


@pytest.mark.timeout(300)
def test_jsonl_parquet_and_save_to_disk_folder_convert_once_and_are_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = _jsonl(tmp_path / "chats.jsonl", [_chat(a, 3) for a in range(12)])
    sharegpt = [
        {
            "conversations": [
                {"from": "human", "value": f"{a}+4="},
                {"from": "gpt", "value": str(a + 4)},
            ]
        }
        for a in range(12)
    ]
    parquet = tmp_path / "sharegpt.parquet"
    pq.write_table(pa.Table.from_pylist(sharegpt), parquet)
    # A DatasetDict written by datasets itself (data/make_dataset_dict.py): its train split.
    folder = DATA / "chats_dataset_dict"
    for given, rows in [(messages, 12), (parquet, 12), (folder, 6)]:
        config = _resolve(f"data.path={given}", "data.eval_split=0")
        dataset = Path(str(config.data.path))
        assert (dataset / ".nv-meta").is_dir(), given
        trained = _trained_rows(dataset)
        assert len(trained) == rows and all("messages" in r for r in trained), given
        assert config.data.eval_path is None
        err = capsys.readouterr().err
        assert f"data.path {given}: converting {rows} " in err and f"written {rows}" in err
        marker = dataset.parent / "source.json"
        stamp = marker.stat().st_mtime_ns
        again = _again(monkeypatch, f"data.path={given}", "data.eval_split=0")
        assert again.data.path == config.data.path
        assert capsys.readouterr().err.splitlines() == [
            f"data.path {given}: reusing converted dataset {dataset.parent}"
        ]
        assert marker.stat().st_mtime_ns == stamp, "converted again"
    assert _trained_rows(_resolve(f"data.path={parquet}", "data.eval_split=0").data.path)[0] == {
        "messages": [{"role": "user", "content": "0+4="}, {"role": "assistant", "content": "4"}]
    }
    # Another setting is another conversion; edited contents are another conversion.
    assert _again(monkeypatch, f"data.path={messages}", "data.eval_split=2").data.path != (
        _again(monkeypatch, f"data.path={messages}", "data.eval_split=0").data.path
    )
    before = _again(monkeypatch, f"data.path={messages}", "data.eval_split=0").data.path
    _jsonl(messages, [_chat(a, 5) for a in range(12)])
    assert _again(monkeypatch, f"data.path={messages}", "data.eval_split=0").data.path != before


@pytest.mark.timeout(300)
def test_eval_split_holds_rows_out_of_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    chats = [_chat(a, 7) for a in range(40)]
    path = _jsonl(tmp_path / "chats.jsonl", chats)
    for split, held in [("5", 5), ("0.25", 10), ("null", 2)]:  # null: 5% of 40 rows
        config = _again(monkeypatch, f"data.path={path}", f"data.eval_split={split}")
        assert config.data.eval_path is not None
        eval_rows = [
            json.loads(line) for line in Path(config.data.eval_path).read_text().splitlines()
        ]
        trained = _trained_rows(str(config.data.path))
        assert len(eval_rows) == held and len(trained) == 40 - held, split
        assert sorted(map(json.dumps, eval_rows + trained)) == sorted(map(json.dumps, chats))
        assert f"held out {held} rows (data.eval_split=" in capsys.readouterr().err
    # The rows held out depend on the file only, not on train.seed.
    first = _again(monkeypatch, f"data.path={path}", "data.eval_split=5", "train.seed=1")
    second = _again(monkeypatch, f"data.path={path}", "data.eval_split=5", "train.seed=2")
    assert first.data.eval_path == second.data.eval_path
    # A prepared run folder takes the converted paths; the held-out rows are its eval split.
    run_preflight(first, world_size=1, local_world_size=1)
    small = _jsonl(tmp_path / "small.jsonl", chats[:10])
    assert _again(monkeypatch, f"data.path={small}").data.eval_path is None  # < 20 rows
    prepared = Path(str(first.data.path))
    for overrides, needle in [
        ([f"data.path={path}", "data.eval_split=1.5"], "a fraction must lie in (0, 1)"),
        ([f"data.path={path}", "data.eval_split=40"], "holds out 40 of the 40 rows"),
        ([f"data.path={path}", "data.eval_split=3", f"data.eval_path={path}"], "remove one"),
        ([f"data.path={prepared}", "data.eval_split=3"], "is a prepared Energon dataset"),
    ]:
        monkeypatch.delenv(RESOLVED_INPUTS, raising=False)
        with pytest.raises(ConfigError) as info:
            _resolve(*overrides)
        assert info.value.key == "data.eval_split"
        assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.timeout(120)
def test_ranks_take_the_launchers_resolution_without_converting_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from train_recipes.data import direct_inputs

    chats = _jsonl(tmp_path / "c.jsonl", [_chat(1, 2)])
    config = load_config(SFTConfig, None, [f"data.path={chats}"])
    launcher = resolve_inputs(config)  # exports RESOLVED_INPUTS, which the ranks it starts inherit

    def resolve_again(*args: Any) -> None:
        raise AssertionError("a rank resolved the inputs again")

    monkeypatch.setattr(direct_inputs, "_resolve", resolve_again)
    assert resolve_inputs(config) == launcher  # a rank: the same command line
    other = load_config(SFTConfig, None, [f"data.path={chats}", "data.eval_split=0"])
    with pytest.raises(AssertionError, match="resolved the inputs again"):
        resolve_inputs(other)  # another config is resolved for itself


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("no_launch")
def test_eval_files_in_other_formats_are_mapped_to_chats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    alpaca = _jsonl(
        tmp_path / "alpaca.jsonl",
        [
            {"instruction": "1+2=", "output": "3"},
            {"instruction": "Add.", "input": "2+2", "output": "4"},
        ],
    )
    data = DATA / "chats_dataset_dict"
    args = ["config", "show", "--data", str(data), "--set", "train.device=cpu"]
    for eval_path, want in [
        (
            alpaca,
            [
                _chat(1, 2)["messages"],
                [{"role": "user", "content": "Add.\n\n2+2"}, {"role": "assistant", "content": "4"}],
            ],
        ),
        (data / "test", [_chat(10, 9)["messages"], _chat(11, 9)["messages"]]),
    ]:
        assert cli.main([*args, "--set", f"data.eval_path={eval_path}"]) == 0
        shown = capsys.readouterr()
        assert f"eval_path: {eval_path}" in shown.out  # the config as given
        converted = Path(shown.err.split(" as messages in ")[1].split()[0]) / "eval.jsonl"
        rows = [json.loads(line)["messages"] for line in converted.read_text().splitlines()]
        assert rows == want


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the CLI would start ranks."""

    def refuse(*args: Any, **kwargs: Any) -> int:
        raise AssertionError(f"ranks were launched: {args}")

    monkeypatch.setattr(launch, "relaunch", refuse)


def _hub_cache(root: Path, repo: str, files: dict[str, bytes]) -> Path:
    """A Hugging Face hub cache holding ``repo``'s main revision (the layout `hf download`
    leaves: models--org--name/refs/main and snapshots/<revision>/...)."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    return snapshot


def _tiny_model_files(folder: Path) -> dict[str, bytes]:
    """A saved tiny Llama with the demo's character tokenizer and chat template, as files."""
    from train_recipes.data.demo import build_char_tokenizer
    from train_testing.tiny_hf import save_tiny, tiny_model

    tokenizer = build_char_tokenizer()
    special = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }
    save_tiny(
        tiny_model("llama", vocab_size=len(tokenizer), **special), folder, tokenizer=tokenizer
    )
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.mark.timeout(120)
def test_hub_id_resolves_from_the_local_cache_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = _hub_cache(
        hub,
        "tiny-org/tiny-llama",
        {"config.json": b'{"model_type": "llama"}', "model.safetensors": b""},
    )
    assert resolve_model_path("tiny-org/tiny-llama") == str(snapshot)
    config = _resolve("model.path=tiny-org/tiny-llama")
    assert config.model.path == str(snapshot)
    local = tmp_path / "tiny-org" / "here"  # a local folder of that shape wins
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("tiny-org/here") == "tiny-org/here"
    _hub_cache(hub, "tiny-org/config-only", {"config.json": b"{}"})
    for repo, needle in [
        ("tiny-org/missing", "is not a local folder and not in the Hugging Face cache"),
        ("tiny-org/config-only", "lacks its config or weights"),
    ]:
        with pytest.raises(ConfigError) as info:
            resolve_model_path(repo)
        assert info.value.key == "model.path"
        assert needle in str(info.value) and f"`hf download {repo}`" in str(info.value)
        assert "\n" not in str(info.value)


def test_model_and_data_options_are_shorthands_for_the_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = cli.build_parser()
    args = parser.parse_args(
        ["sft", "--model", "org/name", "--data", "my data.jsonl", "--set", "a.b=1"]
    )
    assert launch.overrides(args) == ["a.b=1", 'model.path="org/name"', 'data.path="my data.jsonl"']
    config = load_config(SFTConfig, None, launch.overrides(args)[1:])
    assert (config.model.path, config.data.path) == ("org/name", "my data.jsonl")
    assert cli.main(["sft", "--data", "x.jsonl", "--set", "data.path=y.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "option '--data': and --set data.path=... are both" in err


@pytest.mark.timeout(900)
def test_sft_trains_on_a_chat_file_through_a_hub_id_and_resumes_on_the_same_conversion(
    tmp_path: Path, cache: Path
) -> None:
    hub = tmp_path / "hub"
    _hub_cache(hub, "tiny-org/tiny-llama", _tiny_model_files(tmp_path / "saved"))
    chats = _jsonl(
        tmp_path / "chats.jsonl", [_chat(a, b) for a in range(10, 20) for b in range(10, 14)]
    )
    env = {**cli_env(), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", CACHE_ENV: str(cache)}
    out = tmp_path / "run"
    args = [
        *CLI,
        "sft",
        "--model",
        "tiny-org/tiny-llama",
        "--data",
        str(chats),
        "--output-dir",
        str(out),
    ]
    sets = [*QUIET_CPU_RUN, "train.export=false", "data.micro_batch_size=4", "data.max_length=32"]

    def run(*extra: str, steps: int) -> subprocess.CompletedProcess[str]:
        flags = [arg for s in [*sets, f"train.steps={steps}"] for arg in ("--set", s)]
        done = subprocess.run(
            [*args, "--nproc-per-node", "1", *flags, *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
        return done

    first = run(steps=2)
    assert "data.path " + str(chats) + ": converting 40 messages rows into " in first.stderr
    assert "held out 2 rows (data.eval_split=auto" in first.stderr
    (entry,) = (cache / "datasets").glob("*/source.json")
    stamp = entry.stat().st_mtime_ns
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["data"]["path"] == str(entry.parent / "energon")
    assert saved["model"]["path"].startswith(
        str(hub / "models--tiny-org--tiny-llama" / "snapshots")
    )
    second = run("--resume", steps=3)
    assert f"reusing converted dataset {entry.parent}" in second.stderr
    assert "converting" not in second.stderr
    assert entry.stat().st_mtime_ns == stamp
    assert [row["step"] for row in metric_rows(out) if "loss" in row] == [1, 2, 3]
