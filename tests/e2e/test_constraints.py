"""Constrained output (JSON schema, regex, grammar) through the three real processes:
greedy output token-identical to the target alone under the same constraint, whatever
the drafter and K; every finished output valid under its constraint; a constraint that
does not compile refused at once, naming the field."""

import json
import re
import time

import grpc
import jsonschema
import pytest
import torch
from transformers import LogitsProcessorList

from cluster import generate, pb
from deploy.bench import harness
from specdec import grammar
from specdec.api.common.v1 import common_pb2

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "color"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "color": {"enum": ["red", "green", "blue"]}}}
REGEX = r"(yes|no|maybe), [0-9]{2,4} (cats|dogs)"
GBNF = 'root ::= "answer: " [a-z]+ " " [0-9]+'
CONSTRAINTS = {
    "json_schema": common_pb2.Constraint(json_schema=json.dumps(SCHEMA)),
    "regex": common_pb2.Constraint(regex=REGEX),
    "gbnf": common_pb2.Constraint(gbnf=GBNF),
}
PROMPTS = ["Reply in JSON: is the sky blue?", "Shopping list: eggs, milk, bread, eggs, milk,"]
MAX_NEW = 48


def constrained_reference(model, vocab: grammar.Vocabulary, constraint, ids: list[int], max_new: int) -> list[int]:
    guide = vocab.guide(constraint, len(ids))
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         logits_processor=LogitsProcessorList([harness.constraint_processor(guide)]),
                         eos_token_id=2, pad_token_id=2)
    return out[0, len(ids):].tolist()


def valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return re.fullmatch(r"answer: [a-z]+ [0-9]+", text) is not None


@pytest.fixture(scope="module")
def vocab(smol_tokenizer):
    return grammar.Vocabulary(smol_tokenizer, len(smol_tokenizer), [2])


@pytest.fixture(scope="module")
def expected(tiny_pair, smol_tokenizer, vocab):
    out = {}
    for kind, constraint in CONSTRAINTS.items():
        for prompt in PROMPTS:
            ids = smol_tokenizer(prompt)["input_ids"]
            out[kind, prompt] = ids, constrained_reference(tiny_pair[2], vocab, constraint, ids, MAX_NEW)
    return out


@pytest.mark.parametrize("kind", ["model", "hybrid", "overlap"])
@pytest.mark.parametrize("k", [None, 0, 4])
def test_greedy_under_a_constraint_matches_the_target_alone(tiny_cluster, smol_tokenizer, expected, kind, k):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles[kind])
    finished = drafted = 0
    for (name, prompt), (ids, want) in expected.items():
        fields = {} if k is None else {"num_speculative_tokens": k}
        chunks, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW,
                                  constraint=CONSTRAINTS[name], **fields)
        assert list(result.token_ids) == want, (name, prompt, smol_tokenizer.decode(result.token_ids))
        text = "".join(c.text for c in chunks)
        assert text == result.text
        if result.finish_reason == pb.FINISH_REASON_STOP:
            finished += 1
            assert valid(name, text), (name, text)
        drafted += result.stats.draft_tokens
    assert finished >= len(expected) // 2  # the tiny target finishes most of them (the grammars end)
    if k == 4:
        assert drafted > 0


def test_forced_tokens_are_drafted_and_accepted(tiny_cluster, expected):
    """A schema's keys are forced: with the drafters' lookup unable to guess them, the
    rounds still draft them, and the target accepts most."""
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    ids, want = expected["json_schema", PROMPTS[0]]
    _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, num_speculative_tokens=8,
                         constraint=CONSTRAINTS["json_schema"])
    assert list(result.token_ids) == want
    assert result.stats.accepted_tokens >= 4, result.stats


