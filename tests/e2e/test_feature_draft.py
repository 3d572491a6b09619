"""The shipped EAGLE-3 head for the default target, served: the verifier sends the
target's features with its tokens, the orchestrator forwards them to the drafter, the
head drafts from them. Greedy output token-identical to the target alone with the same
numerics; a drafter that loses the session, or dies mid-stream, is resynced from the
request's window of features and the output does not change; bad features are refused
naming the field."""

import grpc
import numpy as np
import pytest

from cluster import Cluster, Stream, as_tested, chat_ids, drafter, eventually, generate, orchestrator, pb, \
    reference, verifier
from specdec import model_files
from specdec.runtime import modeling
from specdec.api.common.v1 import common_pb2
from specdec.api.drafter.v1 import drafter_pb2
from specdec.api.verifier.v1 import verifier_pb2

HEAD = "smollm2-135m-eagle3"
QUESTIONS = ["Why do cats purr?", "Give me three tips for learning to cook.", "What causes the seasons on Earth?",
             "Write a haiku about autumn leaves."]
MAX_NEW = 48
GREEDY = common_pb2.SamplingParams(top_p=1.0)


@pytest.fixture(scope="module")
def deployment():
    cluster = Cluster()
    target = modeling.DEFAULT_TARGET
    v = verifier(target)
    heads = [drafter(HEAD, "drafter-head-a"), drafter(HEAD, "drafter-head-b")]
    try:
        cluster.start(v, *heads)
        one = orchestrator(v, heads[:1], model_files.resolve(target), "orchestrator-head")
        two = orchestrator(v, heads, model_files.resolve(target), "orchestrator-two-heads")
        cluster.start(one, two)
        cluster.roles = {"verifier": v, "heads": heads, "one": one, "two": two}
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def cases():
    model, tokenizer = modeling.load_model(modeling.DEFAULT_TARGET)
    model = as_tested(model)
    return [(ids, reference(model, ids, MAX_NEW)) for ids in (chat_ids(tokenizer, q) for q in QUESTIONS)]


def test_feature_drafts_are_exact_and_accepted(deployment, cases):
    stub = deployment.orchestrator_stub(deployment.roles["one"])
    accepted = drafted = 0
    for ids, want in cases:
        _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, num_speculative_tokens=3)
        assert list(result.token_ids) == want
        drafted += result.stats.draft_tokens
        accepted += result.stats.accepted_tokens
        # The features of every committed position but the last came once from the verifier
        # (3 layers x 576 x 2 bytes each), and went on to the drafter once.
        per_position = 3 * 576 * 2
        assert len(ids) < 256  # the whole prompt fits the head's window: its features come with the first call
        assert result.stats.feature_bytes_received == per_position * (len(ids) + len(want) - 1)
        assert result.stats.feature_bytes_sent <= result.stats.feature_bytes_received
    # Every draft is the head's (the drafters run it alone, no lookup): on held-out chat it
    # agrees with the target's first token 0.45 of the time (its model card); a head that
    # reads wrong features, or a wrong embedding, agreed 0.10.
    assert drafted > 0 and accepted / drafted > 0.25, (accepted, drafted)


def test_a_drafter_that_lost_the_session_is_resynced_from_the_window(deployment, cases):
    ids, want = cases[0]
    roles = deployment.roles
    stream = Stream(deployment.orchestrator_stub(roles["one"]), request_id="head-lost", token_ids=pb.TokenIds(ids=ids),
                    max_new_tokens=MAX_NEW, num_speculative_tokens=3)
    session = deployment.session_of(roles["one"], "head-lost")
    deployment.close_session(roles["heads"][0], session)
    result = stream.finish()
    assert list(result.token_ids) == want
    if len(stream.tokens) < MAX_NEW:  # it had not finished when the session went
        assert result.stats.resyncs >= 1


def test_a_killed_drafter_fails_over_and_the_output_is_unchanged(deployment, cases):
    ids, want = cases[1]
    roles = deployment.roles
    stream = Stream(deployment.orchestrator_stub(roles["two"]), request_id="head-killed",
                    token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, num_speculative_tokens=3)
    deployment.kill(roles["heads"][0])  # on a tie the pool pairs the request with the first replica
    result = stream.finish()
    assert list(result.token_ids) == want
    assert result.stats.drafter_failovers == 1  # it was on the killed replica, and moved once


