"""An OpenAI-compatible HTTP front on the orchestrator (`--http-port`): `/v1/models`,
`/v1/completions` and `/v1/chat/completions`, streamed (server-sent events) or not. It
is a second door to the same generation as gRPC `Generate`: the same validation, limits,
metrics and exactness. Errors come in OpenAI's shape. Beyond OpenAI's fields, a request
may carry `top_k`, `repetition_penalty` (vLLM's) and `specdec: {"num_speculative_tokens": K}`; every response carries
`specdec`: the request's speculation statistics."""

import codecs
import contextlib
from dataclasses import dataclass, field
import json
import logging
import math
import re
import time
import uuid

import grpc
from aiohttp import web

from orchestrator.bridge import token_bytes
from specdec import grammar, security
from specdec.errors import ServiceError
from specdec.grammar import JSON_OPTIONS as JSON_SHAPE
from specdec.sampling_params import MAX_SAMPLES
from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb

log = logging.getLogger("orchestrator.http")

STATUS = {  # gRPC code -> (HTTP status, OpenAI error type)
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
}
# OpenAI has no finish reason for a constraint that allows nothing more: "stop", as an
# end of sequence would be (the gRPC Result says which).
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_CONSTRAINT: "stop"}

# Every field of OpenAI's chat and completions requests is honoured or refused, never
# ignored. Honoured: these (top_k, repetition_penalty and specdec are ours; user, safety_identifier and
# prompt_cache_key are labels and hints, which change no output).
HONOURED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
            "stop", "stream", "stream_options", "user", "n", "response_format", "top_k", "specdec",
            "safety_identifier", "prompt_cache_key", "parallel_tool_calls", "logprobs", "top_logprobs", "tools",
            "tool_choice", "frequency_penalty", "presence_penalty", "logit_bias", "repetition_penalty", "echo"}
# Refused unless they ask for what the server does anyway (the values listed; absent or
# null always passes).
AS_DEFAULT = {"best_of": (1,), "suffix": ("",),
              "functions": ([],), "function_call": ("none", "auto"),
              "metadata": ({},),
              "store": (False,), "service_tier": ("auto", "default"), "modalities": (["text"],), "audio": (),
              "prediction": (), "reasoning_effort": (), "verbosity": (), "web_search_options": (), "moderation": (),
              "prompt_cache_retention": (), "prompt_cache_options": ()}


@dataclass
class Echo:
    """A completion's prompt, sent back before its text (`echo`): as the client wrote it,
    and as the target's tokens; `unwritten`: those the tokenizer added, which stand for no
    text of it (a BOS)."""
    text: str
    ids: list[int]
    unwritten: set[int] = field(default_factory=set)


def _unwritten(full: list[int], plain: list[int]) -> set[int]:
    """The positions of `full` (a text's tokens with the tokenizer's own added) that
    `plain` (without them) lacks: a prefix and a suffix."""
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return set(range(start)) | set(range(start + len(plain), len(full)))
    return set()