def test_json_object_and_lark(tiny_cluster, smol_tokenizer):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["hybrid"])
    ids = smol_tokenizer(PROMPTS[0])["input_ids"]
    _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW,
                         constraint=common_pb2.Constraint(json_object=True))
    assert result.text.startswith("{")
    if result.finish_reason == pb.FINISH_REASON_STOP:
        assert isinstance(json.loads(result.text), dict)
    _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW,
                         constraint=common_pb2.Constraint(lark='start: "x" /[0-9]{3}/'))
    assert re.fullmatch(r"x[0-9]{3}", result.text), result.text
    assert result.finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.parametrize("constraint, field", [
    (common_pb2.Constraint(json_schema='{"type": "object",'), "constraint.json_schema"),
    (common_pb2.Constraint(json_schema='{"type": "nonsense"}'), "constraint.json_schema"),
    (common_pb2.Constraint(regex="(unclosed"), "constraint.regex"),
    (common_pb2.Constraint(lark="start: undefined_rule"), "constraint.lark"),
    (common_pb2.Constraint(gbnf="root ::= ("), "constraint.gbnf"),
    (common_pb2.Constraint(regex="a" * (grammar.MAX_GRAMMAR_BYTES + 1)), "constraint.regex"),
])
def test_a_bad_constraint_is_refused_naming_its_field(tiny_cluster, constraint, field):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, text="hello", max_new_tokens=4, constraint=constraint)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()
    assert time.monotonic() - started < 1.0


def test_a_constraint_set_in_one_request_never_reaches_another(tiny_cluster, smol_tokenizer, expected):
    """The verifier keeps a session's constraint: the same prompt without one, right after,
    is the target's own output (its session is another)."""
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    ids, constrained = expected["regex", PROMPTS[1]]
    _, with_it = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=16, constraint=CONSTRAINTS["regex"])
    _, without = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=16)
    assert list(with_it.token_ids) == constrained[:16]
    assert not re.fullmatch(REGEX, without.text)


COLORS = "(red|green|blue|black|white|brown)"
DRAWS = 2000


def masked_outcomes(model, vocab, prompt: list[int], constraint, eos: int = 2) -> dict[tuple, float]:
    """P(output) at temperature 1 under the constraint: every token path the grammar allows,
    each step the model's distribution masked by the grammar and renormalised."""
    outcomes = {}

    def walk(prefix: tuple, prob: float):
        guide = vocab.guide(constraint, len(prompt))
        assert guide.sync(prompt + list(prefix))
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
        p = torch.softmax(grammar.apply(logits[None].float(), guide.mask()[None])[0].double(), dim=-1)
        for token in torch.nonzero(p > 1e-12).flatten().tolist():
            if token == eos:
                outcomes[prefix + (token,)] = prob * p[token].item()
            else:
                walk(prefix + (token,), prob * p[token].item())

    walk((), 1.0)
    return outcomes


def chi_square_p(counts: dict, expected: dict, n: int) -> float:
    import numpy as np
    from scipy import stats
    exp = np.array([expected.get(o, 0.0) for o in expected]) * n
    obs = np.array([counts.get(o, 0) for o in expected], dtype=float)
    rare = exp < 5
    if rare.any():
        obs, exp = np.append(obs[~rare], obs[rare].sum()), np.append(exp[~rare], exp[rare].sum())
    exp *= obs.sum() / exp.sum()
    return stats.chisquare(obs, exp).pvalue


def test_sampling_under_a_constraint_keeps_the_masked_distribution(tiny_cluster, tiny_pair, smol_tokenizer, vocab):
    """2,000 draws at temperature 1 through the model drafter at K = 2 (its drafts checked by
    the rejection rule on the masked p): the output paths follow the target's masked
    distribution (chi-square); the draft's own masked distribution, a wrong rule that
    would be right only if every draft were kept, is rejected by the same test."""
    from concurrent.futures import ThreadPoolExecutor
    from transformers import AutoModelForCausalLM
    constraint = common_pb2.Constraint(regex=COLORS)
    prompt = smol_tokenizer("My favourite colour is")["input_ids"]
    exact = masked_outcomes(tiny_pair[2], vocab, prompt, constraint)
    assert abs(sum(exact.values()) - 1) < 1e-6 and len(exact) > 6
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()
    wrong = masked_outcomes(draft, vocab, prompt, constraint)
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])

    def one(seed):
        _, result = generate(stub, token_ids=pb.TokenIds(ids=prompt), max_new_tokens=12, temperature=1.0,
                             seed=seed, num_speculative_tokens=2, constraint=constraint)
        return tuple(result.token_ids), result.stats

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(DRAWS)))
    counts = {}
    for tokens, _ in results:
        assert tokens in exact, f"{smol_tokenizer.decode(tokens)!r} has probability 0 under the constraint"
        counts[tokens] = counts.get(tokens, 0) + 1
    drafted = sum(s.draft_tokens for _, s in results)
    accepted = sum(s.accepted_tokens for _, s in results)
    assert 0.05 < accepted / drafted < 0.95, (accepted, drafted)  # rejections: the residual is exercised
    assert chi_square_p(counts, exact, DRAWS) > 0.01
    assert chi_square_p(counts, wrong, DRAWS) < 0.01


