"""The OpenAI-compatible HTTP API, through the official `openai` client: the same
generation as gRPC Generate (exact), streamed and not, chat and plain completions, the
specdec extension, tokens, and errors in OpenAI's shape."""

import pytest

openai = pytest.importorskip("openai")

from cluster import Cluster, drafter, generate, orchestrator, pb, reference, verifier  # noqa: E402
from deploy.launch import free_port  # noqa: E402

TOKEN = "sk-specdec-test"
MODEL = "tiny-target"


@pytest.fixture(scope="module")
def api(tiny_pair, tmp_path_factory):
    target_dir, draft_dir, _ = tiny_pair
    tokens = tmp_path_factory.mktemp("openai") / "tokens"
    tokens.write_text(TOKEN + "\n")
    v, d = verifier(target_dir, "openai-verifier"), drafter(draft_dir, "openai-drafter")
    cluster = Cluster()
    cluster.start(v, d)
    port = free_port()
    o = orchestrator(v, [d], target_dir, "openai-orchestrator", extra=[
        "--http-port", str(port), "--served-model-name", MODEL, "--auth-token-file", str(tokens)])
    cluster.start(o)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    yield cluster, o, client, port
    client.close()
    cluster.close()


def grpc_generate(cluster, o, **fields):
    return generate(cluster.orchestrator_stub(o), metadata=[("authorization", f"Bearer {TOKEN}")], **fields)[1]


def test_models_lists_the_served_model(api):
    _, _, client, _ = api
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_is_the_same_generation_as_grpc(api, tiny_pair, smol_tokenizer):
    cluster, o, client, _ = api
    prompt = "The tide comes in and"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                    extra_body={"specdec": {"num_speculative_tokens": 3}})
    want = reference(tiny_pair[2], smol_tokenizer(prompt)["input_ids"], 20)
    result = grpc_generate(cluster, o, text=prompt, max_new_tokens=20)
    assert list(result.token_ids) == want
    assert out.choices[0].text == result.text
    assert out.usage.completion_tokens == 20 and out.usage.prompt_tokens == result.usage.prompt_tokens
    assert out.choices[0].finish_reason == "length"
    assert out.model_extra["specdec"]["draft_tokens"] > 0  # the extension: K = 3 drafted


