"""gRPC server scaffolding every service shares: health (NOT_SERVING until the model
is loaded and warmed), reflection, security, and a graceful stop on SIGTERM. What the
services that run a model share besides (their engine, their sessions) is in
specdec.session_service: the orchestrator serves without the model runtime."""

import argparse
import asyncio
import contextlib
import gc
import inspect
import logging
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec import flags, security as transport
from specdec.errors import InvalidArgument, ServiceError, abort
from specdec.wire import MAX_MESSAGE_BYTES, message_options


def add_server_flags(parser: argparse.ArgumentParser, prefix: str, default_port: int) -> None:
    """Flags every service has: where to listen, logging, and transport security."""
    add = flags.add
    add(parser, "--host", env=f"{prefix}_HOST", default="127.0.0.1",
        help="address to bind; 0.0.0.0 to serve other machines")
    add(parser, "--port", env=f"{prefix}_PORT", type=int, default=default_port, help="gRPC port")
    add(parser, "--log-level", env=f"{prefix}_LOG_LEVEL", default="INFO", help="logging level")
    add(parser, "--log-format", env=f"{prefix}_LOG_FORMAT", default="text", choices=["text", "json"],
        help="json: one object per line, with the request id and session id on a request's lines")
    add(parser, "--metrics-port", env=f"{prefix}_METRICS_PORT", type=int, default=0,
        help="HTTP port of Prometheus metrics (/metrics), on --host; 0: none")
    add(parser, "--otlp-endpoint", env=f"{prefix}_OTLP_ENDPOINT", default="",
        help="host:port of an OpenTelemetry collector (OTLP/gRPC) to send traces to; empty: no traces")
    add(parser, "--shutdown-grace", env=f"{prefix}_SHUTDOWN_GRACE", type=float, default=30.0,
        help="seconds calls in flight get to finish after SIGTERM (keep it below Kubernetes' "
             "terminationGracePeriodSeconds)")
    transport.add_server_flags(parser, prefix)


log = logging.getLogger(__name__)


def security(args, auth_token_file: str = "") -> "Security":
    """The Security the service's flags ask for (specdec.security)."""
    from specdec import security as sec

    return Security(sec.server_credentials(args), tuple(sec.auth_interceptors(auth_token_file)), args.health_port)


@dataclass
class Listener:
    """A port a service answers on, and what it serves there."""
    host: str
    port: int
    service_names: list[str]
    register: Callable[[grpc.aio.Server], None]


class _Malformed:
    """What a request that did not parse becomes, so that its handler can refuse it."""

    def __init__(self, error: Exception, method: str):
        self.error, self.method = error, method

    def refusal(self) -> InvalidArgument:
        return InvalidArgument("request", f"not a valid message for {self.method} ({self.error})")


class MalformedRequests(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT for a request whose bytes are not the method's message (gRPC
    would answer UNKNOWN after the parser raised); in a request stream (the verifier's
    Decode), for any of its messages. Other services' request-streaming methods
    (reflection) are left as they are."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming and not (
                handler.response_streaming and details.method.startswith("/specdec.")):
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as err:  # DecodeError, or any parser complaint
                return _Malformed(err, details.method)

        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(
                _checked_streams(handler.stream_stream), deserialize, handler.response_serializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _checked_stream(handler.unary_stream), deserialize, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            _checked_unary(handler.unary_unary), deserialize, handler.response_serializer)


def _checked_streams(behavior):
    # A malformed message in the stream is raised to whoever reads it, not aborted there:
    # the reader may be a task beside the handler (the verifier's offers), and an abort
    # from it while the handler writes fails the call's batch in gRPC
    # (TOO_MANY_OPERATIONS) and leaves the stream hanging.
    async def checked(requests):
        async for request in requests:
            if isinstance(request, _Malformed):
                raise request.refusal()
            yield request

    async def guarded(requests, context):
        try:
            async with contextlib.aclosing(behavior(checked(requests), context)) as responses:
                async for response in responses:
                    yield response
        except ServiceError as err:  # a handler that leaves its reader's errors to us
            await abort(context, err)

    return guarded


