"""Real service processes on loopback for end-to-end tests."""

import os
import time
import sys

import grpc
import torch

from specdec.runtime.quantize import quantize
from deploy.launch import DRAFTER_THREADS, HOST, VERIFIER_THREADS, Service, free_port, start, stop, wait_serving
from specdec.api.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc
from specdec.api.verifier.v1 import verifier_pb2, verifier_pb2_grpc

PY = [sys.executable, "-m"]

# Prompts of different lengths and kinds, for many requests at once.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Shopping list: eggs, milk, bread, eggs, milk,",
    "Once upon a time, in a land far away, there lived",
    "Q: What is 2 + 2?\nA:",
    "A long time ago in a galaxy far, far away, a small band of rebels fought an empire whose",
]

# The numerics the services and the references run with. The default run is fp32 on the
# CPU; the gpu and int8 suites run the exactness tests again under others.
DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")
QUANTIZE = os.environ.get("SPECDEC_TEST_QUANTIZE", "none")
NUMERICS = ["--device", DEVICE, "--quantize", QUANTIZE]


def as_tested(model):
    """`model` with the numerics the services under test use."""
    return quantize(model.to(DEVICE), QUANTIZE)


def verifier(model, name="verifier", port=None, extra=()) -> Service:
    # The threads `specdec up` gives the services (the drafter's too): a pass on a thread per
    # core, in each of several services and the tests beside them, stalls on the shared cores.
    port = port or free_port()
    return Service(name, port, [*PY, "verifier_service", "--host", HOST, "--port", str(port), "--model", str(model),
                                *NUMERICS, "--threads", str(VERIFIER_THREADS), *extra])


def drafter(model=None, name="drafter", port=None, proposer="model", extra=()) -> Service:
    port = port or free_port()
    proposer = ["--proposer", proposer, "--model", str(model), *NUMERICS, "--threads", str(DRAFTER_THREADS)] \
        if model else ["--proposer", "ngram"]
    return Service(name, port, [*PY, "drafter_service", "--host", HOST, "--port", str(port), *proposer, *extra])


def orchestrator(verifier: Service | list[Service], drafters: list[Service], tokenizer, name="orchestrator",
                 extra=()) -> Service:
    port, admin_port = free_port(), free_port()
    verifiers = verifier if isinstance(verifier, list) else [verifier]
    return Service(name, port, [*PY, "orchestrator", "--host", HOST, "--port", str(port),
                                "--admin-port", str(admin_port), "--verifiers", ",".join(v.address for v in verifiers),
                                "--drafters", ",".join(d.address for d in drafters),
                                "--tokenizer", str(tokenizer), "--startup-timeout", "120", *extra],
                   admin_port=admin_port)