def test_a_prompt_shared_with_an_earlier_one_takes_its_features_with_its_keys_and_values(deployment):
    """The verifier keeps prompt blocks' features beside the prefix cache's keys and
    values: a second session with the same prompt computes only its last, partial block,
    in a Verify or a Decode, and gets the features the first one got: those of the cached
    blocks to the bit, the rest as close as these numerics give a row beside other rows
    (the GGUF kernels `specdec up` runs: the same bits; float32 here: a few 1e-4)."""
    stub = deployment.verifier_stub(deployment.roles["verifier"])
    prompt = [(7919 * i) % 49000 + 17 for i in range(45)]  # no other test's: the cache has none of it
    asked = verifier_pb2.FeatureRequest(layers=[2, 15, 27], first_position=0)
    first = stub.Verify(verifier_pb2.VerifyRequest(session_id="cache-a", start=0, new_tokens=prompt,
                                                   features=asked, sampling=GREEDY), timeout=30)
    again = stub.Verify(verifier_pb2.VerifyRequest(session_id="cache-b", start=0, new_tokens=prompt,
                                                   features=asked, sampling=GREEDY), timeout=30)
    run = next(iter(stub.Decode(iter([verifier_pb2.DecodeRequest(
        session_id="cache-c", start=0, new_tokens=prompt,
        features=asked, sampling=GREEDY, max_tokens=1)]), timeout=30)))
    assert first.batch_pass.tokens == len(prompt)
    # Blocks of 16: [0, 32) came from the caches; 44 is computed for its logits.
    assert again.batch_pass.tokens == run.batch_pass.tokens == len(prompt) - 32
    assert first.next_token == again.next_token == run.token_id
    cached = 32 * 3 * 576 * 2
    for response in (again, run):
        assert (response.features.start, response.features.rows) == (0, len(prompt))
        assert response.features.data[:cached] == first.features.data[:cached]
        np.testing.assert_allclose(np.frombuffer(response.features.data[cached:], dtype="<f2"),
                                   np.frombuffer(first.features.data[cached:], dtype="<f2"), rtol=1e-2, atol=1e-2)


def test_a_chats_next_turn_takes_the_features_of_the_answer_before(deployment):
    """The features a run sends a step at a time join the cache a block at a time: the
    next turn, which sends the answer back in its prompt, computes only what follows it."""
    stub = deployment.verifier_stub(deployment.roles["verifier"])
    prompt = [(7907 * i) % 49000 + 23 for i in range(45)]  # no other test's
    asked = verifier_pb2.FeatureRequest(layers=[2, 15, 27], first_position=0)
    run = list(stub.Decode(iter([verifier_pb2.DecodeRequest(
        session_id="turn-1", start=0, new_tokens=prompt,
        features=asked, sampling=GREEDY, max_tokens=40)]), timeout=60))
    answer = [m.token_id for m in run]
    sent = b"".join(m.features.data for m in run)  # positions [0, 45 + len(answer) - 1): the last is not computed
    turn = prompt + answer + [(7907 * i) % 49000 + 29 for i in range(10)]
    held = (len(prompt) + len(answer) - 1) // 16 * 16
    again = stub.Verify(verifier_pb2.VerifyRequest(session_id="turn-2", start=0, new_tokens=turn, features=asked,
                                                   sampling=GREEDY), timeout=60)
    assert held >= 64 and again.batch_pass.tokens == len(turn) - held
    row = 3 * 576 * 2
    assert again.features.rows == len(turn) and again.features.data[:held * row] == sent[:held * row]


def features(rows: int, width: int, start: int = 0) -> common_pb2.Features:
    return common_pb2.Features(start=start, rows=rows, width=width,
                               data=np.zeros(rows * width, dtype="<f2").tobytes())


@pytest.mark.parametrize("bad, field", [
    (features(3, 3 * 576, start=4), "features"),  # past the last committed token
    (features(2, 576), "features.width"),
    (common_pb2.Features(start=0, rows=2, width=3 * 576, data=b"\0" * 10), "features.data"),
])
def test_bad_features_are_refused_naming_the_field(deployment, bad, field):
    stub = deployment.drafter_stub(deployment.roles["heads"][1])
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Propose(drafter_pb2.ProposeRequest(session_id="bad-features", start=0, new_tokens=[1, 2, 3, 4, 5],
                                                     num_draft_tokens=2, features=bad, sampling=GREEDY),
                               timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


@pytest.mark.parametrize("request_features, field", [
    (verifier_pb2.FeatureRequest(layers=[2, 31]), "features.layers"),
    (verifier_pb2.FeatureRequest(layers=[2], first_position=5), "features.first_position"),
])
def test_bad_feature_requests_are_refused_naming_the_field(deployment, request_features, field):
    stub = deployment.verifier_stub(deployment.roles["verifier"])
    with pytest.raises(grpc.RpcError) as err:
        stub.Verify(verifier_pb2.VerifyRequest(session_id="bad-feature-request", start=0, new_tokens=[1, 2, 3, 4, 5],
                                               features=request_features, sampling=GREEDY), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
