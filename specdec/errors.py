"""The errors services raise, and their gRPC status codes: one place for the mapping."""

import grpc


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    """A request field is wrong; the message starts with the field's name."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class NeedsResync(ServiceError):
    """The service does not hold what the caller assumes: resend from start = 0."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Precondition(ServiceError):
    """The system is not in a state where the call makes sense."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Internal(ServiceError):
    """The service failed at its own work (a forward pass that raised, out of memory)."""

    code = grpc.StatusCode.INTERNAL


RESYNC_DETAIL = "resync: resend the session from start=0"


def needs_resync(code: grpc.StatusCode, details: str | None) -> bool:
    """Whether a service's error asks the caller to resend the session: FAILED_PRECONDITION
    with the resync detail (others are preconditions of another kind), or INTERNAL, after
    which the service has dropped the session."""
    return code == grpc.StatusCode.INTERNAL or (
        code == grpc.StatusCode.FAILED_PRECONDITION and RESYNC_DETAIL in (details or ""))


async def abort(context, err: ServiceError):
    await context.abort(err.code, str(err))