def eventually(check, timeout_s: float = 15.0, interval_s: float = 0.05):
    """Polls check() until it returns something true (returned) or the deadline passes
    (AssertionError): waiting on the event itself, not a sleep that may be too short or
    pass by luck."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {getattr(check, '__doc__', '') or check}"
        time.sleep(interval_s)
    return result


class Cluster:
    """Starts services, waits until they serve, and stops them all at the end."""

    def __init__(self):
        self.services: list[Service] = []
        self.channels: list[grpc.Channel] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start(self, *services: Service, timeout_s: float = 180) -> None:
        start(list(services), self.env)
        self.services.extend(services)
        wait_serving(list(services), timeout_s)

    def channel(self, service: Service) -> grpc.Channel:
        channel = grpc.insecure_channel(service.address)
        self.channels.append(channel)
        return channel

    def orchestrator_stub(self, service: Service):
        return orchestrator_pb2_grpc.OrchestratorServiceStub(self.channel(service))

    def drafter_stub(self, service: Service):
        return drafter_pb2_grpc.DrafterServiceStub(self.channel(service))

    def verifier_stub(self, service: Service):
        return verifier_pb2_grpc.VerifierServiceStub(self.channel(service))

    def admin_stub(self, orchestrator: Service):
        channel = grpc.insecure_channel(orchestrator.admin_address)
        self.channels.append(channel)
        return orchestrator_pb2_grpc.OrchestratorAdminServiceStub(channel)

    def session_of(self, orchestrator: Service, request_id: str) -> str:
        """The session id the orchestrator minted for the request in flight labelled request_id."""
        listing = self.admin_stub(orchestrator).ListRequests(pb.ListRequestsRequest(), timeout=5)
        (session,) = [r.session_id for r in listing.requests if r.request_id == request_id]
        return session

    def sessions(self, service: Service) -> set[str]:
        """The ids of the sessions a drafter or verifier holds now."""
        if "drafter" in service.name:
            listing = self.drafter_stub(service).ListSessions(drafter_pb2.ListSessionsRequest(), timeout=5)
        else:
            listing = self.verifier_stub(service).ListSessions(verifier_pb2.ListSessionsRequest(), timeout=5)
        return {s.session_id for s in listing.sessions}

    def kv_blocks_used(self, service: Service) -> float:
        """KV blocks the service's sessions hold now, from its metrics (0 without a pool or a
        metrics port)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        if not service.metrics_port:
            return 0.0
        text = urllib.request.urlopen(f"http://{HOST}:{service.metrics_port}/metrics", timeout=5).read().decode()
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == "specdec_kv_blocks_used")

    def close_session(self, service: Service, session_id: str) -> bool:
        """Makes a drafter or verifier forget a session (as a restart would)."""
        if "drafter" in service.name:
            return self.drafter_stub(service).CloseSession(drafter_pb2.CloseSessionRequest(session_id=session_id),
                                                           timeout=5).closed
        return self.verifier_stub(service).CloseSession(verifier_pb2.CloseSessionRequest(session_id=session_id),
                                                        timeout=5).closed

    def kill(self, service: Service) -> None:
        service.process.kill()
        service.process.wait()

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        stop(self.services)


def generate(stub, timeout=120, metadata=None, **fields) -> tuple[list[pb.Chunk], pb.Result]:
    """One streamed Generate call: (chunks, result)."""
    chunks, result = [], None
    for event in stub.Generate(pb.GenerateRequest(**fields), timeout=timeout, metadata=metadata):
        if event.HasField("chunk"):
            chunks.append(event.chunk)
        else:
            assert result is None, "more than one result"
            result = event.result
    assert result is not None, "the stream ended without a result"
    return chunks, result


class Stream:
    """A Generate call read in two steps: its first chunk now, the rest by `finish`
    (so a test can break something in between)."""

    def __init__(self, stub, timeout=120, **fields):
        self.call = stub.Generate(pb.GenerateRequest(**fields), timeout=timeout)
        self.events = iter(self.call)
        first = next(self.events)
        assert first.HasField("chunk")
        self.tokens = list(first.chunk.token_ids)

    def finish(self) -> pb.Result:
        result = None
        for event in self.events:
            if event.HasField("chunk"):
                self.tokens.extend(event.chunk.token_ids)
            else:
                result = event.result
        assert result is not None and list(result.token_ids) == self.tokens
        return result


def reference(model, ids: list[int], max_new: int) -> list[int]:
    """The target alone: transformers' greedy generate."""
    out = model.generate(torch.tensor([ids], device=model.device), do_sample=False, max_new_tokens=max_new,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device))
    return out[0, len(ids):].tolist()


def cases(model, tokenizer, prompts: list[str], max_new: int) -> dict[str, tuple[list[int], list[int]]]:
    """prompt -> (its token ids, the target's greedy output)."""
    out = {}
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        out[prompt] = (ids, reference(model, ids, max_new))
    return out


def chat_ids(tokenizer, question: str) -> list[int]:
    """A one-message chat rendered with the model's chat template, as token ids."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


__all__ = ["as_tested", "Cluster", "generate", "verifier", "drafter", "orchestrator", "pb", "drafter_pb2",
           "verifier_pb2", "reference", "Stream", "cases", "chat_ids"]
