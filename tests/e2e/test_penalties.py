"""Penalties and logit biases through the three real processes: greedy output
token-identical to transformers' generate with the same penalties, whatever the drafter
and K; log-probabilities the same with and without drafts; bad values refused, naming
the field. (Sampling with penalties: test_sampling's chi-square.)"""

import grpc
import pytest
import torch
from transformers import LogitsProcessorList

from cluster import generate, pb
from deploy.bench.harness import penalties_processor

PROMPTS = ["Shopping list: eggs, milk, bread, eggs, milk,", "The tide comes in and"]
MAX_NEW = 32
# Each as GenerateRequest fields; the token ids are among those the tiny target writes
# after the prompts above without penalties (the test checks that each set changes them).
PENALTIES = {
    "openai": dict(frequency_penalty=0.8, presence_penalty=0.5),
    "repetition": dict(repetition_penalty=1.4),
    "bias": dict(logit_bias={28: -100.0, 30: 4.0}),
    "all": dict(frequency_penalty=-0.5, presence_penalty=1.5, repetition_penalty=0.9, logit_bias={314: 3.0}),
}


def penalised_reference(model, ids: list[int], max_new: int, **penalties) -> list[int]:
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         logits_processor=LogitsProcessorList([penalties_processor(len(ids), **penalties)]),
                         eos_token_id=2, pad_token_id=2)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def expected(tiny_pair, smol_tokenizer):
    out = {}
    for prompt in PROMPTS:
        ids = smol_tokenizer(prompt)["input_ids"]
        plain = penalised_reference(tiny_pair[2], ids, MAX_NEW)
        for name, penalties in PENALTIES.items():
            out[name, prompt] = ids, penalised_reference(tiny_pair[2], ids, MAX_NEW, **penalties), plain
    return out


def test_every_penalty_set_changes_the_reference(expected):
    """Else the identity tests below could pass with the penalties ignored."""
    for name in PENALTIES:
        assert any(want != plain for (n, _), (_, want, plain) in expected.items() if n == name), name


@pytest.mark.parametrize("kind", ["model", "hybrid", "overlap"])
@pytest.mark.parametrize("k", [None, 0, 4])
def test_greedy_with_penalties_matches_the_target_alone(tiny_cluster, expected, kind, k):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles[kind])
    drafted = 0
    for (name, prompt), (ids, want, _) in expected.items():
        fields = {} if k is None else {"num_speculative_tokens": k}
        _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, **PENALTIES[name],
                             **fields)
        assert list(result.token_ids) == want, (name, prompt, kind, k)
        drafted += result.stats.draft_tokens
    if k == 4:
        assert drafted > 0


def test_log_probabilities_with_penalties_are_the_same_with_and_without_drafts(tiny_cluster, expected):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    ids, want, _ = expected["all", PROMPTS[0]]
    answers = []
    for k in (0, 4):
        chunks, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, logprobs=True,
                                  top_logprobs=3, num_speculative_tokens=k, **PENALTIES["all"])
        assert list(result.token_ids) == want
        entries = [e for c in chunks for e in c.logprobs]
        answers.append(([(e.token_id, list(e.top_token_ids)) for e in entries],
                        torch.tensor([v for e in entries for v in (e.logprob, *e.top_logprobs)])))
    assert answers[0][0] == answers[1][0] and len(answers[0][0]) == len(want)
    # The tiny target's float32 passes are not row-invariant (test_logprobs): to 1e-5.
    assert torch.allclose(answers[0][1], answers[1][1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("fields, field", [
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=1000.0), "repetition_penalty"),
    (dict(logit_bias={5: 150.0}), "logit_bias"),
    (dict(logit_bias={10 ** 6: 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
])
def test_bad_penalties_are_refused_naming_the_field(tiny_cluster, fields, field):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, text="hello", max_new_tokens=4, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()


@pytest.mark.parametrize("kind", ["model", "hybrid"])
def test_penalties_under_a_constraint_match_the_target_alone(tiny_cluster, tiny_pair, smol_tokenizer, kind):
    """The penalties, then the constraint's mask: greedy output token-identical to
    transformers' generate with both, at K chosen per round and at 4 (forced tokens and
    lookup matches drafted, penalised as any draft)."""
    from deploy.bench import harness
    from e2e.test_constraints import REGEX
    from specdec import grammar
    from specdec.api.common.v1 import common_pb2

    vocab = grammar.Vocabulary(smol_tokenizer, len(smol_tokenizer), [2])
    constraint = common_pb2.Constraint(regex=REGEX)
    penalties = dict(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={28: 3.0})
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles[kind])
    changed = False
    for prompt in PROMPTS:
        ids = smol_tokenizer(prompt)["input_ids"]

        def reference(**fields):
            processors = [harness.constraint_processor(vocab.guide(constraint, len(ids)))]
            if fields:
                processors.insert(0, penalties_processor(len(ids), **fields))
            out = tiny_pair[2].generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW,
                                        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        logits_processor=LogitsProcessorList(processors), eos_token_id=2,
                                        pad_token_id=2)
            return out[0, len(ids):].tolist()

        want = reference(**penalties)
        changed |= want != reference()
        for k in (None, 4):
            fields = {} if k is None else {"num_speculative_tokens": k}
            _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, constraint=constraint,
                                 **penalties, **fields)
            assert list(result.token_ids) == want, (prompt, k)
    assert changed  # the penalties changed some constrained output