class Refused(Exception):
    """A request refused, with the gRPC code the same request would get on Generate."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message = code, message
        self.param = param if param is not None else (message.split(":", 1)[0] if ":" in message else None)


class _Context:
    """What the servicer needs of a gRPC context, for a call that came over HTTP."""

    def time_remaining(self):
        return None

    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise Refused(code, details)


def error(err: Refused) -> web.Response:
    status, kind = STATUS.get(err.code, (500, "api_error"))
    if err.param and err.param.startswith("chat.messages"):  # the gRPC field's name for OpenAI's
        err.param = err.param.removeprefix("chat.")
    if err.param and err.param.startswith("constraint"):  # only response_format sets it
        err.param = "response_format"
    return web.json_response({"error": {"message": err.message, "type": kind, "param": err.param,
                                        "code": err.code.name.lower()}}, status=status)


INT32 = (1 << 31) - 1  # the widest int32 field of a GenerateRequest
UINT64 = (1 << 64) - 1


def _integer(body: dict, name: str, low: int, high: int, default=None, field: str | None = None):
    """body[name], an integer in [low, high] (the range of the GenerateRequest field it
    becomes, or a tighter one)."""
    value = _field(body, name, int, default) if field is None else _checked(body.get(name), int, field, default)
    if value is not None and not low <= value <= high:
        field = field or name
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: must be in [{low}, {high}], got {value}", field)
    return value


def _number(body: dict, name: str):
    """body[name], a finite number (JSON reads 1e400 as infinity)."""
    value = _field(body, name, (int, float))
    if value is None:
        return None
    try:
        value = float(value)
    except OverflowError:  # an integer of hundreds of digits
        value = math.inf
    if not math.isfinite(value):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: must be a finite number", name)
    return value


def _checked(value, kinds, name: str, default=None):
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: must be {' or '.join(k.__name__ for k in kinds)}",
                      name)
    return value


def _field(body: dict, name: str, kinds, default=None):
    """body[name] if it has one of the types `kinds` (a bool is not an int here)."""
    return _checked(body.get(name), kinds, name, default)


class OpenAIFront:
    def __init__(self, servicer, model_name: str, tokens: list[bytes]):
        self.servicer, self.model_name, self.tokens = servicer, model_name, tokens
        self.created = int(time.time())
        self._token_bytes: dict[int, bytes] | None = None  # the target's tokens' bytes, read at the first use

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard], client_max_size=4 * 1024 * 1024)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    @web.middleware
    async def guard(self, request: web.Request, handler):
        try:
            if self.tokens and not security.bearer_ok(request.headers.get("Authorization", ""), self.tokens):
                raise Refused(grpc.StatusCode.UNAUTHENTICATED, "a bearer token is required (Authorization: "
                                                              "Bearer ...)", "")
            return await handler(request)
        except Refused as err:
            return error(err)
        except ServiceError as err:  # a shared check's (grammar, sampling), raised before generation
            return error(Refused(err.code, str(err), getattr(err, "field", None)))
        except web.HTTPException as err:
            return web.json_response({"error": {"message": err.reason, "type": "invalid_request_error",
                                                "param": None, "code": None}}, status=err.status)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specdec"}]})

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # RecursionError: nested thousands deep
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "the body is not JSON", "")
        if not isinstance(body, dict):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "the body must be a JSON object", "")
        model = body.get("model")
        if model != self.model_name:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"model: {model!r} is not served here; this server serves "
                                                     f"{self.model_name!r} (GET /v1/models)", "model")
        n = _field(body, "n", int, 1)
        if not 1 <= n <= MAX_SAMPLES:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"n: in [1, {MAX_SAMPLES}]", "n")
        for name, value in body.items():
            if name in HONOURED:
                continue
            if name not in AS_DEFAULT:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: not a field this server knows", name)
            if value is not None and not any(_same(value, v) for v in AS_DEFAULT[name]):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: not supported", name)
        return body

    def _request(self, body: dict, max_tokens_field: str = "max_tokens") -> pb.GenerateRequest:
        """The GenerateRequest of the common sampling fields (the prompt is set by the caller)."""
        request = pb.GenerateRequest(request_id=str(_field(body, "user", str, "") or ""))
        _logprob_fields(body, request, chat=max_tokens_field != "max_tokens")
        max_tokens = _integer(body, max_tokens_field, -INT32, INT32)
        if max_tokens is None and max_tokens_field != "max_tokens":
            max_tokens = _integer(body, "max_tokens", -INT32, INT32)
        if max_tokens is not None:
            request.max_new_tokens = max_tokens
        for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            value = _number(body, name)
            if value is not None:
                setattr(request, name, value)
        for name, low, high in (("top_k", -INT32, INT32), ("seed", 0, UINT64)):
            value = _integer(body, name, low, high)
            if value is not None:
                setattr(request, name, value)
        _logit_bias(body, request)
        _stops(body, request)
        _constraint(body, request)
        extension = _field(body, "specdec", dict, {}) or {}
        k = _integer(extension, "num_speculative_tokens", -INT32, INT32, field="specdec.num_speculative_tokens")
        if k is not None:
            request.num_speculative_tokens = k
        return request

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        generate = self._request(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a batch of one
        if isinstance(prompt, str):
            generate.text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            self._check_ids(prompt)
            generate.token_ids.ids.extend(prompt)
        else:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "prompt: one string or one list of token ids", "prompt")
        echo = None
        if _field(body, "echo", bool, False):
            # The prompt's log-probabilities come from one prefill (Result.prompt_logprobs):
            # the target's own, with or without speculation. max_tokens 0: those alone.
            if generate.logprobs and _field(body, "stream", bool, False):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "echo: with logprobs, not streamed", "echo")
            tokenizer = self.servicer.tokenizer
            if isinstance(prompt, str):
                ids = tokenizer(prompt)["input_ids"]
                echo = Echo(prompt, ids, _unwritten(ids, tokenizer(prompt, add_special_tokens=False)["input_ids"]))
            else:
                echo = Echo(tokenizer.decode(prompt), list(prompt))
            nothing_new = generate.HasField("max_new_tokens") and generate.max_new_tokens == 0
            generate.prompt_logprobs = generate.logprobs or nothing_new
        elif generate.HasField("max_new_tokens") and generate.max_new_tokens == 0:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be >= 1 (0 only with echo)",
                          "max_tokens")
        return await self._respond(request, body, generate, chat=False, echo=echo)

    def _check_ids(self, prompt: list[int]) -> None:
        """A prompt of token ids: each in the target's vocabulary (before echo decodes them)."""
        if self.servicer.tokenizer is None:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "still starting: waiting for the verifier")
        vocab = self.servicer.info.vocab_size
        for i, token in enumerate(prompt):
            if not 0 <= token < vocab:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"prompt: token id {token} at [{i}] is outside the vocabulary [0, {vocab})", "prompt")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        generate = self._request(body, "max_completion_tokens")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "messages: a non-empty list", "messages")
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"messages[{i}].content: text parts only",
                                  f"messages[{i}].content")
                content = "".join(p.get("text", "") for p in content)
            if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls") is not None:
                content = _said_calls(m["tool_calls"], content, f"messages[{i}]")
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"messages[{i}]: needs a role and text content",
                              f"messages[{i}]")
            role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for it
            generate.chat.messages.add(role=role, content=content)
        tools = _tools(body, generate)
        return await self._respond(request, body, generate, chat=True, tools=tools)

    async def _respond(self, request: web.Request, body: dict, generate: pb.GenerateRequest,
                       chat: bool, tools: set[str] | None = None, echo: Echo | None = None) -> web.StreamResponse:
        stream = bool(_field(body, "stream", bool, False))
        usage_in_stream = bool((_field(body, "stream_options", dict, {}) or {}).get("include_usage"))
        n = _field(body, "n", int, 1)
        if n > 1 and not stream:
            return await self._choices(generate, n, chat, tools, echo)
        if n > 1:
            generate.n = n  # the choices' chunks interleaved, each with its index
        async with contextlib.aclosing(self.servicer.generate(generate, _Context())) as events:
            return await self._answer(request, events, chat, stream, usage_in_stream, generate.logprobs, tools, n,
                                      echo)

    async def _choices(self, generate: pb.GenerateRequest, n: int, chat: bool, tools: set[str] | None,
                       echo: Echo | None = None) -> web.Response:
        """n independent samples, generated at once (GenerateRequest.n: choice i draws with
        seed + i, a random seed where none is given, so a seed reproduces every choice)."""
        generate.n = n
        by_index: list[list[pb.GenerateResponse]] = [[] for _ in range(n)]
        async with contextlib.aclosing(self.servicer.generate(generate, _Context())) as events:
            async for event in events:
                by_index[getattr(event, event.WhichOneof("event")).index].append(event)

        async def replay(events):
            for event in events:
                yield event

        answers = [await self._choice(replay(events), chat, generate.logprobs, tools, i, echo)
                   for i, events in enumerate(by_index)]
        results = [result for _, result in answers]
        usage = {"prompt_tokens": results[0].usage.prompt_tokens,
                 "completion_tokens": sum(r.usage.completion_tokens for r in results)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return web.json_response({**self._head(chat), "choices": [choice for choice, _ in answers],
                                  "usage": usage, "specdec": [_stats(r) for r in results]})

    async def _choice(self, events, chat: bool, asked: bool, tools: set[str] | None, index: int = 0,
                      echo: Echo | None = None) -> tuple[dict, pb.Result]:
        """One generation's choice, read whole (after its prompt, with `echo`)."""
        text, result, logprobs = [], None, []
        async for event in events:
            if event.HasField("chunk"):
                text.append(event.chunk.text)
                logprobs.extend(event.chunk.logprobs)
            else:
                result = event.result
        choice = {"index": index, "finish_reason": FINISH.get(result.finish_reason, "stop")}
        calls = _calls("".join(text), tools, result)
        if calls:
            choice.update(message={"role": "assistant", "content": None, "tool_calls": calls},
                          finish_reason="tool_calls", logprobs=self._logprobs(logprobs, chat) if asked else None)
        elif chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
            choice["logprobs"] = self._logprobs(logprobs, chat) if asked else None
        else:
            choice.update(text=(echo.text if echo else "") + "".join(text),
                          logprobs=self._logprobs(logprobs, chat, echo, result.prompt_logprobs) if asked else None)
        return choice, result

    def _bytes(self, i: int) -> bytes:
        """A token's bytes: its piece's, whole or part of a character (a special token's: its content)."""
        if self._token_bytes is None:
            self._token_bytes = token_bytes(self.servicer.tokenizer)
        found = self._token_bytes.get(i)
        return found if found is not None else self.servicer.tokenizer.decode([i]).encode()

    def _token(self, i: int) -> str:
        """A token as OpenAI writes it: its text, or where its bytes are part of a character
        (a character split across tokens), "bytes:" and the bytes."""
        piece = self._bytes(i)
        try:
            return piece.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)

    def _logprobs(self, entries, chat: bool, echo: Echo | None = None, scored=()) -> dict:
        """OpenAI's logprobs object: chat's `content` list, or completions' four lists;
        these after the prompt's (its token ids and the log-probabilities of those after
        the first, which has none: null) where it is echoed. A token's text_offset is where
        its text starts in the choice's text: a token the tokenizer added stands for none."""
        token = self._token
        if chat:
            return {"content": [
                {"token": token(e.token_id), "logprob": e.logprob, "bytes": list(self._bytes(e.token_id)),
                 "top_logprobs": [{"token": token(i), "logprob": v, "bytes": list(self._bytes(i))}
                                  for i, v in zip(e.top_token_ids, e.top_logprobs)]} for e in entries],
                "refusal": None}
        ids, unwritten = (echo.ids, echo.unwritten) if echo is not None else ([], set())
        every = list(ids) + [e.token_id for e in entries]
        tokens = [token(i) for i in every]
        # Characters counted as they complete: one split across tokens counts at its last byte.
        characters, offsets, at = codecs.getincrementaldecoder("utf-8")("replace"), [], 0
        for n, i in enumerate(every):
            offsets.append(at)
            if n not in unwritten:
                at += len(characters.decode(self._bytes(i)))
        entries = list(scored) + list(entries)
        first = [None] if ids else []
        return {"tokens": tokens, "token_logprobs": first + [e.logprob for e in entries],
                "top_logprobs": first + [{token(i): v for i, v in zip(e.top_token_ids, e.top_logprobs)}
                                         for e in entries],
                "text_offset": offsets}

    def _head(self, chat: bool, chunk: bool = False) -> dict:
        """The fields every answer (or streamed chunk) of one request starts with."""
        kind = ("chat.completion" + (".chunk" if chunk else "")) if chat else "text_completion"
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": self.model_name}

    async def _answer(self, request: web.Request, events, chat: bool, stream: bool,
                      usage_in_stream: bool, asked: bool = False, tools: set[str] | None = None,
                      choices: int = 1, echo: Echo | None = None) -> web.StreamResponse:
        if not stream:
            choice, result = await self._choice(events, chat, asked, tools, echo=echo)
            return web.json_response({**self._head(chat), "choices": [choice], "usage": _usage(result),
                                      "specdec": _stats(result)})
        # The first event decides between an error response and the stream.
        first = await events.__anext__()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        out = _EventStream(self, response, chat, asked)
        await out.open(choices, echo)
        held = [_Held() for _ in range(choices)]  # with tools, each choice's answer to its end: a call or text
        results = []
        try:
            event = first
            while event is not None:
                index = getattr(event, event.WhichOneof("event")).index
                if event.HasField("chunk") and tools:
                    held[index].add(event.chunk)
                elif event.HasField("chunk"):
                    if event.chunk.text or (asked and event.chunk.logprobs):
                        await out.send(index, {"content": event.chunk.text}, logprobs=event.chunk.logprobs)
                else:
                    results.append(event.result)
                    await out.end(index, event.result, held[index] if tools else None, tools)
                event = await anext(events, None)
            if usage_in_stream and results:
                await out.usage(results)
        except Exception as err:  # after the stream began: an error event, as OpenAI's servers send
            if isinstance(err, ConnectionError):  # the client left: nobody reads an error event
                raise
            await out.error(err)
        await out.close()
        return response


