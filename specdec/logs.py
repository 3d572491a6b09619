"""Logging of the services: text (the default) or one JSON object per line
(`--log-format json`), each line of a request's work carrying its request id (the
client's label, passed downstream in metadata) and its session id."""

import contextvars
import json
import logging
import time

# The request a line belongs to: set where a handler starts working for one.
REQUEST_ID = contextvars.ContextVar("request_id", default="")
SESSION_ID = contextvars.ContextVar("session_id", default="")
METADATA_KEY = "x-specdec-request-id"  # how the orchestrator tells the services a request's label


def bind(request_id: str | None = None, session_id: str | None = None) -> None:
    """The lines logged from here on, in this task and the tasks it starts, belong to this request."""
    if request_id is not None:
        REQUEST_ID.set(request_id)
    if session_id is not None:
        SESSION_ID.set(session_id)


def bind_from(context, session_id: str) -> None:
    """In a drafter or verifier handler: the request's label from the call's metadata."""
    label = next((value for key, value in context.invocation_metadata() or () if key == METADATA_KEY), "")
    bind(label if isinstance(label, str) else label.decode(), session_id)


def request_metadata(label: str) -> tuple[tuple[str, str], ...]:
    # A header value must be printable ASCII: control and non-ASCII characters in a label
    # are escaped (a raw one made the call fail to start: found by the fuzzer).
    return ((METADATA_KEY, label.encode("unicode_escape").decode("ascii")[:256]),)


class _Context(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id, record.session_id = REQUEST_ID.get(), SESSION_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "service": self.service, "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "session_id"):
            if getattr(record, key, ""):
                line[key] = getattr(record, key)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def setup(level: str, service: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_Context())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
