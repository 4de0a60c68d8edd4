"""Developer sessions for the workspace. `uvx nox -l` lists them; plain `uvx nox` runs them all.

Per package (tag = the package folder, so `uvx nox -t cp-sharder` runs both):
  isolated-<pkg>  build the wheel without workspace sources, install it alone in a fresh environment,
                  import every module, then run all the package's tests against that installed
                  wheel. The default run (CI) tests each published package this way, once.
  tests-<pkg>     exact `uv sync --package <dist> --group test` (no other member present), then pytest
                  on the sources (editable, for development: `uvx nox -s tests-engine -- -m "not
                  slow"`). Only tests-testing is in the default run: that package has no wheel.
Both run the recipes suite in two pytest-xdist workers, after its `serial` tests alone (PARALLEL).
Whole workspace:
  lint            ruff check + ruff format --check
  typecheck       mypy on every member's sources (library packages, recipes, test helper)
  release-check   build every wheel, compare recipes' pins with the members' versions, install all
                  the wheels together in a fresh environment, and compare each installed package's
                  public API with the record of its version (packages/<pkg>/api/<version>.json)
                  and its CHANGELOG (train_testing.api_surface).
Extra arguments after `--` go to pytest, e.g. `uvx nox -s tests-engine -- -k clip -x`.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import nox

nox.needs_version = ">=2025.5.1"
nox.options.default_venv_backend = "uv"
nox.options.download_python = "never"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
PYTHON = "3.11"

# folder under packages/ -> (distribution, import name)
PACKAGES: dict[str, tuple[str, str]] = {
    "engine": ("train-engine", "train_engine"),
    "cp-sharder": ("cp-sharder", "cp_sharder"),
    "moe-dispatch": ("moe-dispatch", "moe_dispatch"),
    "vocab-parallel": ("vocab-parallel", "vocab_parallel"),
    "energon-sft": ("energon-sft", "energon_sft"),
    "recipes": ("train-recipes", "train_recipes"),
    "testing": ("train-testing", "train_testing"),
}
PUBLISHED = [folder for folder in PACKAGES if folder != "testing"]
TESTING_DIST = "train-testing"


def _exclude_newer() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["tool"]["uv"]["exclude-newer"])


def _uv_env(session: nox.Session) -> dict[str, str]:
    # `uv sync` targets the session's environment; `uv pip`/`uv build` get the same cut-off date the
    # workspace uses, so the isolated environments resolve like the workspace does.
    return {
        "UV_PROJECT_ENVIRONMENT": session.virtualenv.location,
        "UV_EXCLUDE_NEWER": _exclude_newer(),
    }


def _uv_sync(session: nox.Session, *selection: str) -> None:
    """`uv sync --exact` of ``selection`` (packages, groups) into the session's environment."""
    session.run_install("uv", "sync", "--exact", *selection, env=_uv_env(session), external=True)


def _cache_bytecode(session: nox.Session) -> None:
    """Let every process of the session write and reuse compiled bytecode, kept out of the tree.

    With PYTHONDONTWRITEBYTECODE set (as on some CI hosts), each of the many processes a suite
    starts (ranks, CLI runs, launchers) compiled torch and transformers from source again:
    `import torch` took 8 s instead of 3 on a 2-core host, and the cp-sharder suite ran 1.75x
    longer. The cache lives in the session's temporary folder, never beside the sources.
    """
    session.env["PYTHONDONTWRITEBYTECODE"] = ""
    session.env["PYTHONPYCACHEPREFIX"] = str(Path(session.create_tmp()) / "pycache")


# Suites that run in two pytest-xdist workers (whole files to a worker, so a module's fixtures
# are built once). recipes: on a 2-core host its 307 tests took 824 s in one process and 469 s
# in two: most of its multi-rank tests wait on process start-ups, rendezvous and collectives.
# cp-sharder ran slower in two (184 against 160 s): its tests keep both cores busy.
PARALLEL = {"recipes": 2}


def _pytest(session: nox.Session, folder: str, *extra: str) -> None:
    base = ["python", "-m", "pytest", f"packages/{folder}/tests", "-p", "no:cacheprovider"]
    workers = PARALLEL.get(folder)
    if workers is None or session.posargs:  # arguments given: one plain run, as asked
        session.run(*base, *extra, *session.posargs)
        return
    # Tests marked `serial` assert wall-clock bounds (a watchdog's reaction time): alone first,
    # then the rest in parallel.
    session.run(*base, *extra, "-m", "serial", success_codes=[0, 5])  # 5: none marked
    session.run(*base, *extra, "-m", "not serial", "-n", str(workers), "--dist", "loadfile")


