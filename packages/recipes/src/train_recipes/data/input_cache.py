"""The cache of converted inputs: where it lives, how entries are keyed, how one is published.

Layout under :func:`cache_root` (``$TRAIN_RECIPES_CACHE``, else ``$XDG_CACHE_HOME/train-recipes``,
else ``~/.cache/train-recipes``)::

    datasets/<key>/            one converted data.path (see train_recipes.data.direct_inputs)
    datasets/<key>.lock        held while <key> is converted
    evals/<key>.jsonl          one converted data.eval_path
    digests/<stat key>         the content digest of an input, by (path, size, mtime, inode)

The cache lies outside every run folder, so runs share it (``--overwrite`` never clears it).

Keys are content keys: the sha256 of the inputs' bytes (a folder: each file's relative name and
bytes) and of the conversion settings. Hashing reads an input once, at disk speed (about 1 s per
GB here); the digest is then remembered under the file's path, size, mtime and inode, so a later
launch only stats it, and a touched or rewritten file is hashed again. Two copies of one file
share an entry. Media files that rows name are not hashed (a VLM dataset's pictures can be
terabytes): after replacing pictures in place, delete the entry.

An entry is built in a temporary folder beside it and renamed into place (atomic on one file
system) while its lock file is held (``flock``): concurrent launches wait for one conversion
instead of repeating it, and a conversion killed half-way leaves a temporary folder that the next
one removes, never a half-written entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

__all__ = [
    "CACHE_ENV",
    "cache_root",
    "content_digest",
    "entry_key",
    "publish_entry",
]

#: Overrides where the cache lives (tests point it at a temporary folder).
CACHE_ENV = "TRAIN_RECIPES_CACHE"

_CHUNK = 1 << 20


def cache_root() -> Path:
    """The cache folder (not created here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "train-recipes"


def _files(path: Path) -> list[Path]:
    """The file itself, or every file under the folder in a fixed order."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def _stat_key(path: Path, files: list[Path]) -> str:
    """What identifies this version of the files without reading them."""
    stats = []
    for f in files:
        st = f.stat()
        stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ino])
    return hashlib.sha256(json.dumps([str(path.resolve()), stats]).encode()).hexdigest()


def content_digest(path: Path, root: Path) -> str:
    """The sha256 of ``path``'s bytes (a folder: each file's relative name and bytes).

    Remembered under ``root/digests`` by the files' stats, so an unchanged input is read once.
    """
    files = _files(path)
    memo = root / "digests" / _stat_key(path, files)
    if memo.is_file():
        return memo.read_text().strip()
    digest = hashlib.sha256()
    for f in files:
        if f != path:
            digest.update(f.relative_to(path).as_posix().encode() + b"\0")
        with f.open("rb") as fh:
            while block := fh.read(_CHUNK):
                digest.update(block)
    value = digest.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    tmp.write_text(value)
    os.replace(tmp, memo)
    return value


def entry_key(digest: str, settings: Mapping[str, object]) -> str:
    """The cache key of one conversion: the inputs' digest and the settings that shape it."""
    text = json.dumps({"inputs": digest, **settings}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@contextlib.contextmanager
def _locked(lock_file: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def publish_entry(
    final: Path,
    build: Callable[[Path], None],
    *,
    complete: str,
    on_wait: Callable[[], None],
) -> bool:
    """Build the entry ``final`` once, atomically; returns whether this call built it.

    Args:
        final: the entry folder.
        build: fills a fresh temporary folder; the file ``complete`` must be written last.
        complete: the file whose presence marks a finished entry.
        on_wait: called when another process holds the entry's lock (it is converting).
    """
    if (final / complete).is_file():
        return False
    with _locked(final.with_name(final.name + ".lock"), on_wait):
        if (final / complete).is_file():  # built while this process waited
            return False
        for stale in final.parent.glob(f".{final.name}.tmp-*"):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # an entry without its marker: never finished
            shutil.rmtree(final)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        tmp.mkdir(parents=True)
        try:
            build(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return True
