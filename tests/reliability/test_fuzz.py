"""Property-based fuzzing of every RPC of the three services: random messages built from
the protos' descriptors, valid messages with one field mutated, and raw bytes. Whatever
comes in, the answer is OK or a deliberate status (never UNKNOWN, never a crash), and
every service still answers health SERVING. The default run tries a few hundred cases;
`-m slow` tries thousands."""

import math
import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

hypothesis = pytest.importorskip("hypothesis")
from google.protobuf import descriptor as d, message_factory  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from cluster import Cluster, drafter, orchestrator, verifier  # noqa: E402
from specdec.api.common.v1 import common_pb2  # noqa: E402
from specdec.api.drafter.v1 import drafter_pb2  # noqa: E402
from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb  # noqa: E402
from specdec.api.verifier.v1 import verifier_pb2  # noqa: E402

# Answers a service may give on purpose. UNKNOWN (an exception that escaped a handler),
# INTERNAL, UNAVAILABLE from a live service: bugs.
DELIBERATE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
              grpc.StatusCode.RESOURCE_EXHAUSTED}
VOCAB = 49152
INT32 = st.one_of(st.integers(-5, 70), st.sampled_from([VOCAB - 1, VOCAB, 4095, 4096, 2 ** 31 - 1, -2 ** 31]),
                  st.integers(-2 ** 31, 2 ** 31 - 1))
FLOAT = st.one_of(st.floats(width=32), st.sampled_from([0.0, 1.0, 0.5, 1e-38, 0.01, -0.0, math.inf, math.nan]))
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "user", "assistant", "system", "x" * 300, "\x00", "é"]))
SCALARS = {
    d.FieldDescriptor.TYPE_INT32: INT32, d.FieldDescriptor.TYPE_INT64: INT32,
    d.FieldDescriptor.TYPE_UINT32: st.integers(0, 2 ** 32 - 1),
    d.FieldDescriptor.TYPE_UINT64: st.integers(0, 2 ** 64 - 1),
    d.FieldDescriptor.TYPE_FLOAT: FLOAT, d.FieldDescriptor.TYPE_DOUBLE: FLOAT,
    d.FieldDescriptor.TYPE_STRING: TEXT, d.FieldDescriptor.TYPE_BOOL: st.booleans(),
    d.FieldDescriptor.TYPE_BYTES: st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\0" * 6912])),
}


def field_values(field: d.FieldDescriptor, depth: int):
    if field.type == d.FieldDescriptor.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    if field.type == d.FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-3, 9))
    return SCALARS[field.type]


@st.composite
def _message(draw, descriptor: d.Descriptor, depth: int):
    cls = message_factory.GetMessageClass(descriptor)
    message = cls()
    if depth > 3:
        return message
    oneof_fields = {f.name for o in descriptor.oneofs for f in o.fields if not o.name.startswith("_")}
    chosen = {o.name: draw(st.sampled_from([None, *[f.name for f in o.fields]]))
              for o in descriptor.oneofs if not o.name.startswith("_")}
    for field in descriptor.fields:
        if field.name in oneof_fields and chosen[field.containing_oneof.name] != field.name:
            continue
        if field.name not in oneof_fields and not draw(st.booleans()):
            continue  # unset (optional fields stay absent)
        set_random(draw, message, field, depth)
    return message


def set_random(draw, message, field: d.FieldDescriptor, depth: int) -> None:
    """Gives message.field a random value (a list of them when repeated, a dict for a map)."""
    if field.type == d.FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        getattr(message, field.name).update(draw(st.dictionaries(field_values(key, depth), field_values(value, depth),
                                                                 max_size=12)))
        return
    values = field_values(field, depth)
    if field.is_repeated:
        getattr(message, field.name).extend(draw(st.lists(values, max_size=12)))
    elif field.type == d.FieldDescriptor.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(draw(values))
    else:
        setattr(message, field.name, draw(values))


def messages(descriptor: d.Descriptor, depth: int = 0):
    return _message(descriptor, depth)


GREEDY = common_pb2.SamplingParams(top_p=1.0)
SAMPLED = common_pb2.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3)

