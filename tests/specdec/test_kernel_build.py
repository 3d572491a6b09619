"""The compiled kernels' cache survives a build that was killed."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from specdec.runtime import kernels

LOAD = "from specdec.runtime import kernels; kernels.cpu(); print('loaded')"


def test_a_lock_left_by_a_killed_build_does_not_stop_the_next_load(tmp_path):
    # torch's lock file, as a build killed mid-way leaves it; before, every later load of
    # this directory waited for it forever (a service that never came up).
    built = Path(kernels.cpu().__file__).parent
    copy = tmp_path / "kernels" / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("build.flock"))
    (copy / "lock").touch()
    env = dict(os.environ, SPECDEC_CACHE_DIR=str(tmp_path))
    # Without the fix this waits for the lock until the timeout fails the test.
    done = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded"


def test_each_environment_builds_in_a_directory_of_its_own(monkeypatch):
    """A test venv beside a service's: each keeps its own build. (Before: both shared one
    directory whose build files named one venv's include paths, and every start that
    alternated between them rebuilt the kernels, about two minutes.)"""
    import sys

    from specdec.runtime import kernels

    here = kernels.build_key()
    monkeypatch.setattr(sys, "prefix", "/opt/another-venv")
    assert kernels.build_key() != here
