"""A README's Python examples, run as the one script they form (``python`` or ``torchrun``).

Every ```` ```python ```` block of a README says in its fence's info string what it is:

- ```` ```python run ````: part of the README's example. Its ``run`` blocks, in order, are one
  script (a later block uses what an earlier one built), run on CPU by the package's tests.
  ``run nproc=2`` on any of them runs the script as ``torchrun --standalone --nproc-per-node 2``
  would (2 processes, ``env://`` rendezvous), else in one process.
- ```` ```python fragment ````: a piece of a larger program (a Megatron model, a GPU-only
  kernel) that is not run; the prose around it says what it needs.

An unmarked block is an error (:func:`unmarked_blocks`): a new example is run or says why not.
The script keeps each block at its README line (blank lines between), so a traceback's line
numbers are the README's.

A README's API table says what the package exports; :func:`api_names` reads it and
:func:`unimportable_api_names` checks it against the code. The convention:

- An API table is a Markdown table (outside code fences) under a heading with the word ``API``
  (``## API``), before the next heading. Only the first column of its body rows names things.
- A name is a backticked span that starts with a dotted Python name: ```Engine(model, ...)```,
  ```step() -> StepResult```, ```cp_sharder.layouts```. The name ends at ``(``, ``[`` or a
  space; a span that is something else (```energon-sft convert```, a CLI command) names
  nothing. ```mod.{a,b}``` stands for ```mod.a``` and ```mod.b```.
- A name is looked up in the package (```Engine``` is ``train_engine.Engine``), or, when it
  starts with the package's own module name, from there (```cp_sharder.attention.varlen```).
- ```.name``` is an attribute (a method, a property) of the last row above it in the same table
  whose first name does not start with a dot: methods follow their class.
- ```module`:`` (a span followed by a colon) makes the cell's later names that module's:
  ```energon_sft.convert`: `convert_files`, `held_out_row```.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ApiName",
    "CodeBlock",
    "api_names",
    "example_script",
    "python_blocks",
    "run_readme_examples",
    "unimportable_api_names",
    "unlisted_exports",
    "unmarked_blocks",
]

_FENCE = "```"


@dataclass(kw_only=True, slots=True, frozen=True)
class CodeBlock:
    """One ```` ```python ```` block.

    Attributes:
        line: the README line of its first code line (1-based).
        words: the info string's words after ``python`` (``("run", "nproc=2")``).
        code: the code, dedented as far as its fence is indented (inside a list item).
    """

    line: int
    words: tuple[str, ...]
    code: str

    @property
    def runs(self) -> bool:
        """Part of the README's example script."""
        return "run" in self.words

    @property
    def nproc(self) -> int:
        """Processes it asks for (``nproc=N``; 1 without)."""
        for word in self.words:
            if word.startswith("nproc="):
                return int(word.removeprefix("nproc="))
        return 1


def python_blocks(readme: Path) -> list[CodeBlock]:
    """Every fenced block whose info string starts with ``python``, in order."""
    lines = readme.read_text(encoding="utf-8").splitlines()
    blocks: list[CodeBlock] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].lstrip()
        if not stripped.startswith(_FENCE):
            i += 1
            continue
        indent = len(lines[i]) - len(stripped)
        info = stripped[len(_FENCE) :].split()
        end = i + 1
        while end < len(lines) and lines[end].strip() != _FENCE:
            end += 1
        if info and info[0] == "python":
            body = [
                line[indent:] if line[:indent].isspace() else line for line in lines[i + 1 : end]
            ]
            code = textwrap.dedent("\n".join(body))
            blocks.append(CodeBlock(line=i + 2, words=tuple(info[1:]), code=code))
        i = end + 1
    return blocks


def unmarked_blocks(readme: Path) -> list[str]:
    """``README.md:LINE`` of each Python block marked neither ``run`` nor ``fragment``."""
    return [
        f"{readme}:{block.line - 1}"
        for block in python_blocks(readme)
        if not (block.runs or "fragment" in block.words)
    ]


def example_script(readme: Path) -> tuple[str, int]:
    """The README's ``run`` blocks as one script, each at its README line; its process count.

    Raises:
        ValueError: the README has no ``run`` block.
    """
    runs = [block for block in python_blocks(readme) if block.runs]
    if not runs:
        raise ValueError(f"{readme} has no ```python run block")
    out: list[str] = []
    for block in runs:
        out += [""] * (block.line - 1 - len(out))
        out += block.code.splitlines()
    return "\n".join(out) + "\n", max(block.nproc for block in runs)


