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


RESYNC_DETAIL = "resync: resend the session from start=0"


async def abort(context, err: ServiceError):
    await context.abort(err.code, str(err))
