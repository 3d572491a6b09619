"""Loaded by the orchestrator processes of the DNS tests (PYTHONPATH): answers name
lookups from a JSON table the test rewrites, {"name": ["ip:port", ...]}, standing in for
a cluster's DNS and its headless Service. Every other name resolves as usual."""

import json
import os
import socket

_getaddrinfo = socket.getaddrinfo


def getaddrinfo(host, port, *args, **kwargs):
    path = os.environ.get("SPECDEC_TEST_DNS_TABLE")
    if path and isinstance(host, str):
        with open(path) as f:
            table = json.load(f)
        if host in table:
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, int(p)))
                    for ip, p in (address.rsplit(":", 1) for address in table[host])]
    return _getaddrinfo(host, port, *args, **kwargs)


socket.getaddrinfo = getaddrinfo