def run_readme_examples(readme: Path, workdir: Path, *, timeout_s: float = 600.0) -> str:
    """Run the README's example script in ``workdir`` (on CPU); its output, rank 0's first.

    ``nproc=N`` starts N processes with the environment ``torchrun --standalone`` gives its ranks
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``: an ``env://`` rendezvous on this host), without torchrun's own process,
    which imports torch before any rank starts (3-4 s of CPU per README on a 2-core host).

    Raises:
        AssertionError: a process failed or ran past ``timeout_s`` (the others are killed); the
            message holds the tail of its output (line numbers in tracebacks are the README's).
    """
    source, nproc = example_script(readme)
    script = workdir / f"{readme.parent.name}_README.py"
    script.write_text(source, encoding="utf-8")
    # One thread per rank: the ranks share the host's cores (torchrun sets the same).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if nproc > 1:
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        env |= {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    logs = [workdir / f"{script.stem}.rank{rank}.log" for rank in range(nproc)]
    procs = []
    for rank, log in enumerate(logs):
        rank_env = env | ({"RANK": str(rank), "LOCAL_RANK": str(rank)} if nproc > 1 else {})
        with log.open("w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    cwd=workdir,
                    env=rank_env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a rank's own children go with it
                )
            )
    failure = _wait_all(procs, timeout_s)
    if failure is not None:
        rank, what = failure
        where = f" (rank {rank} of {nproc})" if nproc > 1 else ""
        raise AssertionError(
            f"{readme}'s examples {what}{where}; the line numbers of {script.name} are the "
            f"README's:\n{logs[rank].read_text()[-6000:]}"
        )
    return "".join(log.read_text() for log in logs)


@dataclass(kw_only=True, slots=True, frozen=True)
class ApiName:
    """One name an API table lists.

    Attributes:
        line: its README line (1-based).
        text: the name as the README writes it (``.shard``, ``energon_sft.convert``).
        path: the dotted path it resolves to: a module, then attributes
            (``cp_sharder.ContextParallelSharder.shard``).
    """

    line: int
    text: str
    path: str


# A dotted name, optionally ending in a {a,b} group; then the end of the span, "(", "[" or " ".
_NAME = re.compile(r"^(\.?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\.\{[\w, ]+\})?)(?:$|[(\[ ])")
_SPAN = re.compile(r"`([^`]+)`(:?)")
_HEADING = re.compile(r"^#{1,6}\s")


def api_names(readme: Path, package: str) -> list[ApiName]:
    """The names in the README's API tables (the convention is in the module docstring).

    Args:
        readme: the README.
        package: the package's top module (``train_engine``): bare names are its attributes.

    Raises:
        ValueError: the README has no API table with a name in it (a README that lists its
            API must list it where this check reads it).
    """
    names: list[ApiName] = []
    in_api = in_fence = False
    in_table = False
    parent = package  # what a ".name" is an attribute of
    lines = readme.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if stripped.startswith(_FENCE):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if _HEADING.match(stripped):
            in_api = re.search(r"\bAPI\b", stripped) is not None
            continue
        if not (in_api and stripped.startswith("|")):
            in_table = False
            continue
        if re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", stripped):
            in_table, parent = True, package  # the header row is above; body rows follow
            continue
        if not in_table:
            continue
        first_cell = re.split(r"(?<!\\)\|", stripped)[1]
        module = package
        for span, colon in _SPAN.findall(first_cell):
            match = _NAME.match(span.strip())
            if match is None:
                continue
            for text in _expand(match.group(1)):
                if text.startswith("."):
                    path = parent + text
                elif text == package or text.startswith(package + "."):
                    path = text
                else:
                    path = f"{module}.{text}"
                names.append(ApiName(line=number, text=text, path=path))
                if colon:
                    module = path
                elif not text.startswith("."):
                    parent = path
    if not names:
        raise ValueError(
            f"{readme} has no API table with a name in it: list the public names in the first "
            "column of a table under an '## API' heading, in backticks"
        )
    return names