def test_the_verifier_drafts_forced_tokens_within_its_runs(tiny_cluster, expected):
    """With K chosen per round, a schema's fixed text is drafted by the verifier in its runs
    of the target alone (counted as drafted and accepted), the output still the target's;
    at K = 0 nothing is drafted."""
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    ids, want = expected["json_schema", PROMPTS[0]]
    _, adaptive = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW,
                           constraint=CONSTRAINTS["json_schema"])
    _, alone = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, num_speculative_tokens=0,
                        constraint=CONSTRAINTS["json_schema"])
    assert list(adaptive.token_ids) == list(alone.token_ids) == want
    assert adaptive.stats.accepted_tokens >= 4 and adaptive.stats.draft_tokens >= adaptive.stats.accepted_tokens
    assert alone.stats.draft_tokens == 0


def test_a_large_schema_compiles_beside_the_streams(tiny_cluster, vocab):
    """A schema was compiled on the orchestrator's event loop, for each of n samples: every
    stream stopped meanwhile. Measured here against the same compile in this process: a
    stream in flight may pause for no more than half of one compile."""
    import threading

    def big(title: str) -> common_pb2.Constraint:
        return common_pb2.Constraint(json_schema=json.dumps(
            {"title": title, "type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(1800)}}))

    started = time.perf_counter()
    vocab.guide(big("in the test"), 0)
    compile_s = time.perf_counter() - started
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    arrivals, constrained_at = [], []

    def stream():
        for event in stub.Generate(pb.GenerateRequest(text="A long story about the sea", max_new_tokens=600,
                                                      num_speculative_tokens=0), timeout=120):
            arrivals.append(time.perf_counter())

    reader = threading.Thread(target=stream)
    reader.start()
    while len(arrivals) < 20:
        time.sleep(0.01)
    constrained_at.append(time.perf_counter())
    # Its 1,800 optional keys are past llguidance's bound on a step (a row of 2,000 items):
    # the grammar fails at its first tokens, and says so.
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, text="Reply in JSON:", max_new_tokens=4, n=4, seed=1, constraint=big("served"))
    constrained_at.append(time.perf_counter())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint" in err.value.details(), \
        err.value.details()
    reader.join()
    window = [b - a for a, b in zip(arrivals, arrivals[1:]) if constrained_at[0] <= b and a <= constrained_at[1]]
    assert window and arrivals[-1] > constrained_at[1], "the stream ended before the constrained request did"
    assert max(window) < 0.5 * compile_s, f"a stream paused {max(window):.3f} s; one compile takes {compile_s:.3f} s"


def test_samples_that_fail_together_end_the_call_with_their_error(tiny_cluster):
    """Each of n samples aborted the call itself: the second abort ended the handler while
    the first one's status was on its way, and the client waited for its deadline. A
    grammar past llguidance's bound on a step (600 optional keys) fails them all at once."""
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    for attempt in range(6):
        wide = common_pb2.Constraint(json_schema=json.dumps(
            {"title": f"wide {attempt}", "type": "object",
             "properties": {f"f{i}": {"type": "string"} for i in range(600)}}))
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, text="Reply in JSON:", max_new_tokens=8, n=16, seed=attempt, constraint=wide, timeout=20)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (attempt, err.value.details())
        assert "constraint" in err.value.details()
