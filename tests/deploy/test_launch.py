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