@dataclass
class _Held:
    """A choice's text and log-probabilities, held to its end (a tool call, or text)."""
    text: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)

    def add(self, chunk: pb.Chunk) -> None:
        self.text.append(chunk.text)
        self.logprobs.extend(chunk.logprobs)


class _EventStream:
    """One streamed answer: server-sent events in OpenAI's chunk shape, then [DONE]."""

    def __init__(self, front: OpenAIFront, response: web.StreamResponse, chat: bool, asked: bool):
        self.front, self.response, self.chat, self.asked = front, response, chat, asked
        self.head = front._head(chat, chunk=True)

    async def write(self, event: dict) -> None:
        await self.response.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())

    async def send(self, index: int, delta: dict | None = None, finish=None, extra=None, logprobs=()) -> None:
        choice = {"index": index, "finish_reason": finish}
        logprobs = self.front._logprobs(logprobs, self.chat) if self.asked else None
        if self.chat:
            choice["delta"] = delta or {}
            if self.asked:
                choice["logprobs"] = logprobs
        else:
            choice.update(text=(delta or {}).get("content", ""), logprobs=logprobs)
        await self.write({**self.head, "choices": [choice], **(extra or {})})

    async def open(self, choices: int, echo: Echo | None) -> None:
        if self.chat:
            for index in range(choices):
                await self.send(index, {"role": "assistant", "content": ""})
        if echo is not None:  # without logprobs (refused streamed with them): the prompt's text first
            for index in range(choices):
                await self.send(index, {"content": echo.text})

    async def end(self, index: int, result: pb.Result, held: _Held | None, tools: set[str] | None) -> None:
        """A choice's result: its held answer (a call or text), then its finish."""
        finish = FINISH.get(result.finish_reason, "stop")
        if held is not None:
            calls = _calls("".join(held.text), tools, result)
            if calls:
                finish = "tool_calls"
                await self.send(index, {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]},
                                logprobs=held.logprobs)
            else:
                await self.send(index, {"content": "".join(held.text)}, logprobs=held.logprobs)
        await self.send(index, {}, finish, {"specdec": _stats(result)})

    async def usage(self, results: list[pb.Result]) -> None:
        usage = _usage(results[0])
        usage["completion_tokens"] = sum(r.usage.completion_tokens for r in results)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        await self.write({**self.head, "choices": [], "usage": usage})

    async def error(self, err: Exception) -> None:
        if not isinstance(err, Refused):
            log.exception("a streamed answer failed", exc_info=err)
            err = Refused(grpc.StatusCode.INTERNAL, f"the server failed: {type(err).__name__}")
        _, kind = STATUS.get(err.code, (500, "api_error"))
        await self.write({"error": {"message": err.message, "type": kind, "code": err.code.name.lower()}})

    async def close(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()


TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _tools(body: dict, generate: pb.GenerateRequest) -> set[str] | None:
    """OpenAI's tools and tool_choice: the tools described to the model in a system message
    first, and its answer constrained to a call of one of them ({"name", "arguments"} under
    its parameters' schema) where tool_choice is "required" or names one, to a call or
    text not starting with "{" where it is "auto" (the default). -> the callable names, or
    None where no tool may be called."""
    tools = _field(body, "tools", list)
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "tool_choice: names a tool, but tools is empty",
                          "tool_choice")
        return None
    if generate.constraint.WhichOneof("kind"):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "tools: not with response_format", "tools")
    specs = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        parameters = function.get("parameters", {"type": "object", "properties": {}}) if function else None
        if not isinstance(name, str) or not TOOL_NAME.match(name) or not isinstance(parameters, dict):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"tools[{i}]: a function with a name (letters, digits, "
                                                            f"_ or -, at most 64) and parameters (a JSON schema)",
                          f"tools[{i}]")
        specs[name] = function
    if choice == "none":
        return None
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        named = function.get("name") if isinstance(function, dict) else None
        if named not in specs:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "tool_choice: must name one of the tools", "tool_choice")
        specs = {named: specs[named]}
    elif choice not in (None, "auto", "required"):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, 'tool_choice: "none", "auto", "required" or a function',
                      "tool_choice")
    described = "\n".join(json.dumps({"name": n, "description": f.get("description", ""),
                                      "parameters": f.get("parameters", {})}) for n, f in specs.items())
    given = [pb.ChatMessage(role=m.role, content=m.content) for m in generate.chat.messages]
    del generate.chat.messages[:]
    generate.chat.messages.add(role="system", content="You can call these functions. To call one, reply with only "
                                                      'a JSON object {"name": ..., "arguments": {...}}.\n' + described)
    generate.chat.messages.extend(given)
    calls = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                        "properties": {"name": {"const": n}, "arguments": f.get("parameters",
                                                                               {"type": "object"})}}
                       for n, f in specs.items()]}
    if choice in (None, "auto"):
        calls = {**grammar.closed(calls, "tools"), "x-guidance": JSON_SHAPE}  # as a json_schema constraint is
        generate.constraint.lark = f"start: call | text\ncall: %json {json.dumps(calls)}\ntext: /[^{{][\\s\\S]*/\n"
    else:
        generate.constraint.json_schema = json.dumps(calls)
    return set(specs)


