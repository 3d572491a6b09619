"""The Ray actors: one specdec service each, and the replica controllers (one for the
drafters, one for the verifiers)."""

import asyncio
import importlib
import logging
import os
import threading

import ray

from specdec import flags
from deploy.launch import health_status

log = logging.getLogger("specdec.ray")

MODULES = {"verifier": "verifier_service.server", "drafter": "drafter_service.server",
           "orchestrator": "orchestrator.server"}


class ServiceActor:
    """Hosts one service's gRPC server (its own `serve`, on a thread of the actor's
    process) and reports where it listens. On a cluster it binds all interfaces and
    reports the node's address; on one machine it stays on loopback."""

    def __init__(self, service: str, argv: list[str], placed=None):
        """placed: (an actor, a key): told `placed(key)` as this starts on its node, so
        that it can tell a replica loading its model from one Ray has not placed."""
        if placed is not None:
            placed[0].placed.remote(placed[1])
        module = importlib.import_module(MODULES[service])
        args = module.build_parser().parse_args(argv)
        flags.setup_logging(args.log_level, service, args.log_format)
        self.error: BaseException | None = None
        listening = threading.Event()

        def on_listen(port, stop):
            self.port, self._stop = port, stop
            listening.set()

        def run():
            try:
                asyncio.run(module.serve(args, on_listen))
            except BaseException as err:  # reported by serving()
                self.error = err
                listening.set()

        threading.Thread(target=run, name=f"specdec-{service}", daemon=True).start()
        listening.wait()
        if self.error is not None:
            raise self.error
        self.host = ray.util.get_node_ip_address() if args.host in ("0.0.0.0", "::") else args.host

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def serving(self) -> bool:
        from grpc_health.v1 import health_pb2

        if self.error is not None:
            raise RuntimeError(f"the service failed: {self.error!r}")
        return health_status(self.address()) == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> None:
        self._stop()


class ReplicaController:
    """Owns one service's replicas (drafters or verifiers): starts and retires them, and
    tells the orchestrator their current addresses (a replica Ray restarted listens on a
    new port)."""

    def __init__(self, name: str, service: str, argv: list[str], num_cpus: float, num_gpus: float, drain_s: float,
                 replicas: int = 0):
        self.name, self.service = name, service
        self.argv, self.num_cpus, self.num_gpus, self.drain_s = argv, num_cpus, num_gpus, drain_s
        self.replicas: list = []
        self.started_refs: dict = {}  # replica -> its first call, done once Ray has placed and started it
        self.names: dict = {}  # replica -> its name
        self.placed_names: set[str] = set()  # replicas whose process has started (see ServiceActor)
        self.started = 0
        self.retiring: set[asyncio.Task] = set()
        # The replicas are this actor's own and die with it: a restarted controller starts
        # the deployment's replicas again (a scale call made since is not remembered), in
        # new names (the old ones may not be released yet).
        self.incarnation = os.urandom(3).hex()
        if ray.get_runtime_context().was_current_actor_reconstructed:
            log.warning("the %s controller restarted: starting %d replicas again", service, replicas)
        self._grow(replicas)

    def _grow(self, replicas: int) -> None:
        while len(self.replicas) < replicas:
            self.started += 1
            name = f"{self.name}-{self.service}-{self.incarnation}-{self.started}"
            actor = ray.remote(ServiceActor).options(
                name=name, num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=-1, max_task_retries=-1,
            ).remote(self.service, self.argv, (ray.get_runtime_context().current_actor, name))
            self.replicas.append(actor)
            self.names[actor] = name
            self.started_refs[actor] = actor.address.remote()

    async def placed(self, name: str) -> None:
        self.placed_names.add(name)

    async def scale(self, replicas: int) -> int:
        self._grow(replicas)
        while len(self.replicas) > replicas:
            actor = self.replicas.pop()
            self.placed_names.discard(self.names.pop(actor, None))
            ref = self.started_refs.pop(actor, None)
            started = ref is None or bool(ray.wait([ref], timeout=0)[0])
            task = asyncio.ensure_future(self._retire(actor) if started else self._kill(actor))
            self.retiring.add(task)
            task.add_done_callback(self.retiring.discard)
        log.info("%s replicas: %d", self.service, len(self.replicas))
        return len(self.replicas)

    async def cpus(self) -> float:
        """CPUs each replica asks for."""
        return self.num_cpus

    async def placement(self, wait_s: float) -> tuple[int, int, int]:
        """(serving, starting, pending) after waiting up to `wait_s` seconds for every
        replica to start: replicas that listen; those Ray has placed that are still
        loading their model; those still waiting for resources the cluster lacks."""
        refs = {r: self.started_refs[r] for r in self.replicas if r in self.started_refs}
        if refs:
            tasks = {asyncio.ensure_future(self._started(ref)): r for r, ref in refs.items()}
            _, waiting = await asyncio.wait(tasks, timeout=wait_s)
            for task in waiting:
                task.cancel()
        return self._counts()

    async def counts(self) -> tuple[int, int, int]:
        """(serving, starting, pending) now."""
        return self._counts()

    def _counts(self) -> tuple[int, int, int]:
        unready = [r for r in self.replicas if r in self.started_refs
                   and not ray.wait([self.started_refs[r]], timeout=0)[0]]
        starting = sum(self.names.get(r) in self.placed_names for r in unready)
        return len(self.replicas) - len(unready), starting, len(unready) - starting

    @staticmethod
    async def _started(ref) -> None:
        try:
            await ref
        except Exception:
            pass  # a replica that failed to start is not pending

    async def _kill(self, actor) -> None:
        """A replica Ray never placed holds no session: it goes at once."""
        ray.kill(actor, no_restart=True)

    async def _retire(self, actor) -> None:
        # Out of the set at once; stopped once the orchestrator has moved its sessions.
        await asyncio.sleep(self.drain_s)
        try:
            await asyncio.wait_for(actor.stop.remote(), 10)
            await asyncio.sleep(1.0)
        except Exception:
            pass
        ray.kill(actor, no_restart=True)

    async def addresses(self) -> list[str]:
        """Addresses of the replicas that are serving now (one restarting is left out)."""

        async def probe(actor):
            try:
                if await asyncio.wait_for(actor.serving.remote(), 5):
                    return await asyncio.wait_for(actor.address.remote(), 5)
            except Exception:
                return None

        return [a for a in await asyncio.gather(*(probe(r) for r in self.replicas)) if a]

    async def replicas_now(self) -> list:
        """The replicas' actor handles."""
        return list(self.replicas)