def unimportable_api_names(readme: Path, package: str) -> list[str]:
    """``README.md:LINE `name`: why`` for each API-table name the code does not have.

    A name resolves when its path imports as a module or as attributes of the longest prefix
    that imports (``cp_sharder.ContextParallelSharder.shard``). Importing runs the package's
    modules, so optional dependencies a module imports at its top must be installed.
    """
    missing = []
    for name in api_names(readme, package):
        why = _unresolved(name.path)
        if why is not None:
            missing.append(f"{readme.name}:{name.line} `{name.text}`: {why}")
    return missing


def unlisted_exports(readme: Path, package: str) -> list[str]:
    """The names of the package's ``__all__`` that its README's API tables do not list.

    A name counts as listed when an API-table name is it or an attribute of it
    (``ContextParallelSharder`` is listed by ```.shard``` as well); ``__version__`` need not be.
    """
    module = importlib.import_module(package)
    listed = {name.path.split(".")[1] for name in api_names(readme, package) if "." in name.path}
    exported: list[str] = list(getattr(module, "__all__", ()))
    return sorted(name for name in exported if name not in listed and name != "__version__")


def _expand(text: str) -> list[str]:
    """``mod.{a,b}`` -> ``mod.a``, ``mod.b``; anything else as is."""
    head, brace, group = text.partition("{")
    if not brace:
        return [text]
    return [head + part.strip() for part in group.rstrip("}").split(",")]


def _unresolved(path: str) -> str | None:
    """Why ``path`` does not resolve (a module, then attributes), or None when it does."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        module_name = ".".join(parts[:end])
        try:
            obj: object = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name or module_name.startswith(f"{error.name}."):
                continue  # not a module: try the shorter prefix with attributes
            return f"importing {module_name} failed: {error}"
        except ImportError as error:
            return f"importing {module_name} failed: {error}"
        for depth, attribute in enumerate(parts[end:], start=end):
            if not hasattr(obj, attribute):
                return f"{'.'.join(parts[:depth])} has no attribute {attribute!r}"
            obj = getattr(obj, attribute)
        return None
    return f"no module {parts[0]}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> tuple[int, str] | None:
    """Wait for every process; at the first failure or the deadline, kill the others.

    A rank left waiting in a collective with a failed peer would otherwise never end.

    Returns:
        None when all exited 0, else (the failed or first unfinished process, what happened).
    """
    deadline = time.monotonic() + timeout_s
    failure: tuple[int, str] | None = None
    while failure is None and any(p.poll() is None for p in procs):
        for rank, proc in enumerate(procs):
            if proc.poll() not in (None, 0):
                failure = (rank, f"failed (exit {proc.returncode})")
                break
        else:
            if time.monotonic() > deadline:
                late = next(r for r, p in enumerate(procs) if p.poll() is None)
                failure = (late, f"ran past {timeout_s:.0f} s")
            time.sleep(0.1)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if failure is None:  # all ended: any non-zero status is the failure
        failure = next(
            ((r, f"failed (exit {p.returncode})") for r, p in enumerate(procs) if p.returncode),
            None,
        )
    return failure
