"""Bad input gets INVALID_ARGUMENT (FAILED_PRECONDITION for session state) naming the
field, and the services keep serving."""

import math
import subprocess

import grpc
import pytest

from cluster import drafter, drafter_pb2, generate, orchestrator, pb, verifier_pb2
from specdec.api.common.v1 import common_pb2
from specdec.wire import MAX_MESSAGE_BYTES, SERVICE_MESSAGE_BYTES

GREEDY = common_pb2.SamplingParams(top_p=1.0)
VOCAB = 49152


def expect_error(call, code, field: str):
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
            list(result)
    assert err.value.code() == code, err.value.details()
    assert err.value.details().startswith(field), err.value.details()


@pytest.mark.parametrize("field,fields", [
    ("prompt", dict(max_new_tokens=4)),
    ("text", dict(text="", max_new_tokens=4)),
    ("chat.messages", dict(chat=pb.Chat(), max_new_tokens=4)),
    ("chat.messages[0].role", dict(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="hi")]))),
    ("token_ids.ids", dict(token_ids=pb.TokenIds(ids=[]))),
    ("token_ids.ids[1]", dict(token_ids=pb.TokenIds(ids=[1, VOCAB]))),
    ("token_ids.ids[0]", dict(token_ids=pb.TokenIds(ids=[-1]))),
    ("max_new_tokens", dict(text="hi", max_new_tokens=0)),
    ("max_new_tokens", dict(text="hi", max_new_tokens=-5)),
    ("max_new_tokens", dict(text="hi", max_new_tokens=100_000)),
    ("temperature", dict(text="hi", temperature=-0.5)),
    ("temperature", dict(text="hi", temperature=math.nan)),
    ("temperature", dict(text="hi", temperature=math.inf)),
    ("temperature", dict(text="hi", temperature=1e-38)),  # logits / t overflows: it used to fail as UNKNOWN
    ("top_p", dict(text="hi", top_p=0.0)),
    ("top_p", dict(text="hi", top_p=1.01)),
    ("top_p", dict(text="hi", top_p=math.nan)),
    ("top_k", dict(text="hi", top_k=-1)),
    ("num_speculative_tokens", dict(text="hi", num_speculative_tokens=-1)),
    ("num_speculative_tokens", dict(text="hi", num_speculative_tokens=99)),
    ("stop", dict(text="hi", stop=[""])),
    ("stop", dict(text="hi", stop=["x" * 257])),
    ("request_id", dict(text="hi", request_id="x" * 200)),
])
def test_orchestrator_names_the_field(tiny_cluster, field, fields):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    expect_error(lambda: stub.Generate(pb.GenerateRequest(**fields), timeout=10),
                 grpc.StatusCode.INVALID_ARGUMENT, field)
    expect_error(lambda: stub.Complete(pb.GenerateRequest(**fields), timeout=10),
                 grpc.StatusCode.INVALID_ARGUMENT, field)


def Verify(session_id="bad-input", start=0, new_tokens=(1, 2), **kw):
    kw.setdefault("sampling", GREEDY)
    return verifier_pb2.VerifyRequest(session_id=session_id, start=start, new_tokens=new_tokens, **kw)


@pytest.mark.parametrize("code,field,message", [
    (grpc.StatusCode.FAILED_PRECONDITION, "unknown session", Verify(session_id="never-opened", start=5)),
    (grpc.StatusCode.INVALID_ARGUMENT, "session_id", Verify(session_id="")),
    (grpc.StatusCode.INVALID_ARGUMENT, "new_tokens", Verify(new_tokens=[])),
    (grpc.StatusCode.INVALID_ARGUMENT, "new_tokens[1]", Verify(new_tokens=[1, VOCAB + 5])),
    (grpc.StatusCode.INVALID_ARGUMENT, "draft_tokens[0]", Verify(draft_tokens=[-3])),
    (grpc.StatusCode.INVALID_ARGUMENT, "draft_probs", Verify(
        draft_tokens=[5, 6], draft_probs=[common_pb2.SparseDistribution(token_ids=[5], probs=[1.0])])),
    (grpc.StatusCode.INVALID_ARGUMENT, "draft_probs[0].probs", Verify(
        draft_tokens=[5], draft_probs=[common_pb2.SparseDistribution(token_ids=[5, 6], probs=[0.9, 0.9])])),
    (grpc.StatusCode.INVALID_ARGUMENT, "draft_probs[0]", Verify(
        draft_tokens=[5], draft_probs=[common_pb2.SparseDistribution(token_ids=[6], probs=[1.0])])),
    (grpc.StatusCode.INVALID_ARGUMENT, "draft_probs[0].token_ids", Verify(  # used to be merged silently
        draft_tokens=[5], draft_probs=[common_pb2.SparseDistribution(token_ids=[5, 5], probs=[0.5, 0.5])])),
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature", Verify(
        sampling=common_pb2.SamplingParams(temperature=math.nan, top_p=1.0))),
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature", Verify(
        sampling=common_pb2.SamplingParams(temperature=1e-38, top_p=1.0))),
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p", Verify(sampling=common_pb2.SamplingParams(top_p=0.0))),
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.logit_bias", Verify(
        sampling=common_pb2.SamplingParams(top_p=1.0, logit_bias={VOCAB: 1.0}))),
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.output_start", Verify(
        sampling=common_pb2.SamplingParams(top_p=1.0, output_start=-3))),
])
def test_verifier_names_the_field(tiny_cluster, code, field, message):
    stub = tiny_cluster.verifier_stub(tiny_cluster.roles["verifier"])
    expect_error(lambda: stub.Verify(message, timeout=10), code, field)


