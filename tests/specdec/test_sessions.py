"""The session store: creation only from start 0, a cap, explicit close, idle expiry."""

import time

import pytest

from specdec.errors import InvalidArgument, NeedsResync, Overloaded
from specdec.sessions import SessionStore


def test_created_from_start_zero_only():
    store = SessionStore(list, max_sessions=4, idle_timeout_s=60)
    with pytest.raises(NeedsResync):
        store.get("a", start=3)
    assert store.get("a", start=0) is store.get("a", start=3)


def test_cap_answers_overloaded():
    store = SessionStore(list, max_sessions=1, idle_timeout_s=60)
    store.get("a", 0)
    with pytest.raises(Overloaded):
        store.get("b", 0)
    assert store.close("a") and not store.close("a")
    store.get("b", 0)


def test_idle_sessions_expire():
    store = SessionStore(list, max_sessions=4, idle_timeout_s=0.05)
    store.get("a", 0)
    time.sleep(0.1)
    store.get("b", 0)
    assert store.expire() == 1 and len(store) == 1


def test_bad_fields():
    store = SessionStore(list, max_sessions=4, idle_timeout_s=60)
    with pytest.raises(InvalidArgument, match="session_id"):
        store.get("", 0)
    with pytest.raises(InvalidArgument, match="start"):
        store.get("a", -1)


def test_a_request_label_travels_as_printable_ascii():
    """Any label a client sends becomes a valid gRPC header value (the fuzzer found a
    control character in request_id hanging the call)."""
    from specdec.logs import request_metadata

    for label in ["plain", "\x1f", "é\u4e2d", "a\\b", "\n\r\t", "x" * 300]:
        ((_, value),) = request_metadata(label)
        assert all(" " <= c <= "~" for c in value) and len(value) <= 256, label
