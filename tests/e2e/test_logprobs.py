"""The target's log-probabilities of each generated token, through the three real
processes on the tiny pair: the same whatever the drafts (K = 0, K chosen per round, a
fixed K; free and under a constraint), the top tokens those of transformers' own
generate. The tiny target runs plain float32, whose products are not row-invariant (a
verify pass's row may differ from a step's in the last bit): here the values agree to
1e-5; the default deployment's GGUF numerics give the same bits (test_default_pair)."""

import grpc
import pytest
import torch

from cluster import generate, pb
from specdec.api.common.v1 import common_pb2

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Shopping list: eggs, milk, bread, eggs, milk,",
           "def fibonacci(n):\n    if n < 2:\n        return n\n"]
MAX_NEW = 32
TOP = 5


def logprobs_of(stub, ids, **fields) -> tuple[list[int], list[common_pb2.TokenLogprobs]]:
    chunks, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, logprobs=True,
                              top_logprobs=TOP, **fields)
    entries = [e for c in chunks for e in c.logprobs]
    assert [e.token_id for e in entries] == list(result.token_ids)
    return list(result.token_ids), entries


@pytest.mark.parametrize("constraint", [None, common_pb2.Constraint(regex=r"[a-z ,]{8,40}\.")])
def test_logprobs_are_the_same_with_and_without_drafts(tiny_cluster, smol_tokenizer, constraint):
    fields = {} if constraint is None else {"constraint": constraint}
    for prompt in PROMPTS:
        ids = smol_tokenizer(prompt)["input_ids"]
        tokens, alone = logprobs_of(tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"]), ids,
                                    num_speculative_tokens=0, **fields)
        assert all(len(e.top_token_ids) == TOP or constraint is not None for e in alone)
        for e in alone:  # greedy: the top one
            assert e.logprob <= 0 and e.token_id == e.top_token_ids[0], (e, prompt)
        drafted = 0
        for kind, k in (("model", None), ("model", 4), ("hybrid", 3), ("overlap", 2)):
            stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles[kind])
            chunks, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, logprobs=True,
                                      top_logprobs=TOP, **({} if k is None else {"num_speculative_tokens": k}),
                                      **fields)
            entries = [e for c in chunks for e in c.logprobs]
            assert list(result.token_ids) == tokens
            assert [(e.token_id, list(e.top_token_ids)) for e in entries] == \
                [(e.token_id, list(e.top_token_ids)) for e in alone], (prompt, kind, k)
            got = torch.tensor([v for e in entries for v in (e.logprob, *e.top_logprobs)])
            want = torch.tensor([v for e in alone for v in (e.logprob, *e.top_logprobs)])
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (prompt, kind, k)
            drafted += result.stats.draft_tokens
        assert drafted > 0


def test_top_logprobs_are_those_of_transformers_generate(tiny_cluster, tiny_pair, smol_tokenizer):
    model = tiny_pair[2]
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    for prompt in PROMPTS:
        ids = smol_tokenizer(prompt)["input_ids"]
        tokens, entries = logprobs_of(stub, ids, num_speculative_tokens=3)
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW, output_logits=True,
                             return_dict_in_generate=True, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out.sequences[0, len(ids):].tolist() == tokens
        for entry, logits in zip(entries, out.logits):
            want = torch.log_softmax(logits[0].float(), dim=-1)
            values, top = torch.topk(want, TOP)
            assert list(entry.top_token_ids) == top.tolist()
            assert torch.allclose(torch.tensor(list(entry.top_logprobs)), values, atol=1e-4)
            assert abs(entry.logprob - want[entry.token_id].item()) < 1e-4


def test_sampled_logprobs_are_of_the_sampled_tokens(tiny_cluster, smol_tokenizer):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    ids = smol_tokenizer(PROMPTS[0])["input_ids"]
    tokens, entries = logprobs_of(stub, ids, temperature=1.0, seed=11, num_speculative_tokens=2)
    assert [e.token_id for e in entries] == tokens
    assert any(e.token_id != e.top_token_ids[0] for e in entries)  # at T = 1 not every token is the top one


@pytest.mark.parametrize("fields", [{"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 3}])
def test_bad_top_logprobs_is_refused(tiny_cluster, fields):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, text="hi", max_new_tokens=2, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("top_logprobs")


def test_prompt_logprobs_are_the_targets_own_whatever_the_speculation(tiny_cluster, tiny_pair, smol_tokenizer):
    """GenerateRequest.prompt_logprobs (echo's log-probabilities): one prefill's, those of
    the target's own forward pass over the prompt, alone (max_new_tokens 0) or before an
    output, at K = 0 or with drafts; a prompt longer than one scoring chunk too."""
    model = tiny_pair[2]
    long = " ".join(PROMPTS * 12)  # past 256 tokens: scored in two chunks
    for prompt in (PROMPTS[0], long):
        ids = smol_tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [n, vocab]
        results = []
        for kind, fields in (("model", dict(max_new_tokens=0)), ("model", dict(max_new_tokens=8,
                                                                               num_speculative_tokens=0)),
                             ("model", dict(max_new_tokens=8, num_speculative_tokens=3)),
                             ("hybrid", dict(max_new_tokens=8))):
            _, result = generate(tiny_cluster.orchestrator_stub(tiny_cluster.roles[kind]), token_ids=pb.TokenIds(ids=ids),
                                 prompt_logprobs=True, top_logprobs=TOP, **fields)
            scored = list(result.prompt_logprobs)
            assert [e.token_id for e in scored] == ids[1:] and len(result.token_ids) == fields["max_new_tokens"]
            got = torch.tensor([e.logprob for e in scored])
            assert torch.allclose(got, want[torch.arange(len(ids) - 1), ids[1:]], atol=1e-4, rtol=0), prompt
            tops = want[:-1].topk(TOP, dim=-1).indices.tolist()
            assert sum(list(e.top_token_ids) == t for e, t in zip(scored, tops)) >= 0.95 * len(scored)
            results.append([(e.token_id, e.logprob, tuple(e.top_token_ids), tuple(e.top_logprobs)) for e in scored])
        assert all(r == results[0] for r in results)  # the same bits, whatever the speculation
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, text="hi", max_new_tokens=0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("max_new_tokens")