RUN = "bad-offer-run"  # a run refused an offer after it started: a long one, still going when the offer comes


def Offer(position=2, tokens=(1, 2), probs=()):
    return verifier_pb2.DraftOffer(position=position, tokens=tokens, probs=probs)


def Q(token):
    return common_pb2.SparseDistribution(token_ids=[token], probs=[1.0])


def Decode(session_id="bad-input", start=0, new_tokens=(1, 2), max_tokens=4, **kw):
    kw.setdefault("sampling", GREEDY)
    return verifier_pb2.DecodeRequest(session_id=session_id, start=start, new_tokens=new_tokens,
                                      max_tokens=max_tokens, **kw)


@pytest.mark.parametrize("code,field,message", [
    (grpc.StatusCode.FAILED_PRECONDITION, "unknown session", Decode(session_id="never-opened", start=5)),
    (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens", Decode(max_tokens=0)),
    (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens", Decode(max_tokens=1025)),
    (grpc.StatusCode.INVALID_ARGUMENT, "new_tokens", Decode(new_tokens=[])),
    (grpc.StatusCode.INVALID_ARGUMENT, "new_tokens[0]", Decode(new_tokens=[VOCAB])),
    (grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids[1]", Decode(stop_token_ids=[2, -1])),
    (grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids", Decode(stop_token_ids=list(range(65)))),
    (grpc.StatusCode.INVALID_ARGUMENT, "new_tokens", Decode(new_tokens=[1] * 9000)),  # past the model's limit
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p", Decode(sampling=common_pb2.SamplingParams(top_p=2.0))),
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.repetition_penalty", Decode(
        sampling=common_pb2.SamplingParams(top_p=1.0, repetition_penalty=-2.0))),
    (grpc.StatusCode.INVALID_ARGUMENT, "draft_lookup.max_match",
     Decode(draft_lookup=verifier_pb2.LookupRule(min_match=1, max_match=65, max_drafts=4))),
    (grpc.StatusCode.INVALID_ARGUMENT, "draft_lookup.min_match",
     Decode(draft_lookup=verifier_pb2.LookupRule(min_match=5, max_match=4, max_drafts=4))),
    (grpc.StatusCode.INVALID_ARGUMENT, "draft_lookup.max_drafts",
     Decode(draft_lookup=verifier_pb2.LookupRule(min_match=1, max_match=4, max_drafts=0))),
    (grpc.StatusCode.INVALID_ARGUMENT, "draft_lookup",
     Decode(draft_lookup=verifier_pb2.LookupRule(min_match=1, max_match=4, max_drafts=4),
            features=verifier_pb2.FeatureRequest(layers=[1]))),
    (grpc.StatusCode.INVALID_ARGUMENT, "offer.position", Decode(offer=Offer(position=0))),
    (grpc.StatusCode.INVALID_ARGUMENT, "offer.position", Decode(offer=Offer(position=100000))),
    (grpc.StatusCode.INVALID_ARGUMENT, "offer.tokens", Decode(offer=Offer(tokens=[]))),
    (grpc.StatusCode.INVALID_ARGUMENT, "offer.tokens", Decode(offer=Offer(tokens=[1] * 65))),
    (grpc.StatusCode.INVALID_ARGUMENT, "offer.tokens[1]", Decode(offer=Offer(tokens=[1, VOCAB]))),
    (grpc.StatusCode.INVALID_ARGUMENT, "offer.probs", Decode(offer=Offer(probs=[Q(1)]))),
    (grpc.StatusCode.INVALID_ARGUMENT, "offer.probs[0]", Decode(offer=Offer(tokens=[1], probs=[Q(2)]))),
    (grpc.StatusCode.INVALID_ARGUMENT, "offer", Decode(offer=Offer(), features=verifier_pb2.FeatureRequest(layers=[1]))),
    # After the first message: an offer alone, and a valid one.
    (grpc.StatusCode.INVALID_ARGUMENT, "offer", [Decode(session_id=RUN, max_tokens=1024), Decode(offer=Offer())]),
    (grpc.StatusCode.INVALID_ARGUMENT, "offer.tokens[0]",
     [Decode(session_id=RUN, max_tokens=1024), verifier_pb2.DecodeRequest(offer=Offer(tokens=[-1]))]),
])
def test_verifier_decode_names_the_field(tiny_cluster, code, field, message):
    stub = tiny_cluster.verifier_stub(tiny_cluster.roles["verifier"])
    messages = message if isinstance(message, list) else [message]
    expect_error(lambda: list(stub.Decode(iter(messages), timeout=10)), code, field)
    if isinstance(message, list):
        # A bad offer ends a run that had started: the session keeps what the run committed.
        assert RUN in tiny_cluster.sessions(tiny_cluster.roles["verifier"])
        stub.CloseSession(verifier_pb2.CloseSessionRequest(session_id=RUN), timeout=10)



def test_a_malformed_message_after_a_runs_first_is_refused(tiny_cluster):
    """Bytes that are not a DecodeRequest, after a valid first message: INVALID_ARGUMENT
    naming the request, as for a first message (tests/reliability/test_fuzz.py). The bad
    message is read beside the run while it writes tokens; an abort from there raced the
    writes (about one call in three hung until its deadline), hence the repeats."""
    channel = tiny_cluster.channel(tiny_cluster.roles["verifier"])
    decode = channel.stream_stream("/specdec.verifier.v1.VerifierService/Decode")  # bytes both ways
    first = Decode(session_id=RUN, max_tokens=1024).SerializeToString()
    stub = tiny_cluster.verifier_stub(tiny_cluster.roles["verifier"])
    for _ in range(12):
        expect_error(lambda: list(decode(iter([first, b"\xff\xff\xff"]), timeout=10)),
                     grpc.StatusCode.INVALID_ARGUMENT, "request")
        stub.CloseSession(verifier_pb2.CloseSessionRequest(session_id=RUN), timeout=10)


def Propose(session_id="bad-input", start=0, new_tokens=(1, 2), k=2, **kw):
    kw.setdefault("sampling", GREEDY)
    return drafter_pb2.ProposeRequest(session_id=session_id, start=start, new_tokens=new_tokens,
                                      num_draft_tokens=k, **kw)


@pytest.mark.parametrize("code,field,message", [
    (grpc.StatusCode.FAILED_PRECONDITION, "unknown session", Propose(session_id="never-opened", start=3)),
    (grpc.StatusCode.INVALID_ARGUMENT, "num_draft_tokens", Propose(k=0)),
    (grpc.StatusCode.INVALID_ARGUMENT, "num_draft_tokens", Propose(k=1000)),
    (grpc.StatusCode.INVALID_ARGUMENT, "new_tokens[0]", Propose(new_tokens=[VOCAB])),
    (grpc.StatusCode.INVALID_ARGUMENT, "session_id", Propose(session_id="s" * 500)),
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k", Propose(
        sampling=common_pb2.SamplingParams(top_k=-1, top_p=1.0))),
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature", Propose(
        sampling=common_pb2.SamplingParams(temperature=1e-38, top_p=1.0))),
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.frequency_penalty", Propose(
        sampling=common_pb2.SamplingParams(top_p=1.0, frequency_penalty=-7.0))),
])
def test_drafter_names_the_field(tiny_cluster, code, field, message):
    stub = tiny_cluster.drafter_stub(tiny_cluster.roles["model-drafter"])
    expect_error(lambda: stub.Propose(message, timeout=10), code, field)


