"""The status a request that failed as it ran ends with (orchestrator.server._failure):
a service's refusal of a field the orchestrator wrote is our fault, never the client's."""

import logging

import grpc
import pytest

from orchestrator.server import _failure
from specdec.errors import InvalidArgument


def refused(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_a_refused_field_of_ours_is_internal_and_logged_as_ours(caplog):
    # The verifier's answer to a q that named one target id twice (a byte-fallback draft's).
    err = refused(grpc.StatusCode.INVALID_ARGUMENT, "draft_probs[0].token_ids: lists a token id more than once")
    with caplog.at_level(logging.ERROR):
        status, details = _failure("req", err)
    assert status == grpc.StatusCode.INTERNAL
    assert "lists a token id more than once" in details and "internal" in details
    assert "a fault of ours" in caplog.text


@pytest.mark.parametrize("details", ["constraint: failed at position 12: too many optional keys",
                                     "constraint.json_schema: is not JSON"])
def test_a_refused_constraint_is_the_clients(details):
    """The client's grammar, which only the services run, passes on as its own error."""
    assert _failure("req", refused(grpc.StatusCode.INVALID_ARGUMENT, details)) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"a service call failed: {details}")


@pytest.mark.parametrize("code, passed_on", [(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
                                             (grpc.StatusCode.INTERNAL, grpc.StatusCode.INTERNAL),
                                             (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)])
def test_other_failures_keep_their_codes_or_are_retriable(code, passed_on):
    assert _failure("req", refused(code, "x"))[0] == passed_on


def test_the_requests_own_fault_found_as_it_ran_is_its_own():
    assert _failure("req", InvalidArgument("constraint", "over its bounds"))[0] == grpc.StatusCode.INVALID_ARGUMENT
