"""The local launcher's ports."""

import socket

from deploy import launch


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    # A port the kernel may give an outgoing connection's local end can be gone before the
    # service binds it; one handed out twice goes to two services.
    ports = [launch.free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    low = launch._ephemeral_low()
    if low is not None:
        assert all(port < low for port in ports)
    with socket.socket() as s:
        s.bind((launch.HOST, ports[-1]))


def test_a_port_in_use_is_refused_with_its_flag_before_anything_listens():
    """A second deployment on one host: each service, and `specdec up`, says which flag's
    port is taken and exits 2, before binding anything (before, the orchestrator said it
    listened, then died with a traceback on its admin port)."""
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as held:
        held.bind((launch.HOST, 0))
        held.listen()
        port = held.getsockname()[1]
        free = str(launch.free_port())
        for argv, flag in (
                ([sys.executable, "-m", "orchestrator", "--port", free, "--admin-port", str(port)], "--admin-port"),
                ([sys.executable, "-m", "verifier_service", "--port", free, "--metrics-port", str(port)],
                 "--metrics-port"),
                ([sys.executable, "-m", "drafter_service", "--port", str(port)], "--port"),
                ([str(Path(sys.executable).parent / "specdec"), "up", "--http-port", str(port)], "--http-port")):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert done.returncode == 2, (argv, done.stderr)
            assert f"127.0.0.1:{port} is in use; choose another with {flag}" in done.stderr
            assert "Traceback" not in done.stderr and "listening" not in done.stderr
