"""Drafter discovery by DNS: a Kubernetes headless Service resolves to one address per
ready drafter pod. The name is re-resolved periodically and the pool follows."""

import asyncio
import logging
import socket

from orchestrator.pool import DrafterPool

log = logging.getLogger("orchestrator.discovery")


def split_host_port(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {target!r}")
    return host.strip("[]"), int(port)


def resolve(target: str) -> list[str]:
    """Every address `host:port` resolves to, as sorted host:port strings."""
    host, port = split_host_port(target)
    addresses = set()
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        ip, resolved_port = sockaddr[:2]
        addresses.add(f"[{ip}]:{resolved_port}" if family == socket.AF_INET6 else f"{ip}:{resolved_port}")
    return sorted(addresses)


async def follow_dns(target: str, pool: DrafterPool, interval_s: float) -> None:
    """Keeps the pool equal to what `target` resolves to. A failed lookup keeps the
    current set (a DNS hiccup must not empty the pool)."""
    current: list[str] | None = None
    while True:
        try:
            addresses = await asyncio.to_thread(resolve, target)
        except OSError as err:
            log.warning("resolving %s failed (%s); keeping %d replicas", target, err, len(pool.replicas))
        else:
            if addresses != current:
                log.info("%s resolves to %s", target, ", ".join(addresses) or "nothing")
                pool.update(addresses)
                current = addresses
        await asyncio.sleep(interval_s)