def _said_calls(calls, content, where: str) -> str:
    """An earlier assistant turn's tool calls as the model writes a call (the answer's
    constraint), one a line, after any text it said."""
    if not isinstance(calls, list) or not calls:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}.tool_calls: a non-empty list", f"{where}.tool_calls")
    lines = [content] if isinstance(content, str) and content else []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) and call.get("type", "function") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        try:
            arguments = json.loads(function.get("arguments", "{}")) if isinstance(function, dict) else None
        except (TypeError, ValueError):
            arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}.tool_calls[{j}]: a function with a name and "
                                                            "arguments (a JSON object, as text)",
                          f"{where}.tool_calls[{j}]")
        lines.append(json.dumps({"name": name, "arguments": arguments}))  # the separators JSON_SHAPE asks for
    return "\n".join(lines)


def _calls(text: str, tools: set[str] | None, result: pb.Result) -> list[dict]:
    """The tool call in a finished answer, in OpenAI's shape; [] for a text answer."""
    if not tools or result.finish_reason == pb.FINISH_REASON_LENGTH or not text.startswith("{"):
        return []
    try:  # the constraint made it a call of one of the tools, unless a stop string cut it
        call = json.loads(text)
    except ValueError:
        return []
    if not isinstance(call, dict) or call.get("name") not in tools or not isinstance(call.get("arguments"), dict):
        return []
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]


