"""train_testing.readme_examples: blocks found where the README has them, run as one script."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from train_testing.readme_examples import (
    api_names,
    example_script,
    python_blocks,
    run_readme_examples,
    unimportable_api_names,
    unlisted_exports,
    unmarked_blocks,
)

README = """# pkg

```
pip install pkg
```

```python run
x = 1
```

- In a list item:

  ```python run nproc=2
  if x:
      y = x + 1
  ```

```python fragment
gpt_model(tokens)
```

```python
print("unmarked")
```
"""


def test_blocks_are_found_with_their_words_lines_and_indentation(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(README)
    blocks = python_blocks(readme)
    assert [(b.line, b.words, b.runs, b.nproc) for b in blocks] == [
        (8, ("run",), True, 1),
        (14, ("run", "nproc=2"), True, 2),
        (19, ("fragment",), False, 1),
        (23, (), False, 1),
    ]
    assert blocks[1].code == "if x:\n    y = x + 1"
    assert unmarked_blocks(readme) == [f"{readme}:22"]
    source, nproc = example_script(readme)
    assert nproc == 2
    lines = source.splitlines()  # each block at its README line, so tracebacks name those
    assert lines[7] == "x = 1" and lines[13:15] == ["if x:", "    y = x + 1"]
    assert "gpt_model" not in source and "unmarked" not in source


def test_a_failing_example_names_its_readme_line_and_a_passing_one_gives_its_output(
    tmp_path: Path,
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("Intro.\n\n```python run\nprint('hello')\nassert 1 + 1 == 3\n```\n")
    with pytest.raises(AssertionError, match=r"(?s)exit 1.*line 5, in <module>\n\s*assert 1 \+ 1"):
        run_readme_examples(readme, tmp_path)
    readme.write_text("```python run\nprint('hello')\n```\n")
    assert run_readme_examples(readme, tmp_path).strip() == "hello"
    readme.write_text("```python fragment\nprint('hello')\n```\n")
    with pytest.raises(ValueError, match="no ```python run block"):
        example_script(readme)


def test_ranks_get_torchruns_environment_and_a_failed_rank_ends_the_others(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(
        "```python run nproc=2\n"
        "import os, time\n"
        "rank = os.environ['RANK']\n"
        "print(rank, os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'])\n"
        "```\n"
    )
    first, second = run_readme_examples(readme, tmp_path).splitlines()
    assert first.split()[:3] == ["0", "0", "2"] and second.split()[:3] == ["1", "1", "2"]
    assert first.split()[3] == second.split()[3], "the ranks must share one rendezvous port"
    # Rank 0 waits as in a collective with the failed rank: it is killed, not awaited.
    readme.write_text(
        readme.read_text().replace(
            "```\n", "if rank == '0':\n    time.sleep(600)\nraise SystemExit(3)\n```\n"
        )
    )
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"failed \(exit 3\) \(rank 1 of 2\)"):
        run_readme_examples(readme, tmp_path, timeout_s=300)
    assert time.monotonic() - started < 60


API_README = """# json-like

## API

| Name | What |
|---|---|
| `JSONDecoder(*, strict=True)` | a class; its methods follow it |
| `.decode(s) -> object` | a method of the row above |
| `.no_such_method()` | missing |
| `dumps(obj) -> str`, `no_such_function` | two names in one cell |
| `json.decoder`: `JSONDecodeError`, `scanstring`; `json.scanner.{make_scanner,py_make_scanner}` | a module for the rest of the cell; a brace group |
| `json-tool --help` | not a Python name: nothing to check |

```
| `inside_a_fence` | not a table |
```

## Examples

| `not_api` | a table under another heading |
"""


def test_api_names_follow_the_convention(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(API_README)
    assert [(n.line, n.text, n.path) for n in api_names(readme, "json")] == [
        (7, "JSONDecoder", "json.JSONDecoder"),
        (8, ".decode", "json.JSONDecoder.decode"),
        (9, ".no_such_method", "json.JSONDecoder.no_such_method"),
        (10, "dumps", "json.dumps"),
        (10, "no_such_function", "json.no_such_function"),
        (11, "json.decoder", "json.decoder"),
        (11, "JSONDecodeError", "json.decoder.JSONDecodeError"),
        (11, "scanstring", "json.decoder.scanstring"),
        (11, "json.scanner.make_scanner", "json.scanner.make_scanner"),
        (11, "json.scanner.py_make_scanner", "json.scanner.py_make_scanner"),
    ]
    assert unimportable_api_names(readme, "json") == [
        "README.md:9 `.no_such_method`: json.JSONDecoder has no attribute 'no_such_method'",
        "README.md:10 `no_such_function`: json has no attribute 'no_such_function'",
    ]
    assert "JSONEncoder" in unlisted_exports(readme, "json")
    assert "dumps" not in unlisted_exports(readme, "json")
    readme.write_text("# pkg\n\n## Usage\n\n| `name` | what |\n|---|---|\n| `x` | y |\n")
    with pytest.raises(ValueError, match="no API table"):
        api_names(readme, "json")
