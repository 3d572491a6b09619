"""The cache every process of a deployment shares: where it is, a lock across processes,
and a file's content hash read once. Stands on nothing of the project's, so that the
model files, the fetch and the kernels' build all find it the same way."""

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("SPECDEC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specdec")
    return Path(base)


@contextlib.contextmanager
def locked(path: Path):
    """Cross-process lock, so that two services starting together convert a file once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_digests: dict[tuple, str] = {}


def sha256(path: Path) -> str:
    """The file's sha256, read once a process while the file stays as it was (a start
    names a GGUF file several times: its fetch, its tokenizer, its model, its blocks; a
    reading of the 1.5B file of the real pair takes about 2 s)."""
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if key not in _digests:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _digests[key] = digest.hexdigest()
    return _digests[key]
