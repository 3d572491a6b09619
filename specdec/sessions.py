"""Per-session state of a service, with a cap, explicit close and an idle timeout."""

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from specdec.errors import InvalidArgument, NeedsResync, Overloaded, RESYNC_DETAIL

log = logging.getLogger(__name__)

MAX_SESSION_ID = 128


@dataclass
class Session:
    id: str
    state: Any
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    guide: Any = None  # the verifier's output constraint (specdec.grammar.Guide), set at start = 0
    lookup_passed: int | None = None  # the verifier's in-run lookup: what its last lookup drafts kept
    lookup_index: Any = None  # and its index of the committed tokens (specdec.lookup.LookupIndex)
    pending_features: Any = None  # the verifier's features of the session since its last whole block


class SessionStore:
    """Sessions by id. A call with start == 0 creates (or resets) its session; any
    other call on an unknown session must resync."""

    def __init__(self, new_state: Callable[[], Any], max_sessions: int, idle_timeout_s: float,
                 release: Callable[[Any], None] = lambda state: None):
        self.new_state, self.release = new_state, release
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, session_id: str, start: int) -> Session:
        if not session_id:
            raise InvalidArgument("session_id", "must not be empty")
        if len(session_id) > MAX_SESSION_ID:
            raise InvalidArgument("session_id", f"longer than {MAX_SESSION_ID} characters")
        if start < 0:
            raise InvalidArgument("start", f"must be >= 0, got {start}")
        session = self.sessions.get(session_id)
        if session is None:
            if start != 0:
                raise NeedsResync(f"unknown session {session_id!r}; {RESYNC_DETAIL}")
            if len(self.sessions) >= self.max_sessions:
                raise Overloaded(f"{len(self.sessions)} sessions open, the limit is {self.max_sessions}")
            session = self.sessions[session_id] = Session(session_id, self.new_state())
            log.info("session %s opened (%d open)", session_id, len(self.sessions))
        session.last_used = time.monotonic()
        return session

    def close(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id, None)
        closed = session is not None
        if closed:
            self.release(session.state)
            log.info("session %s closed (%d open)", session_id, len(self.sessions))
        return closed

    def expire(self) -> int:
        """Closes sessions idle for longer than the timeout; returns how many."""
        now = time.monotonic()
        idle = [s.id for s in self.sessions.values()
                if now - s.last_used > self.idle_timeout_s and not s.lock.locked()]
        for session_id in idle:
            log.info("session %s idle for over %.0f s", session_id, self.idle_timeout_s)
            self.close(session_id)
        return len(idle)

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self.idle_timeout_s, 30.0) / 2)
            self.expire()