def _checked_stream(behavior):
    async def guarded(request, context):
        if isinstance(request, _Malformed):
            await abort(context, request.refusal())
        async with contextlib.aclosing(behavior(request, context)) as responses:  # closed with this one
            async for response in responses:
                yield response

    return guarded


def _checked_unary(behavior):
    async def guarded(request, context):
        if isinstance(request, _Malformed):
            await abort(context, request.refusal())
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return guarded


@dataclass
class Security:
    """How a service's ports are guarded (specdec.security): TLS credentials, and
    interceptors (bearer-token auth) for the ports that serve calls."""
    credentials: grpc.ServerCredentials | None = None
    interceptors: tuple = ()
    health_port: int = 0  # a plaintext port with health only (0: none)


PORT_FLAGS = (("--port", "host", "port"), ("--admin-port", "admin_host", "admin_port"),
              ("--http-port", "host", "http_port"), ("--metrics-port", "host", "metrics_port"),
              ("--health-port", "host", "health_port"))


def taken(host: str, port: int) -> bool:
    """Does something listen on host:port already? (A port left in TIME_WAIT is free.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def refuse_taken_ports(service: str, args) -> None:
    """Every port the service's flags name, checked before it binds any: one in use ends
    the process with a line that names its flag (exit 2), not a traceback after the
    service said it listens on another."""
    problems = [f"{service}: {getattr(args, host)}:{getattr(args, port)} is in use; choose another with {flag}"
                for flag, host, port in PORT_FLAGS
                if getattr(args, port, 0) and taken(getattr(args, host), getattr(args, port))]
    if problems:
        print("\n".join(problems), file=sys.stderr, flush=True)
        raise SystemExit(2)


def create_server(host: str, port: int, credentials: grpc.ServerCredentials | None = None,
                  interceptors=(), message_bytes: int = MAX_MESSAGE_BYTES) -> tuple[grpc.aio.Server, int]:
    """A server bound to host:port (port 0 picks a free one); returns it and its port."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *message_options(message_bytes)],
                             interceptors=[MalformedRequests(), *interceptors])
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return server, bound


async def start_listener(name: str, listener: Listener, health_servicer, security: Security,
                         message_bytes: int = MAX_MESSAGE_BYTES) -> tuple[grpc.aio.Server, int]:
    server, bound = create_server(listener.host, listener.port, security.credentials, security.interceptors,
                                  message_bytes)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    listener.register(server)
    reflection.enable_server_reflection((*listener.service_names, reflection.SERVICE_NAME, health.SERVICE_NAME),
                                        server)
    await server.start()
    log.info("%s listening on %s:%d for %s (%s)", name, listener.host, bound, ", ".join(listener.service_names),
             "TLS" if security.credentials else "plaintext")
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
    grace_s: float = 30.0,
    on_listen: Callable[[int, Callable[[], None]], None] | None = None,
    admin: Listener | None = None,
    security: Security = Security(),
    serving: Callable[[], bool] = lambda: True,
    drained: Callable[[], Awaitable[None]] | None = None,
    message_bytes: int = MAX_MESSAGE_BYTES,
) -> None:
    """Starts the server at once (health answers NOT_SERVING), awaits `load`, then
    reports SERVING; on SIGTERM or SIGINT it drains: health turns NOT_SERVING, new calls
    are refused, calls in flight get `grace_s` to finish. `on_listen(port, stop)` tells
    an embedding host (a Ray actor) the bound port and a thread-safe stop. `admin`: a
    second port, for the services operators call; `security`: TLS and auth of both.
    `serving()`: whether the service can take calls now (health follows it once loaded).
    `drained()`: work the calls left behind, awaited once they have all ended.
    `message_bytes`: the largest message its main port takes or sends (specdec.wire)."""
    health_ = _Health([*service_names, *(admin.service_names if admin else [])])
    await health_.set(NOT_SERVING)
    servers, bound = await _listen(name, Listener(host, port, service_names, register), admin, health_.servicer,
                                   security, message_bytes)
    stop = _stop_signal(on_listen, bound)
    tasks = []
    try:
        loader = asyncio.ensure_future(load())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not loader.done():
            loader.cancel()
            return
        loader.result()  # a failed load ends the process with its error
        keep_what_is_loaded()
        await health_.set(SERVING)
        tasks = [asyncio.ensure_future(task()) for task in background]
        tasks.append(asyncio.ensure_future(health_.follow(serving, service_names)))
        log.info("%s serving on %s:%d", name, host, bound)
        await stopper
    finally:
        await _drain(name, health_, servers, tasks, grace_s, drained)


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def keep_what_is_loaded() -> None:
    """The objects a load leaves (the libraries' modules, the model) live as long as the
    process: frozen out of the collector's reach, so that a full collection while serving
    no longer walks them (a request in flight waited on it), nor does the interpreter's
    at exit (docs/benchmarks.md#a-services-objects-frozen-once-it-has-loaded-on-a-cpu).
    The load's own garbage is collected first, or it would be frozen with them."""
    gc.collect()
    gc.freeze()