def _logprob_fields(body: dict, request: pb.GenerateRequest, chat: bool) -> None:
    """Completions' `logprobs` is the number of top tokens; chat's a flag, with
    `top_logprobs` the number."""
    if chat:
        request.logprobs = bool(_field(body, "logprobs", bool, False))
        request.top_logprobs = _integer(body, "top_logprobs", 0, INT32, 0)
        return
    top = _integer(body, "logprobs", 0, INT32)
    if top is not None:
        request.logprobs, request.top_logprobs = True, top


def _logit_bias(body: dict, request: pb.GenerateRequest) -> None:
    for token, value in _field(body, "logit_bias", dict, {}).items():
        if not (isinstance(token, str) and token.isascii() and token.isdigit() and len(token) <= 9) \
                or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "logit_bias: maps token ids (as strings) to numbers",
                          "logit_bias")
        request.logit_bias[int(token)] = float(value)


def _stops(body: dict, request: pb.GenerateRequest) -> None:
    stop = _field(body, "stop", (str, list))
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stops):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "stop: strings only", "stop")
    request.stop.extend(stops)


def _same(value, default) -> bool:
    """value == default, where a bool equals only a bool (True is not the 1 of best_of)."""
    return value == default and isinstance(value, bool) == isinstance(default, bool)