# A valid message per RPC, for the mutation strategy.
VALID = {
    "specdec.orchestrator.v1.OrchestratorService/Generate": pb.GenerateRequest(text="Hello there",
                                                                               max_new_tokens=6),
    "specdec.orchestrator.v1.OrchestratorService/Complete": pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")]), max_new_tokens=6, temperature=0.7),
    "specdec.drafter.v1.DrafterService/Propose": drafter_pb2.ProposeRequest(
        session_id="fuzz", start=0, new_tokens=[1, 2, 3], num_draft_tokens=3, sampling=SAMPLED),
    "specdec.drafter.v1.DrafterService/CloseSession": drafter_pb2.CloseSessionRequest(session_id="fuzz"),
    "specdec.drafter.v1.DrafterService/GetModelInfo": drafter_pb2.GetModelInfoRequest(),
    "specdec.drafter.v1.DrafterService/ListSessions": drafter_pb2.ListSessionsRequest(),
    "specdec.verifier.v1.VerifierService/Verify": verifier_pb2.VerifyRequest(
        session_id="fuzz", start=0, new_tokens=[1, 2, 3], draft_tokens=[4, 5], sampling=SAMPLED,
        draft_probs=[common_pb2.SparseDistribution(token_ids=[4, 9], probs=[0.75, 0.25]),
                     common_pb2.SparseDistribution(token_ids=[5], probs=[1.0])]),
    "specdec.verifier.v1.VerifierService/Decode": verifier_pb2.DecodeRequest(
        session_id="fuzz", start=0, new_tokens=[1, 2, 3], max_tokens=4, stop_token_ids=[0], sampling=SAMPLED),
    "specdec.verifier.v1.VerifierService/Score": verifier_pb2.ScoreRequest(
        session_id="fuzz", token_ids=[1, 2, 3, 4], top_logprobs=2),
    "specdec.verifier.v1.VerifierService/CloseSession": verifier_pb2.CloseSessionRequest(session_id="fuzz"),
    "specdec.verifier.v1.VerifierService/GetModelInfo": verifier_pb2.GetModelInfoRequest(),
    "specdec.verifier.v1.VerifierService/ListSessions": verifier_pb2.ListSessionsRequest(),
    "specdec.orchestrator.v1.OrchestratorAdminService/ListDrafters": pb.ListDraftersRequest(),
    "specdec.orchestrator.v1.OrchestratorAdminService/ListRequests": pb.ListRequestsRequest(),
    "specdec.orchestrator.v1.OrchestratorAdminService/ScaleDrafters": pb.ScaleDraftersRequest(replicas=2),
    "specdec.orchestrator.v1.OrchestratorAdminService/ListVerifiers": pb.ListVerifiersRequest(),
    "specdec.orchestrator.v1.OrchestratorAdminService/ScaleVerifiers": pb.ScaleVerifiersRequest(replicas=2),
}
SERVICES = {"specdec.orchestrator.v1.OrchestratorService": pb, "specdec.drafter.v1.DrafterService": drafter_pb2,
            "specdec.verifier.v1.VerifierService": verifier_pb2,
            "specdec.orchestrator.v1.OrchestratorAdminService": pb}


def rpcs():
    """(full method name, request descriptor, response streams?) of every RPC."""
    out = []
    for service_name, module in SERVICES.items():
        service = module.DESCRIPTOR.services_by_name[service_name.rsplit(".", 1)[1]]
        for method in service.methods:
            out.append((f"{service_name}/{method.name}", method.input_type, method.server_streaming))
    return out


RPCS = rpcs()
CASES = int(os.environ.get("SPECDEC_FUZZ_CASES", "60"))


@pytest.fixture(scope="module")
def fuzz_cluster(tiny_pair):
    target_dir, draft_dir, _ = tiny_pair
    cluster = Cluster()
    v = verifier(target_dir, "fuzz-verifier", extra=["--max-sessions", "64"])
    dr = drafter(draft_dir, "fuzz-drafter", extra=["--max-sessions", "64"])
    cluster.start(v, dr)
    o = orchestrator(v, [dr], target_dir, "fuzz-orchestrator", extra=["--max-new-tokens-limit", "16"])
    cluster.start(o)
    channels = {}
    for service in (v, dr, o):
        channels[service.name] = grpc.insecure_channel(service.address)
    channels["admin"] = grpc.insecure_channel(o.admin_address)
    yield cluster, {"verifier": v, "drafter": dr, "orchestrator": o}, channels
    for channel in channels.values():
        channel.close()
    cluster.close()


def channel_for(channels, method: str):
    if "OrchestratorAdminService" in method:
        return channels["admin"]
    if "Orchestrator" in method:
        return channels["fuzz-orchestrator"]
    return channels["fuzz-drafter" if "Drafter" in method else "fuzz-verifier"]


def call(channel, method: str, payload: bytes, streaming: bool) -> grpc.StatusCode:
    path = f"/{method}"
    try:
        if streaming:
            for _ in channel.unary_stream(path)(payload, timeout=30):
                pass
        else:
            channel.unary_unary(path)(payload, timeout=30)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def mutate(valid, descriptor: d.Descriptor):
    """The valid message with one field replaced by a random value."""

    @st.composite
    def mutated(draw):
        message = type(valid)()
        message.CopyFrom(valid)
        if not descriptor.fields:
            return message
        field = draw(st.sampled_from(list(descriptor.fields)))
        message.ClearField(field.name)
        set_random(draw, message, field, 0)
        return message

    return mutated()


def requests_for(method: str, descriptor: d.Descriptor):
    return st.one_of(
        messages(descriptor).map(lambda m: m.SerializeToString()),
        mutate(VALID[method], descriptor).map(lambda m: m.SerializeToString()),
        st.binary(max_size=64),  # raw bytes: often not a message at all
    )


@pytest.mark.parametrize("method,descriptor,streaming", RPCS, ids=[r[0].split(".")[-1] for r in RPCS])
def test_any_message_gets_a_deliberate_answer(fuzz_cluster, method, descriptor, streaming):
    cluster, services, channels = fuzz_cluster
    channel = channel_for(channels, method)
    seen: dict[str, int] = {}

    @settings(max_examples=CASES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(payload=requests_for(method, descriptor))
    def check(payload):
        code = call(channel, method, payload, streaming)
        seen[code.name] = seen.get(code.name, 0) + 1
        try:
            message_factory.GetMessageClass(descriptor).FromString(payload)
        except Exception:
            # Bytes that are not the method's message: INVALID_ARGUMENT, from the services'
            # interceptor (specdec.server.MalformedRequests), never gRPC's INTERNAL.
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, payload)
            return
        assert code in DELIBERATE, (code, payload)

    check()
    print(f"{method}: {seen}")
    for name, service in services.items():
        with grpc.insecure_channel(service.address) as probe:
            status = health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING, name
        assert service.process.poll() is None, name


@pytest.mark.slow
def test_thousands_of_cases():
    """The same with SPECDEC_FUZZ_CASES=2000 per RPC, in a child pytest."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                           "-k", "deliberate"], env={**os.environ, "SPECDEC_FUZZ_CASES": "2000"},
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-4000:]