class _Health:
    """The health service of every port: NOT_SERVING until loaded, then each main
    service as `serving()` says."""

    def __init__(self, services: list[str]):
        self.servicer, self.services = health.aio.HealthServicer(), services

    async def set(self, status, services: list[str] | None = None) -> None:
        for service in ("", *(self.services if services is None else services)):
            await self.servicer.set(service, status)

    async def follow(self, serving: Callable[[], bool], services: list[str]) -> None:
        now = True
        while True:
            await asyncio.sleep(1.0)
            if serving() != now:
                now = not now
                await self.set(SERVING if now else NOT_SERVING, services)


async def _listen(name: str, main: Listener, admin: Listener | None, health_servicer, security: Security,
                  message_bytes: int) -> tuple[list, int]:
    """The main port's server, the admin port's and the plaintext health port's (those
    asked for); -> (the servers, the main port as bound)."""
    server, bound = await start_listener(name, main, health_servicer, security, message_bytes)
    servers = [server]
    if admin is not None:
        servers.append((await start_listener(name, admin, health_servicer, security))[0])
    if security.health_port:
        probe, _ = create_server(main.host, security.health_port)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probe)
        await probe.start()
        servers.append(probe)
        log.info("%s answers health checks in plaintext on %s:%d", name, main.host, security.health_port)
    log.info("%s listening on %s:%d (not serving until loaded)", name, main.host, bound)
    return servers, bound


def _stop_signal(on_listen: Callable[[int, Callable[[], None]], None] | None, bound: int) -> asyncio.Event:
    """Set on SIGTERM or SIGINT (in the main thread), or by the embedding host's stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if on_listen is not None:
        on_listen(bound, lambda: loop.call_soon_threadsafe(stop.set))
    return stop


async def _drain(name: str, health_: _Health, servers: list, tasks: list, grace_s: float,
                 drained: Callable[[], Awaitable[None]] | None) -> None:
    log.info("%s draining: calls in flight have %.0f s to finish", name, grace_s)
    await health_.servicer.enter_graceful_shutdown()
    for task in tasks:
        task.cancel()
    # The background tasks' own ends (the HTTP front drains its requests) are awaited with
    # the gRPC calls': a request still running there leaves its sessions to `drained`.
    stopping = [s.stop(grace_s) for s in servers]
    if tasks:
        stopping.append(asyncio.wait(tasks, timeout=grace_s + 1.0))
    await asyncio.gather(*stopping)
    if drained is not None:
        await drained()
    log.info("%s stopped", name)
