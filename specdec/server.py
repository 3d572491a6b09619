"""gRPC server scaffolding every service shares: health (NOT_SERVING until the model
is loaded and warmed), reflection, the batching engine, and a graceful stop on SIGTERM."""

import asyncio
import logging
import signal
import threading
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.common.v1 import common_pb2
from specdec.engine import Engine
from specdec.errors import Unavailable, abort
from specdec.quantize import quantize
from specdec.sessions import SessionStore

log = logging.getLogger(__name__)


def engine(model, args) -> Engine:
    """The model's batching engine, sized by the session-service flags (and the model
    quantized as they say: the drafter cuts its output head first)."""
    return Engine(quantize(model, args.quantize), args.kv_cache_bytes, args.max_batch_rows, args.max_batch_tokens,
                  args.max_waiting_sessions, threads=args.threads)


class SessionServicer:
    """What the drafter and verifier servicers share. Registered before the model loads
    (health answers NOT_SERVING meanwhile); calls made before `ready` get UNAVAILABLE.
    `pb` is the service's generated module (its CloseSession/GetModelInfo messages)."""

    pb = None

    def __init__(self):
        self.info: common_pb2.ModelInfo | None = None
        self.store: SessionStore | None = None

    def ready(self, info: common_pb2.ModelInfo, store: SessionStore) -> None:
        self.info, self.store = info, store

    def check_ready(self) -> None:
        if self.info is None:
            raise Unavailable("the model is still loading")

    async def CloseSession(self, request, context):
        closed = self.store is not None and self.store.close(request.session_id)
        return self.pb.CloseSessionResponse(closed=closed)

    async def GetModelInfo(self, request, context):
        if self.info is None:
            await abort(context, Unavailable("the model is still loading"))
        return self.pb.GetModelInfoResponse(info=self.info)


def create_server(host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A server bound to host:port (port 0 picks a free one); returns it and its port."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return server, bound


async def serve(
    *,
    name: str,
    host: str,
    port: int,
    service_names: list[str],
    register: Callable[[grpc.aio.Server], None],
    load: Callable[[], Awaitable[None]],
    background: list[Callable[[], Awaitable[None]]] = (),
    grace_s: float = 5.0,
    on_listen: Callable[[int, Callable[[], None]], None] | None = None,
) -> None:
    """Starts the server at once (health answers NOT_SERVING), awaits `load`, then
    reports SERVING; stops gracefully on SIGTERM or SIGINT. `on_listen(port, stop)`
    tells an embedding host (a Ray actor) the bound port and a thread-safe stop."""
    server, bound = create_server(host, port)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", *service_names):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    register(server)
    reflection.enable_server_reflection((*service_names, reflection.SERVICE_NAME, health.SERVICE_NAME), server)
    await server.start()
    log.info("%s listening on %s:%d (not serving until loaded)", name, host, bound)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if on_listen is not None:
        on_listen(bound, lambda: loop.call_soon_threadsafe(stop.set))

    tasks = []
    try:
        loader = asyncio.ensure_future(load())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if loader.done():
            loader.result()  # a failed load ends the process with its error
            for service in ("", *service_names):
                await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
            tasks = [asyncio.ensure_future(task()) for task in background]
            log.info("%s serving on %s:%d", name, host, bound)
            await stopper
        else:
            loader.cancel()
    finally:
        log.info("%s stopping (grace %.0f s)", name, grace_s)
        await health_servicer.enter_graceful_shutdown()
        for task in tasks:
            task.cancel()
        await server.stop(grace_s)
        log.info("%s stopped", name)