def _constraint(body: dict, request: pb.GenerateRequest) -> None:
    """response_format: text (no constraint), json_object, or json_schema (its `schema`;
    `strict` or not, the output follows the schema)."""
    form = _field(body, "response_format", dict)
    if form is None:
        return
    kind = form.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        request.constraint.json_object = True
        return
    if kind != "json_schema":
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "response_format.type: one of text, json_object, json_schema",
                      "response_format.type")
    spec = form.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "response_format.json_schema.schema: a JSON schema object",
                      "response_format.json_schema.schema")
    request.constraint.json_schema = json.dumps(schema)


def _usage(result: pb.Result) -> dict:
    return {"prompt_tokens": result.usage.prompt_tokens, "completion_tokens": result.usage.completion_tokens,
            "total_tokens": result.usage.prompt_tokens + result.usage.completion_tokens}


def _stats(result: pb.Result) -> dict:
    s = result.stats
    return {"rounds": s.rounds, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": round(s.acceptance_rate, 6), "accepted_per_position": list(s.accepted_per_position),
            "resyncs": s.resyncs, "drafter_failovers": s.drafter_failovers}


async def serve(app: web.Application, host: str, port: int, ssl_context=None, grace_s: float = 30.0
                ) -> web.AppRunner:
    """The front on host:port. A request whose client leaves is cancelled (its generation
    stops and frees what it holds); at cleanup, requests in flight get `grace_s`."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=grace_s)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    log.info("OpenAI-compatible API on http%s://%s:%d/v1", "s" if ssl_context else "", host, port)
    return runner
