"""`--log-format json`: every line a service logs is one JSON object, and the lines of a
request's work carry its request id and session id on all three services."""

import json
import subprocess

import grpc

from cluster import drafter, generate, orchestrator, pb, verifier
from deploy.launch import stop, wait_serving
from specdec.api.orchestrator.v1 import orchestrator_pb2_grpc


def test_json_logs_carry_the_request_and_session_on_every_service(tiny_pair, tmp_path, smol_tokenizer):
    target_dir, draft_dir, _ = tiny_pair
    json_logs = ["--log-format", "json"]
    v = verifier(target_dir, "json-verifier", extra=json_logs)
    d = drafter(draft_dir, "json-drafter", extra=json_logs)
    o = orchestrator(v, [d], target_dir, "json-orchestrator", extra=json_logs)
    files = {}
    try:
        for service in (v, d, o):
            files[service.name] = open(tmp_path / f"{service.name}.log", "w+")
            service.process = subprocess.Popen(service.argv, stdout=files[service.name], stderr=subprocess.STDOUT)
            if service is d:
                wait_serving([v, d], 180)
        wait_serving([o], 180)
        with grpc.insecure_channel(o.address) as channel:
            ids = smol_tokenizer("Logs that machines can read")["input_ids"]
            _, result = generate(orchestrator_pb2_grpc.OrchestratorServiceStub(channel), request_id="log-me \u00e9",
                                 token_ids=pb.TokenIds(ids=ids), max_new_tokens=12, num_speculative_tokens=3)
            assert result.request_id == "log-me \u00e9"
    finally:
        stop([s for s in (v, d, o) if s.process])
    sessions = set()
    for name, f in files.items():
        f.seek(0)
        lines = [json.loads(line) for line in f.read().splitlines() if line.startswith("{")]
        assert lines and all({"time", "level", "service", "logger", "message"} <= set(line) for line in lines), name
        mine = [line for line in lines if line.get("request_id", "").startswith("log-me")]
        assert mine, f"{name} logged nothing for the request"
        assert all(line.get("session_id") for line in mine), name
        sessions |= {line["session_id"] for line in mine}
        f.close()
    assert len(sessions) == 1  # one session id, minted by the orchestrator, on all three services
