"""Compiled kernels, built once per machine on first use (a C++ compiler is needed; about
two minutes on 2 cores) and kept in the cache directory."""

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_HERE = Path(__file__).parent


SOURCES = ("gguf_cpu.cpp", "attention_cpu.cpp", "norm_cpu.cpp", "activation_cpu.cpp", "layer_cpu.cpp", "module.cpp")
HEADERS = ("exp_cpu.h",)


@functools.cache
def cpu():
    """The CPU kernels, one module: the GGUF block products (gguf_cpu.cpp), `pack(blocks,
    type)`, `matmul(x, packed, type, rows)` and `dequantize(packed, type, rows, ids)`; the engine's float64 paged
    attention (attention_cpu.cpp), `attention(q, k_pool, v_pool, slots, rows, lengths, scale)`;
    Llama's RMSNorm (norm_cpu.cpp), `rms_norm(x, weight, eps)`; silu, row-invariant
    (activation_cpu.cpp), `silu(x)`; a Llama model's decoder
    layers on GGUF blocks from those parts (layer_cpu.cpp), `LlamaStack(...)`, whose
    `forward` takes a pass through all of them in one call."""
    from torch.utils import cpp_extension

    from specdec.cache import cache_root

    sources = [_HERE / name for name in SOURCES]
    build = cache_root() / "kernels" / f"cpu-{build_key()}"
    try:
        build.mkdir(parents=True, exist_ok=True)
        writable = os.access(build, os.W_OK) or (build / "specdec_cpu.so").exists()
    except OSError:
        writable = False
    if not writable:  # a read-only cache (a baked image) built for another CPU: build beside it
        build = Path(tempfile.gettempdir()) / "specdec-kernels" / f"cpu-{build_key()}"
        build.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with _building(build):
        module = cpp_extension.load(name="specdec_cpu", sources=[str(s) for s in sources],
                                    build_directory=str(build),
                                    extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
                                    verbose=False)
    log.info("CPU kernels ready in %.1f s (%s)", time.monotonic() - started, build)
    return module


def build_key() -> str:
    """The build's directory key. -march=native: built on the machine that runs it; the key
    keeps builds for other CPUs, torch versions and sources apart (a shared cache, a baked
    image), and for other environments: a build's files name its environment's include
    paths, so two virtual environments sharing one directory rebuilt it (two minutes) at
    every start that alternated between them."""
    return hashlib.sha256(b"".join((_HERE / name).read_bytes() for name in SOURCES + HEADERS)
                          + torch.__version__.encode() + platform.machine().encode() + _cpu_flags().encode()
                          + sys.prefix.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _building(build: Path):
    """Holds the build directory against other processes while torch builds or loads in it.
    torch's own lock is a file (`lock`) that a killed build leaves behind, and every later
    load then waits for it forever; an flock is released when its holder dies, so whoever
    holds it may clear a lock file that no live build owns."""
    try:
        held = open(build / "build.flock", "a")
    except OSError:  # a read-only directory: nobody builds in it
        yield
        return
    with held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        yield


def take_threads() -> int | None:
    """Makes the kernels run on the calling thread's torch.set_num_threads (see module.cpp's
    take_threads); call it right after that, in the thread. -> the count, or None where the
    kernels are not loaded."""
    return cpu().take_threads() if cpu.cache_info().currsize else None


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().version
