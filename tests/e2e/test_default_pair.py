"""`specdec up` on the embedded default target (SmolLM2-135M-Instruct from its GGUF),
a streamed chat Generate through it, and `specdec generate` from the command line:
greedy output identical to the target alone with the same numerics (on a CPU, the GGUF's
own blocks: --quantize auto)."""

import subprocess
import sys
from pathlib import Path

import pytest

from cluster import chat_ids, generate, pb, reference
from specdec.runtime import modeling
from specdec.runtime import quantize as quantize_module
from specdec.runtime.quantize import quantize
from deploy.launch import free_port, health_status
from specdec.api.orchestrator.v1 import orchestrator_pb2_grpc

import grpc
from grpc_health.v1 import health_pb2

QUESTIONS = ["What is the capital of France?", "List three colors, then list them again."]
MAX_NEW = 24


HTTP_PORT = free_port()


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    port = free_port()
    logs = tmp_path_factory.mktemp("up") / "services.log"
    process = subprocess.Popen([str(Path(sys.executable).parent / "specdec"), "up", "--port", str(port),
                                "--http-port", str(HTTP_PORT), "--admin-port", str(free_port()), "--logs",
                                str(logs)], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()  # the launcher prints its address once all serve
        assert f"127.0.0.1:{port}" in line, line
        line = process.stdout.readline()
        assert f"http://127.0.0.1:{HTTP_PORT}/v1" in line, line
        assert health_status(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.SERVING
        # The services' logs went to the file, not to the terminal the answer is read in.
        assert all(f"{name} serving on" in logs.read_text() for name in ("verifier", "drafter", "orchestrator"))
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def target():
    """The target as `specdec up` runs it on a CPU: its GGUF's blocks (--quantize auto)."""
    model, tokenizer = modeling.load_model(modeling.DEFAULT_TARGET)
    model = quantize(model, "auto")
    assert quantize_module.method_of(model) == "gguf"
    return model, tokenizer


@pytest.mark.parametrize("question", QUESTIONS)
def test_default_pair_matches_target(up, target, question):
    model, tokenizer = target
    want = reference(model, chat_ids(tokenizer, question), MAX_NEW)
    with grpc.insecure_channel(up) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        chunks, result = generate(stub, chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=question)]),
                                  max_new_tokens=MAX_NEW, num_speculative_tokens=4)
    assert list(result.token_ids) == want
    assert "".join(c.text for c in chunks) == result.text == tokenizer.decode(want, skip_special_tokens=True)


def test_cli_generate_streams_the_text(up, target):
    model, tokenizer = target
    question = QUESTIONS[0]
    want = tokenizer.decode(reference(model, chat_ids(tokenizer, question), MAX_NEW), skip_special_tokens=True)
    done = subprocess.run([str(Path(sys.executable).parent / "specdec"), "generate", question, "--address", up,
                           "--max-new-tokens", str(MAX_NEW)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n"
    assert "tokens/s" in done.stderr


def test_the_openai_client_streams_a_chat_completion(up, target):
    openai = pytest.importorskip("openai")
    model, tokenizer = target
    question = QUESTIONS[1]
    want = tokenizer.decode(reference(model, chat_ids(tokenizer, question), MAX_NEW), skip_special_tokens=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="none", max_retries=0)
    (served,) = client.models.list().data
    stream = client.chat.completions.create(model=served.id, messages=[{"role": "user", "content": question}],
                                            max_tokens=MAX_NEW, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == want
    client.close()


def test_logprobs_are_the_same_bits_with_and_without_drafts(up, target):
    """The GGUF numerics are row-invariant: each token's log-probabilities (and the top 5)
    from a run of the target alone and from the defaults' rounds are the same bits, on 16
    unseen chat prompts, free and under a JSON schema (the OpenAI client's too)."""
    import json
    _, tokenizer = target
    questions = (Path(__file__).parents[2] / "deploy" / "bench" / "unseen_prompts.txt").read_text().splitlines()[:16]
    schema = json.dumps({"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
                         "required": ["answer"], "additionalProperties": False})

    def entries(stub, question, **fields):
        chunks, result = generate(stub, chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=question)]),
                                  max_new_tokens=MAX_NEW, logprobs=True, top_logprobs=5, **fields)
        out = [(e.token_id, e.logprob, tuple(e.top_token_ids), tuple(e.top_logprobs)) for c in chunks
               for e in c.logprobs]
        assert [e[0] for e in out] == list(result.token_ids)
        return out, result.stats

    drafted = 0
    with grpc.insecure_channel(up) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        for i, question in enumerate(questions):
            fields = {"constraint": {"json_schema": schema}} if i % 2 else {}
            defaults, stats = entries(stub, question, **fields)
            alone, _ = entries(stub, question, num_speculative_tokens=0, **fields)
            fixed, fixed_stats = entries(stub, question, num_speculative_tokens=3, **fields)
            assert defaults == alone == fixed, question
            drafted += stats.draft_tokens + fixed_stats.draft_tokens
    assert drafted > 0
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="none", max_retries=0)
    (served,) = client.models.list().data
    out = client.chat.completions.create(model=served.id, messages=[{"role": "user", "content": questions[0]}],
                                         max_tokens=MAX_NEW, temperature=0, logprobs=True, top_logprobs=5)
    with grpc.insecure_channel(up) as channel:
        want, _ = entries(orchestrator_pb2_grpc.OrchestratorServiceStub(channel), questions[0])
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == [w[1] for w in want]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [list(w[3]) for w in want]
    assert [c.token for c in content] == [tokenizer.decode([w[0]]) for w in want]
    client.close()
