"""What the services that run a model (the drafter and the verifier) share: the servicer
of their sessions (health, model info, close, list). It stands on no model runtime: the
engine it serves comes from specdec.runtime.serving."""

import asyncio
import contextlib
import logging
import time

from specdec import logs, server
from specdec.api.common.v1 import common_pb2
from specdec.errors import RESYNC_DETAIL, Internal, ServiceError, Unavailable, abort
from specdec.sessions import Session, SessionStore
from specdec.wire import SERVICE_MESSAGE_BYTES

log = logging.getLogger(__name__)


class SessionServicer:
    """What the drafter and verifier servicers share. Registered before the model loads
    (health answers NOT_SERVING meanwhile); calls made before `ready` get UNAVAILABLE.
    `pb` is the service's generated module (its CloseSession/GetModelInfo messages)."""

    pb = None
    pb_grpc = None  # and its gRPC module, which registers `service`
    service = ""  # the service's name in its proto
    name = ""  # in the logs

    def __init__(self):
        self.info: common_pb2.ModelInfo | None = None
        self.store: SessionStore | None = None
        self.engine = None  # the model's batching engine (specdec.runtime.engine.Engine), once ready

    def ready(self, info: common_pb2.ModelInfo, store: SessionStore, metrics=None, engine=None) -> None:
        self.info, self.store, self.engine = info, store, engine
        if metrics is not None:
            metrics.sessions.set_function(lambda: len(store))

    async def serve(self, args, load, on_listen=None) -> None:
        """Serves this servicer on its port until a signal ends it (specdec.server.serve):
        `load` makes it ready; idle sessions are reaped; once the calls have ended, the
        engine stops."""
        await server.serve(
            message_bytes=SERVICE_MESSAGE_BYTES,
            name=self.name, host=args.host, port=args.port,
            service_names=[self.pb.DESCRIPTOR.services_by_name[self.service].full_name],
            register=lambda s: getattr(self.pb_grpc, f"add_{self.service}Servicer_to_server")(self, s),
            load=load,
            on_listen=on_listen,
            grace_s=args.shutdown_grace,
            security=server.security(args),
            background=[lambda: self.store.reap_forever()],
            drained=self.stop,
        )

    async def stop(self) -> None:
        """Once the calls have ended: the engine's thread ended too, after the pass it may
        still be in (a cancelled call's), before the process exits (Engine.stop says why)."""
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)

    def check_ready(self) -> None:
        if self.info is None:
            raise Unavailable("the model is still loading")

    @contextlib.asynccontextmanager
    async def model_work(self, session: Session):
        """Holds the session for a call's model work. A failure that is not the
        caller's (a forward pass that raised, out of memory) drops the session: its
        tokens and cache are in doubt, and the caller resends it from start 0."""
        async with session.lock:
            try:
                yield session.state
            except ServiceError:
                raise
            except Exception as err:
                log.exception("session %s: model work failed; dropping the session", session.id)
                self.store.close(session.id)
                raise Internal(f"{type(err).__name__}: {err}; the session was dropped, {RESYNC_DETAIL}") from err

    async def ListSessions(self, request, context):
        now = time.monotonic()
        sessions = list(self.store.sessions.values()) if self.store is not None else []
        return self.pb.ListSessionsResponse(sessions=[
            common_pb2.SessionInfo(session_id=s.id, tokens=len(s.state.tokens), idle_seconds=now - s.last_used)
            for s in sessions])

    async def CloseSession(self, request, context):
        logs.bind_from(context, request.session_id)
        closed = self.store is not None and self.store.close(request.session_id)
        return self.pb.CloseSessionResponse(closed=closed)

    async def GetModelInfo(self, request, context):
        if self.info is None:
            await abort(context, Unavailable("the model is still loading"))
        return self.pb.GetModelInfoResponse(info=self.info)
