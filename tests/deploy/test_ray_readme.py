"""The README's Ray commands, typed as a user would, on a local Ray that sees this
machine's CPUs (no logical CPUs added): `specdec ray up --num-drafters 2` comes up and
answers Generate, `scale-drafters 3` then `drafters` show three replicas, scaling past
what the machine holds says how many are pending, a deployment that cannot be placed
fails at once naming the actor, and Ctrl-C stops it all."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from deploy.launch import free_port  # noqa: E402

SPECDEC = [str(Path(sys.executable).parent / "specdec")]
README = (Path(__file__).parents[2] / "README.md").read_text()


def readme_has(command: str) -> None:
    assert command in README, f"the README no longer shows `{command}`"


@pytest.fixture
def env():
    port, admin = free_port(), free_port()
    # The commands stay as written; only the ports they agree on are moved off 50051 and 50050.
    return {**os.environ, "SPECDEC_PORT": str(port), "SPECDEC_ADDRESS": f"127.0.0.1:{port}", "PYTHONUNBUFFERED": "1",
            "SPECDEC_ADMIN_PORT": str(admin), "SPECDEC_ADMIN_ADDRESS": f"127.0.0.1:{admin}",
            "SPECDEC_HTTP_PORT": str(free_port()), "RAY_ADDRESS": ""}


def run(args: list[str], env, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run(SPECDEC + args, env=env, capture_output=True, text=True, timeout=timeout)


def test_readme_ray_commands_on_this_machine(env):
    for command in ("specdec ray up --num-drafters 2", "specdec ray scale-drafters 3", "specdec ray drafters",
                    'specdec generate "Tell me a joke"'):
        readme_has(command)
    up = subprocess.Popen(SPECDEC + ["ray", "up", "--num-drafters", "2"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while not any(line.startswith("specdec is up: Generate at") for line in lines):
            assert up.poll() is None, "".join(lines[-40:])
            assert time.monotonic() < deadline, "specdec ray up never came up:\n" + "".join(lines[-40:])
            time.sleep(1)
        answer = run(["generate", "Tell me a joke", "--max-new-tokens", "16"], env)
        assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr
        scaled = run(["ray", "scale-drafters", "3"], env)
        assert scaled.returncode == 0 and "drafter replicas: 3 (" in scaled.stdout \
            and "0 pending)" in scaled.stdout, scaled.stdout + scaled.stderr
        listing = ""
        for _ in range(60):  # the orchestrator follows the set every half second
            listing = run(["ray", "drafters"], env).stdout
            if listing.startswith("3 drafter replicas"):
                break
            time.sleep(1)
        assert listing.startswith("3 drafter replicas"), listing
        # Past what this machine holds: the reply says how many are pending, and why.
        too_many = run(["ray", "scale-drafters", "64"], env)
        assert too_many.returncode == 3, too_many.stdout + too_many.stderr
        serving, starting, pending = map(int, re.search(r"\((\d+) serving, (\d+) starting, (\d+) pending\)",
                                                        too_many.stdout).groups())
        assert serving + starting + pending == 64 and pending > 0
        assert "no room for them" in too_many.stderr and "CPU" in too_many.stderr
        assert run(["ray", "scale-drafters", "2"], env).returncode == 0
        up.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            code = up.wait(180)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, "".join(lines[-40:])
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    reader.join(5)
    assert any("stopping" in line for line in lines)


def test_a_deployment_this_machine_cannot_hold_fails_at_once(env):
    started = time.monotonic()
    result = run(["ray", "up", "--num-drafters", "64"], env, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot place the drafter actor" in result.stderr and "CPU" in result.stderr, result.stderr
    assert time.monotonic() - started < 60
