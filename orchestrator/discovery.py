"""Where the drafter and verifier replica sets come from, and following them.

- a static list of addresses (--drafters, --verifiers);
- DNS (--drafter-dns, --verifier-dns): a Kubernetes headless Service resolves to one
  address per ready pod;
- Ray (--drafter-ray, --verifier-ray): the replica controller actor knows its replicas'
  current addresses (a restarted actor comes back on a new port) and can change their
  number.

The set is looked up periodically and the pool follows; a failed lookup keeps the
current set (a hiccup must not empty the pool)."""

import asyncio
import logging
import socket

from orchestrator.tasks import cancelling


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


class StaticSource:
    kind = "static"

    def __init__(self, addresses: list[str]):
        self._addresses = addresses

    async def addresses(self) -> list[str]:
        return self._addresses


class DnsSource:
    kind = "dns"

    def __init__(self, target: str):
        self.target = target

    async def addresses(self) -> list[str]:
        return await asyncio.to_thread(resolve, self.target)


class RaySource:
    """A replica controller actor of a Ray deployment (deploy/ray)."""

    kind = "ray"

    def __init__(self, controller: str, namespace: str, address: str):
        import ray

        if not ray.is_initialized():
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        self.controller = ray.get_actor(controller, namespace=namespace)
        self.asks = ray.get(self.controller.cpus.remote())

    async def addresses(self) -> list[str]:
        return sorted(await self.controller.addresses.remote())

    async def scale(self, replicas: int) -> int:
        return await self.controller.scale.remote(replicas)

    def resources(self) -> str:
        """What each replica asks for and what the cluster has free, in words."""
        import ray

        free, asks = ray.available_resources(), self.asks
        return (f"each asks for {asks:g} CPU; {free.get('CPU', 0.0):g} of "
                f"{ray.cluster_resources().get('CPU', 0.0):g} CPUs are free")

    async def placement(self, wait_s: float) -> tuple[int, int, int]:
        """(serving, starting, pending) replicas; see ReplicaController.placement."""
        return tuple(await self.controller.placement.remote(wait_s))

    async def counts(self) -> tuple[int, int, int]:
        """(serving, starting, pending) replicas now."""
        return tuple(await self.controller.counts.remote())


async def follow(source, pool, interval_s: float, what: str = "drafters") -> None:
    """Keeps the pool (of drafters or verifiers) equal to the source's replica set."""
    current: list[str] | None = None
    while True:
        try:
            addresses = await source.addresses()
        except Exception as err:  # a lookup failure of any kind keeps the current set
            if cancelling():  # a lookup over gRPC ended by our own cancel (shutdown)
                raise asyncio.CancelledError from err
            log.warning("looking up %s (%s) failed: %s; keeping %d replicas", what, source.kind, err,
                        len(pool.replicas))
        else:
            if addresses != current:
                log.info("%s (%s): %s", what, source.kind, ", ".join(addresses) or "none")
                pool.update(addresses)
                current = addresses
        await asyncio.sleep(interval_s)
