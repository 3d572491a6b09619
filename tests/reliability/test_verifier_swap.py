"""A verifier that comes back serving another model: the orchestrator notices (on the
reconnect, or at its next check), refuses requests with FAILED_PRECONDITION naming the
problem and reports NOT_SERVING, and takes requests again, exact, once the target is back.
(It used to check the pair only at start, and sent the new model the old one's tokens.)"""

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import generate, orchestrator, pb, reference, verifier


def health(service) -> int:
    with grpc.insecure_channel(service.address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="specdec.orchestrator.v1.OrchestratorService"), timeout=5).status


def wait_for(condition, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_a_verifier_back_with_another_model_is_refused_until_the_target_returns(shared_cluster, tiny_pair,
                                                                                micro_pair, smol_tokenizer):
    target_dir = tiny_pair[0]
    v = verifier(target_dir, "swapped-verifier")
    shared_cluster.start(v)
    o = orchestrator(v, [shared_cluster.roles["model-drafter"]], target_dir, "orchestrator-of-swapped",
                     extra=["--drafter-refresh-interval", "1"])
    shared_cluster.start(o)
    stub = shared_cluster.orchestrator_stub(o)
    ids = smol_tokenizer("The verifier may change under us")["input_ids"]
    want = reference(tiny_pair[2], ids, 20)
    assert list(generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=20)[1].token_ids) == want

    shared_cluster.kill(v)
    other = verifier(micro_pair[0], "other-model-verifier", port=v.port)
    shared_cluster.start(other)
    wait_for(lambda: health(o) == health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=20)
        raise AssertionError("a request went to a verifier serving another model")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "does not match the verifier's model" in err.details()

    shared_cluster.kill(other)
    back = verifier(target_dir, "verifier-back", port=v.port)
    shared_cluster.start(back)
    wait_for(lambda: health(o) == health_pb2.HealthCheckResponse.SERVING)
    assert list(generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=20)[1].token_ids) == want