def test_message_size_is_limited(tiny_cluster):
    """A message over the stated limit is refused by gRPC itself, before any parsing."""
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    with pytest.raises(grpc.RpcError) as err:
        stub.Complete(pb.GenerateRequest(text="a" * (MAX_MESSAGE_BYTES + 1)), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The services' own ports take a feature window's message, and no more than their bound.
    drafter_stub = tiny_cluster.drafter_stub(tiny_cluster.roles["model-drafter"])
    with pytest.raises(grpc.RpcError) as err:
        list(drafter_stub.Propose(Propose(features=common_pb2.Features(data=bytes(SERVICE_MESSAGE_BYTES + 1))),
                                  timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_services_keep_serving_after_bad_input(tiny_cluster):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    _, result = generate(stub, text="Still here?", max_new_tokens=6)
    assert result.usage.completion_tokens == 6
    # No session was left behind by the rejected calls.
    for role in ("verifier", "model-drafter"):
        assert "bad-input" not in tiny_cluster.sessions(tiny_cluster.roles[role])


def test_refuses_a_pair_whose_vocabularies_differ(tiny_cluster, micro_pair, micro_head, tiny_pair):
    """At start-up, with a clear message: a head of another vocabulary (it drafts from the
    target's features: its drafts cannot be carried over; a draft model's are,
    tests/e2e/test_cross_vocab.py)..."""
    micro_drafter = drafter(micro_head, "micro-head-drafter")
    tiny_cluster.start(micro_drafter)
    o = orchestrator(tiny_cluster.roles["verifier"], [micro_drafter], tiny_pair[0], "orchestrator-mismatch")
    done = subprocess.run(o.argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "vocabulary differs from the target" in done.stderr and "must share its vocabulary" in done.stderr
    # ...and a tokenizer that is not the target's.
    o = orchestrator(tiny_cluster.roles["verifier"], [], micro_pair[0], "orchestrator-wrong-tokenizer")
    done = subprocess.run(o.argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "does not match the verifier's model" in done.stderr
