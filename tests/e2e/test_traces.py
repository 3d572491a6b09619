"""Traces across the three services: each exports to an OTLP collector (here a real
gRPC receiver in the test, keeping the spans in memory), and one request is one trace:
the client's span -> Generate -> a round per round (K, drafts and accepted as attributes)
-> the drafter's Propose and the verifier's Verify, each a child of its round."""

import time
from concurrent import futures

import grpc
import pytest

pytest.importorskip("opentelemetry.proto")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from cluster import Cluster, drafter, generate, orchestrator, pb, verifier  # noqa: E402
from deploy.launch import free_port  # noqa: E402


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans = []  # (service name, span)

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes
                           if a.key == "service.name")
            for scope in resource_spans.scope_spans:
                self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def attributes(span) -> dict:
    return {a.key: (a.value.string_value or a.value.int_value) for a in span.attributes}


def test_one_request_is_one_trace_across_the_services(tiny_pair, smol_tokenizer):
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    target_dir, draft_dir, _ = tiny_pair
    traced = ["--otlp-endpoint", f"127.0.0.1:{port}"]
    cluster = Cluster()
    cluster.env["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # export every 0.2 s, not 5
    try:
        v, d = verifier(target_dir, "traced-verifier", extra=traced), drafter(draft_dir, "traced-drafter", extra=traced)
        cluster.start(v, d)
        o = orchestrator(v, [d], target_dir, "traced-orchestrator", extra=traced)
        cluster.start(o)
        client_trace, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
        ids = smol_tokenizer("Tracing a request through")["input_ids"]
        _, result = generate(cluster.orchestrator_stub(o), token_ids=pb.TokenIds(ids=ids), max_new_tokens=12,
                             num_speculative_tokens=3, request_id="traced",
                             metadata=[("traceparent", f"00-{client_trace}-{client_span}-01")])
        deadline = time.monotonic() + 20
        while True:
            mine = [(service, s) for service, s in collector.spans if s.trace_id.hex() == client_trace]
            names = {s.name for _, s in mine}
            rounds = [s for _, s in mine if s.name == "round"]
            verifies = [s for _, s in mine if s.name == "verifier.Verify"]
            # Each service exports its spans in its own batches: wait for all of them.
            if {"Generate", "verifier.Verify", "drafter.Propose"} <= names and \
                    len(rounds) == len(verifies) == result.stats.rounds:
                break
            assert time.monotonic() < deadline, f"spans seen: {sorted(names)}"
            time.sleep(0.2)
    finally:
        cluster.close()
        server.stop(0)
    by_id = {s.span_id: (service, s) for service, s in mine}
    (generate_span,) = [s for _, s in mine if s.name == "Generate"]
    assert generate_span.parent_span_id.hex() == client_span  # the client's trace goes on
    assert attributes(generate_span)["request_id"] == "traced"
    assert sum(attributes(r)["accepted"] for r in rounds) == result.stats.accepted_tokens
    assert all(r.parent_span_id == generate_span.span_id and attributes(r)["k"] >= 0 for r in rounds)
    services = {}
    for service, span in mine:
        if span.name in ("verifier.Verify", "drafter.Propose"):
            parent_service, parent = by_id[span.parent_span_id]
            assert parent.name == "round" and parent_service == "specdec-orchestrator", span.name
            services[span.name] = service
    assert services == {"verifier.Verify": "specdec-verifier", "drafter.Propose": "specdec-drafter"}
    verifies = [s for _, s in mine if s.name == "verifier.Verify"]
    assert len(verifies) == result.stats.rounds  # one Verify per round, each under its own round
    assert len({s.parent_span_id for s in verifies}) == len(verifies)
