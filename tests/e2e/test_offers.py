"""Drafts offered to a run of the target alone in its Decode stream, as the orchestrator
sends them with --overlap: an offer in a message after the first is taken by the run's
next passes where its first tokens (a guess when it was made) are what the run
committed, and the tokens stay the target alone's."""

import queue
import uuid

from cluster import verifier_pb2
from specdec.api.common.v1 import common_pb2

GREEDY = common_pb2.SamplingParams(top_p=1.0)
PROMPT = [1, 504, 3458, 314, 253, 1345, 30, 2]


def run(stub, max_tokens: int, offer_after: int = 0, offer: verifier_pb2.DraftOffer | None = None):
    """A run's messages; with `offer`, sent once `offer_after` tokens have come back."""
    outbox: queue.Queue = queue.Queue()
    outbox.put(verifier_pb2.DecodeRequest(session_id=uuid.uuid4().hex, start=0, new_tokens=PROMPT,
                                          max_tokens=max_tokens, sampling=GREEDY))

    def requests():
        while (message := outbox.get()) is not None:
            yield message

    got = []
    try:
        for message in stub.Decode(requests(), timeout=60):
            got.append(message)
            if offer is not None and len(got) == offer_after:
                outbox.put(verifier_pb2.DecodeRequest(offer=offer))
    finally:
        outbox.put(None)
    return got


def test_an_offer_sent_while_a_run_goes_is_checked_and_keeps_the_targets_tokens(tiny_cluster):
    stub = tiny_cluster.verifier_stub(tiny_cluster.roles["verifier"])
    want = [m.token_id for m in run(stub, 400)]
    # The target's own answer from its 4th token on, offered once 4 tokens came back: the
    # run has gone on meanwhile, so the offer's first tokens are checked against its tokens.
    right = run(stub, 400, 4, verifier_pb2.DraftOffer(position=len(PROMPT) + 4, tokens=want[4:60]))
    assert [m.token_id for m in right] == want
    assert any(m.offered_drafts for m in right) and sum(m.drafted for m in right) >= 10
    # The same with its first token wrong: never taken.
    wrong = [(want[4] + 1) % 49152] + want[5:60]
    missed = run(stub, 400, 4, verifier_pb2.DraftOffer(position=len(PROMPT) + 4, tokens=wrong))
    assert [m.token_id for m in missed] == want
    assert not any(m.offered_drafts or m.drafted for m in missed)