def test_streamed_chat_equals_the_unstreamed_one(api):
    cluster, o, client, _ = api
    messages = [{"role": "user", "content": "Tell me about boats."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    deltas, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(deltas) == whole.choices[0].message.content and len(deltas) > 2
    assert whole.choices[0].message.role == "assistant"
    assert finish == whole.choices[0].finish_reason and usage.completion_tokens == whole.usage.completion_tokens
    result = grpc_generate(cluster, o, chat=pb.Chat(messages=[pb.ChatMessage(role="user",
                                                                            content="Tell me about boats.")]),
                           max_new_tokens=24)
    assert whole.choices[0].message.content == result.text


def test_sampling_with_a_seed_is_reproducible(api):
    _, _, client, _ = api
    ask = dict(model=MODEL, prompt="Colors:", max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    assert client.completions.create(**ask).choices[0].text == client.completions.create(**ask).choices[0].text


def test_errors_come_in_openais_shape(api):
    _, _, client, port = api
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert err.value.body["param"] == "temperature" and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    assert err.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    stranger.close()


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rain"],
          "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "rain": {"type": "boolean"}}}


def test_response_format_constrains_the_output_as_generate_does(api):
    import json
    cluster, o, client, _ = api
    messages = [{"role": "user", "content": "Where does it rain? Answer in JSON."}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}})
    result = grpc_generate(cluster, o, chat=pb.Chat(messages=[pb.ChatMessage(**messages[0])]), max_new_tokens=40,
                           constraint={"json_schema": json.dumps(SCHEMA)})
    assert out.choices[0].message.content == result.text
    assert out.choices[0].finish_reason == "stop"
    answer = json.loads(result.text)
    assert answer["city"] in ("Paris", "Oslo", "Lima") and isinstance(answer["rain"], bool)
    plain = client.completions.create(model=MODEL, prompt="{", max_tokens=30, temperature=0,
                                      extra_body={"response_format": {"type": "json_object"}})
    assert plain.choices[0].text.startswith("{")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert err.value.body["param"] == "response_format" and "does not compile" in err.value.body["message"]


def _request_fields(params) -> set[str]:
    import typing
    return set(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}


def test_every_openai_field_is_honoured_or_refused(api):
    """Each field of the openai package's own request types: the server honours it (and a
    test here or in test_constraints shows how) or answers 400 naming it; an unknown one
    is refused too. A field that asks for what the server does anyway passes."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params
    from orchestrator.openai_api import AS_DEFAULT, HONOURED
    _, _, client, _ = api
    messages = [{"role": "user", "content": "hi"}]
    kinds = {"chat": (_request_fields(chat_params), client.chat.completions.create, {"messages": messages}),
             "completions": (_request_fields(completion_create_params), client.completions.create,
                             {"prompt": "hi"})}
    for kind, (fields, create, base) in kinds.items():
        for name in sorted(fields):
            assert name in HONOURED or name in AS_DEFAULT, f"{kind}: {name} is neither honoured nor refused"
            if name in HONOURED:
                continue
            # A value no field takes as its default: a non-empty object.
            with pytest.raises(openai.BadRequestError) as err:
                create(model=MODEL, max_tokens=2, extra_body={name: {"surely": "not a default"}}, **base)
            assert err.value.body["param"] == name, (kind, name, err.value.body)
            for default in AS_DEFAULT[name]:  # what the server does anyway passes
                create(model=MODEL, max_tokens=2, extra_body={name: default}, **base)
        with pytest.raises(openai.BadRequestError) as err:
            create(model=MODEL, max_tokens=2, extra_body={"guided_regex": "a+"}, **base)
        assert err.value.body["param"] == "guided_regex"


def test_logprobs_in_openais_shapes_streamed_or_not(api):
    cluster, o, client, _ = api
    messages = [{"role": "user", "content": "Count to five."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=3)
    result = grpc_generate(cluster, o, chat=pb.Chat(messages=[pb.ChatMessage(**messages[0])]), max_new_tokens=12,
                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == len(result.token_ids)
    assert all(len(c.top_logprobs) == 3 and c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy
    streamed = [c for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                               temperature=0, logprobs=True, top_logprobs=3,
                                                               stream=True)
                if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    # The same tokens; values to 1e-5 (the tiny target's float32 is not row-invariant, and this
    # request found its prompt in the prefix cache: its first token came from a smaller pass).
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(streamed, content))
    plain = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=8, temperature=0, logprobs=2)
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == plain.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs)
    without = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert without.choices[0].logprobs is None


# As users write a function's parameters: nothing said of other keys (none are generated).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


def test_tools_come_back_as_tool_calls(api):
    import json
    _, _, client, _ = api
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                         tools=[WEATHER, CLOCK], tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    else:
        assert arguments["zone"] in ("UTC", "CET")
    named = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                           tools=[WEATHER, CLOCK],
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                                   tools=[WEATHER, CLOCK], tool_choice="required", stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].function.name == call.function.name
    assert json.loads(deltas[0][0].function.arguments) == arguments
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"
    auto = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                          tools=[WEATHER])
    message = auto.choices[0].message
    assert (message.tool_calls is not None) != (message.content is not None)  # a call or text, never both
    if message.tool_calls:
        assert set(json.loads(message.tool_calls[0].function.arguments)) <= {"city", "unit"}
    for bad, param in (({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]"),
                       ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                        "tool_choice"),
                       ({"tool_choice": "required"}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **bad)
        assert err.value.body["param"] == param


def test_a_call_takes_no_argument_its_function_does_not_name(api, smol_tokenizer):
    import json
    _, _, client, _ = api
    # Every token that writes a "}" pushed far down: where another key may follow the last
    # argument (JSON Schema's default for WEATHER's parameters), the model writes one.
    closing = {str(i): -100 for token, i in smol_tokenizer.get_vocab().items()
               if "}" in smol_tokenizer.convert_tokens_to_string([token])}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                         max_tokens=48, temperature=0, tools=[WEATHER], tool_choice="required",
                                         logit_bias=closing)
    assert out.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(out.choices[0].message.tool_calls[0].function.arguments)) == {"city", "unit"}


def test_a_conversation_returns_a_tool_result_and_the_answer_follows_it(api):
    cluster, o, client, _ = api
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    # The same generation as a gRPC chat in which the call is written as the model writes one.
    said = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    result = grpc_generate(cluster, o, chat=pb.Chat(messages=[
        pb.ChatMessage(role="user", content=messages[0]["content"]), pb.ChatMessage(role="assistant", content=said),
        pb.ChatMessage(role="tool", content=messages[2]["content"])]), max_new_tokens=16)
    assert out.choices[0].message.content == result.text
    assert out.usage.prompt_tokens == result.usage.prompt_tokens
    for broken, param in (({**call, "function": {"name": "get_weather", "arguments": "{not json"}},
                           "messages[1].tool_calls[0]"),
                          ({"type": "function", "function": {"arguments": "{}"}}, "messages[1].tool_calls[0]")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
                messages[0], {"role": "assistant", "content": None, "tool_calls": [broken]}])
        assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            messages[0], {"role": "assistant", "content": None, "tool_calls": []}])
    assert err.value.body["param"] == "messages[1].tool_calls"


def test_n_choices_are_independent_samples_a_seed_reproduces(api):
    _, _, client, _ = api
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Name an animal."}], max_tokens=12,
               temperature=1.0, n=4, seed=21)
    first = client.chat.completions.create(**ask)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1  # four draws, not one copied
    assert [c.message.content for c in client.chat.completions.create(**ask).choices] == texts
    single = client.chat.completions.create(**{**ask, "n": 1, "seed": 22})  # choice 1 drew with seed 21 + 1
    assert single.choices[0].message.content == texts[1]
    cluster, o, _, _ = api
    counts = [grpc_generate(cluster, o, chat=pb.Chat(messages=[pb.ChatMessage(**ask["messages"][0])]),
                            max_new_tokens=12, temperature=1.0, seed=21 + i).usage.completion_tokens for i in range(4)]
    assert first.usage.completion_tokens == sum(counts)  # summed over the choices
    # Streamed: the choices' chunks interleaved, each with its index; the same texts.
    streamed, finished, usage = {}, set(), None
    for chunk in client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert [streamed[i] for i in range(4)] == texts and finished == {0, 1, 2, 3}
    assert usage.completion_tokens == first.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{**ask, "n": 17})
    assert err.value.body["param"] == "n"


def test_penalties_and_logit_bias_are_generates(api):
    """OpenAI's frequency and presence penalties and logit_bias, and vLLM's
    repetition_penalty: the same output as Generate with them (test_penalties checks that
    one against transformers); out of range, a 400 naming the field."""
    cluster, o, client, _ = api
    prompt = "Shopping list: eggs, milk, bread, eggs, milk,"
    penalties = dict(frequency_penalty=0.8, presence_penalty=0.5, logit_bias={28: -100.0})
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                    logit_bias={str(t): v for t, v in penalties["logit_bias"].items()},
                                    frequency_penalty=0.8, presence_penalty=0.5,
                                    extra_body={"repetition_penalty": 1.2})
    result = grpc_generate(cluster, o, text=prompt, max_new_tokens=24, repetition_penalty=1.2, **penalties)
    plain = grpc_generate(cluster, o, text=prompt, max_new_tokens=24)
    assert out.choices[0].text == result.text != plain.text
    for fields, param in ((dict(frequency_penalty=3), "frequency_penalty"),
                          (dict(extra_body={"repetition_penalty": -1}), "repetition_penalty"),
                          (dict(logit_bias={"5": 200}), "logit_bias"), (dict(logit_bias={"five": 1}), "logit_bias"),
                          (dict(logit_bias={"99999999999": 1}), "logit_bias")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **fields)
        assert err.value.body["param"] == param, (fields, err.value.body)


def _post(port: int, path: str, body: str, timeout: float = 30) -> tuple[int, bytes]:
    """A raw POST (bodies the openai client would not send as written: 1e400, 2^64)."""
    import http.client
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", path, body, {"Authorization": f"Bearer {TOKEN}",
                                                "Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("fields,param", [
    ('"max_tokens": 2147483648', "max_tokens"),
    ('"top_k": 2147483648', "top_k"),
    ('"seed": 18446744073709551616', "seed"),
    ('"logprobs": 8589934592', "logprobs"),
    ('"specdec": {"num_speculative_tokens": 2147483648}', "specdec.num_speculative_tokens"),
    ('"temperature": 1e400', "temperature"),
    ('"top_p": 1e400', "top_p"),
    ('"logit_bias": {"\\u00b2": 1}', "logit_bias"),
    ('"prompt": [1, 2147483648]', "prompt"),  # the JSON's last "prompt" wins
    ('"prompt": [1, -1], "echo": true, "logprobs": 1, "max_tokens": 0', "prompt"),
    ('"prompt": [1, 49152], "echo": true, "logprobs": 1, "max_tokens": 0', "prompt"),
])
def test_numbers_out_of_range_are_400s_naming_the_field(api, fields, param):
    """Each was a 500 (ValueError on the protobuf field, OverflowError, int("²"), the
    tokenizer's decode of an id it lacks, for echo)."""
    import json
    import time
    _, _, _, port = api
    started = time.monotonic()
    status, body = _post(port, "/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", {fields}}}')
    assert status == 400 and json.loads(body)["error"]["param"] == param, body
    assert time.monotonic() - started < 1.0


def test_a_tool_choice_whose_function_is_not_an_object_is_a_400(api):
    import json
    _, _, _, port = api
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": "get_weather"}}
    status, answer = _post(port, "/v1/chat/completions", json.dumps(body))
    assert status == 400 and json.loads(answer)["error"]["param"] == "tool_choice", answer


def test_a_deep_schema_is_a_400_naming_the_field(api):
    import json
    _, _, _, port = api
    schema = {"type": "integer"}
    for _ in range(600):
        schema = {"type": "array", "items": schema}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    status, answer = _post(port, "/v1/completions", json.dumps(body))
    assert status == 400 and json.loads(answer)["error"]["param"] == "response_format", answer
    tool = {"type": "function", "function": {"name": "deep", "parameters": {"type": "object",
                                                                           "properties": {"x": schema}}}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [tool]}
    status, answer = _post(port, "/v1/chat/completions", json.dumps(chat))
    assert status == 400 and json.loads(answer)["error"]["param"] == "tools", answer


def test_samples_from_the_largest_seed_all_end(api):
    """n = 2, seed = 2^64 - 1: sample 1's seed + 1 overflowed the field before its try, and
    the call waited for its end forever (gRPC and HTTP alike)."""
    import json
    cluster, o, _, port = api
    chunks = cluster.orchestrator_stub(o).Generate(
        pb.GenerateRequest(text="Sea", max_new_tokens=6, n=2, seed=2**64 - 1, temperature=0.9),
        timeout=30, metadata=[("authorization", f"Bearer {TOKEN}")])
    results = [e.result for e in chunks if e.HasField("result")]
    assert sorted(r.index for r in results) == [0, 1]
    status, answer = _post(port, "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "Sea", "max_tokens": 6, "n": 2, "seed": 2**64 - 1, "temperature": 0.9}))
    assert status == 200 and len(json.loads(answer)["choices"]) == 2, answer


def test_a_tool_call_cut_by_a_stop_string_comes_back_as_text(api):
    """The answer ends inside the call ("}" stops it): json.loads on it was a 500, and the
    streamed answer stopped with no error event and no [DONE]."""
    import json
    _, _, _, port = api
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 48,
            "temperature": 0, "tools": [WEATHER], "tool_choice": "required", "stop": ["}"]}
    status, answer = _post(port, "/v1/chat/completions", json.dumps(body))
    assert status == 200, answer
    choice = json.loads(answer)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"].startswith("{")
    assert not choice["message"].get("tool_calls")
    status, streamed = _post(port, "/v1/chat/completions", json.dumps({**body, "stream": True}))
    assert status == 200 and streamed.rstrip().endswith(b"data: [DONE]"), streamed[-300:]
    assert b'"error"' not in streamed


@pytest.mark.parametrize("stream", [False, True])
def test_clients_that_leave_hold_no_run(api, stream):
    """A non-streamed request went on generating, its admission slot and KV blocks held,
    until max_tokens after its client closed the socket; now it is cancelled at once."""
    import json
    import socket
    import time
    cluster, o, _, port = api
    admin = cluster.admin_stub(o)

    def running() -> int:
        return len(admin.ListRequests(pb.ListRequestsRequest(), timeout=5,
                                      metadata=[("authorization", f"Bearer {TOKEN}")]).requests)

    body = json.dumps({"model": MODEL, "prompt": "A long story about the sea", "max_tokens": 4000,
                       "temperature": 0, "stream": stream}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    clients = []
    for _ in range(16):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head + body)
        clients.append(s)
    deadline = time.monotonic() + 20
    while running() < 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == 16
    for s in clients:
        s.close()
    left = time.monotonic()
    while running() and time.monotonic() - left < 5:
        time.sleep(0.05)
    assert running() == 0, f"{running()} runs still going {time.monotonic() - left:.1f} s after their clients left"
    assert time.monotonic() - left < 1.5


def test_echo_returns_the_prompt_and_its_logprobs_as_legacy_completions_do(api, smol_tokenizer):
    """lm-evaluation-harness's log-likelihood requests: echo, logprobs 1, max_tokens 1 or 0;
    it reads token_logprobs and top_logprobs of the prompt (the first: null)."""
    cluster, o, client, _ = api
    prompt = "The tide comes in and the boats"
    ids = smol_tokenizer(prompt)["input_ids"]
    scored = list(grpc_generate(cluster, o, token_ids=pb.TokenIds(ids=ids), max_new_tokens=0, prompt_logprobs=True,
                                top_logprobs=1).prompt_logprobs)
    for max_tokens, prompt_field in ((0, prompt), (1, ids), (3, prompt)):
        out = client.completions.create(model=MODEL, prompt=prompt_field, max_tokens=max_tokens, echo=True,
                                        logprobs=1, temperature=0)
        choice = out.choices[0]
        assert choice.text.startswith(prompt) and len(choice.logprobs.tokens) == len(ids) + max_tokens
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:len(ids)] == [e.logprob for e in scored]
        assert "".join(choice.logprobs.tokens) == choice.text
        for value, top in zip(choice.logprobs.token_logprobs[1:], choice.logprobs.top_logprobs[1:]):
            assert len(top) == 1 and value <= max(top.values())
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, temperature=0)
    alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert plain.choices[0].text == prompt + alone.choices[0].text and plain.choices[0].logprobs is None
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