def _test_group(folder: str) -> list[str]:
    """The member's `test` dependency group, without the workspace-only test helper."""
    with open(ROOT / "packages" / folder / "pyproject.toml", "rb") as f:
        groups = tomllib.load(f).get("dependency-groups", {})

    def expand(name: str) -> list[str]:
        out: list[str] = []
        for item in groups.get(name, []):
            out += expand(item["include-group"]) if isinstance(item, dict) else [item]
        return out

    return [req for req in expand("test") if not req.startswith(TESTING_DIST)]


def _build_wheels(session: nox.Session, *dists: str) -> dict[str, Path]:
    """Build wheels with `--no-sources` (as an index would see them); return {distribution: wheel}."""
    out_dir = Path(session.create_tmp()) / "wheels"
    for stale in out_dir.glob("*.whl"):
        stale.unlink()
    selections = [["--package", dist] for dist in dists] or [["--all-packages"]]
    for selection in selections:
        session.run(
            "uv",
            "build",
            "--wheel",
            "--no-sources",
            *selection,
            "--out-dir",
            str(out_dir),
            env=_uv_env(session),
            external=True,
        )
    wheels = {}
    for wheel in out_dir.glob("*.whl"):
        dist = wheel.name.split("-")[0].replace("_", "-")
        wheels[dist] = wheel
    return wheels


def _make_tests_session(folder: str) -> None:
    dist, _ = PACKAGES[folder]

    # The published packages' suites run in the default session list once, as isolated-<pkg>
    # (against the wheel users install); running them again on the sources would double CI time.
    @nox.session(
        name=f"tests-{folder}",
        python=PYTHON,
        tags=[folder, "tests"],
        default=folder not in PUBLISHED,
    )
    def tests(session: nox.Session) -> None:
        _cache_bytecode(session)
        _uv_sync(session, "--package", dist, "--group", "test")
        _pytest(session, folder)


def _make_isolated_session(folder: str) -> None:
    dist, import_name = PACKAGES[folder]

    @nox.session(name=f"isolated-{folder}", python=PYTHON, tags=[folder, "isolated"])
    def isolated(session: nox.Session) -> None:
        _cache_bytecode(session)
        # recipes pins the other members exactly; they are not on an index here, so their freshly
        # built wheels are handed to the installer as files alongside it.
        needed = [dist] + (
            [PACKAGES[f][0] for f in PUBLISHED if f != folder] if folder == "recipes" else []
        )
        wheels = _build_wheels(session, *needed)
        session.install(*(str(wheels[d]) for d in needed), env=_uv_env(session))
        session.run(
            "python",
            "-I",
            "-c",
            _IMPORT_EVERY_MODULE,
            import_name,
            str(ROOT / "packages"),
        )
        session.install(
            *_test_group(folder), str(ROOT / "packages" / "testing"), env=_uv_env(session)
        )
        _pytest(session, folder)


# Imports every module of an installed package and proves it is not the workspace's source tree.
_IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
from pathlib import Path
name, root = sys.argv[1], Path(sys.argv[2]).resolve()
pkg = importlib.import_module(name)
origin = Path(pkg.__file__).resolve()
if root in origin.parents:
    sys.exit(f"{name} was imported from the source tree ({origin}), not from the installed wheel")
mods = [name] + [m.name for m in pkgutil.walk_packages(pkg.__path__, name + ".")]
for mod in mods:
    importlib.import_module(mod)
print(f"imported {len(mods)} modules of {name} {pkg.__version__} from {origin.parent}")
"""

for _folder in PACKAGES:
    _make_tests_session(_folder)
for _folder in PUBLISHED:
    _make_isolated_session(_folder)


@nox.session(python=PYTHON, tags=["checks"])
def lint(session: nox.Session) -> None:
    _uv_sync(session, "--no-install-workspace", "--only-group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON, tags=["checks"])
def typecheck(session: nox.Session) -> None:
    _uv_sync(session, "--all-packages", "--group", "lint")
    sources = [f"packages/{folder}/src" for folder in PACKAGES]
    session.run("mypy", *sources)


@nox.session(name="release-check", python=PYTHON, tags=["checks"])
def release_check(session: nox.Session) -> None:
    _cache_bytecode(session)
    session.install(str(ROOT / "packages" / "testing"), env=_uv_env(session))
    session.run("python", "-m", "train_testing.release", str(ROOT))
    wheels = _build_wheels(session)
    published = [str(w) for dist, w in sorted(wheels.items()) if dist != TESTING_DIST]
    session.install(*published, env=_uv_env(session))
    session.run("train-recipes", "versions")
    # On the installed wheels, as users import them: a public name added, removed or changed
    # since the version's record needs a version bump, a CHANGELOG entry and a new record.
    session.run("python", "-m", "train_testing.api_surface", "check", "--root", str(ROOT))


if __name__ == "__main__":
    sys.exit("run the sessions with `uvx nox`")
