"""Mutual TLS between all services and on Generate, and bearer-token auth on Generate:
certificates from flags, a CA made in the test. A caller without the right certificate
is refused at the handshake; one without the token gets UNAUTHENTICATED; health and
reflection answer without a token; the output is still the target's."""

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from certs import CA
from cluster import Cluster, drafter, generate, orchestrator, pb, reference, verifier
from specdec.api.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from deploy.launch import free_port
from specdec.api.orchestrator.v1 import orchestrator_pb2_grpc

TOKEN = "s3cret-token-for-the-test"


@pytest.fixture(scope="module")
def secured(tiny_pair, tmp_path_factory):
    """(cluster, its services, the test client's credentials, a stranger's credentials)"""
    d = tmp_path_factory.mktemp("tls")
    ca, stranger_ca = CA(d, "specdec"), CA(d, "stranger")
    tokens = d / "tokens"
    tokens.write_text(f"# one token per line\n{TOKEN}\n")

    def serving(name):
        cert, key = ca.issue(name)
        return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(ca.path)]

    client_cert, client_key = ca.issue("test-client")
    ours = grpc.ssl_channel_credentials(ca.path.read_bytes(), client_key.read_bytes(), client_cert.read_bytes())
    stranger_cert, stranger_key = stranger_ca.issue("stranger")
    theirs = grpc.ssl_channel_credentials(ca.path.read_bytes(), stranger_key.read_bytes(),
                                          stranger_cert.read_bytes())
    target_dir, draft_dir, _ = tiny_pair
    health_port = free_port()
    v = verifier(target_dir, "tls-verifier", extra=[*serving("verifier"), "--health-port", str(health_port)])
    dr = drafter(draft_dir, "tls-drafter", extra=serving("drafter"))
    orchestrator_cert, orchestrator_key = ca.issue("orchestrator")
    o = orchestrator(v, [dr], target_dir, "tls-orchestrator", extra=[
        *serving("orchestrator-server"), "--auth-token-file", str(tokens), "--tls-ca", str(ca.path),
        "--tls-client-cert", str(orchestrator_cert), "--tls-client-key", str(orchestrator_key)])
    for service in (v, dr, o):
        service.credentials = ours
    cluster = Cluster()
    cluster.start(v, dr)
    cluster.start(o)
    cluster.health_port, cluster.ca = health_port, ca.path.read_bytes()
    cluster.client_files = ["--tls-ca", str(ca.path), "--tls-cert", str(client_cert), "--tls-key", str(client_key)]
    yield cluster, (v, dr, o), ours, theirs
    cluster.close()


def stub_for(service, credentials):
    channel = grpc.secure_channel(service.address, credentials)
    return orchestrator_pb2_grpc.OrchestratorServiceStub(channel), channel


def test_generate_over_mutual_tls_with_the_token_is_exact(secured, tiny_pair, smol_tokenizer):
    cluster, (_, _, o), ours, _ = secured
    stub, channel = stub_for(o, ours)
    ids = smol_tokenizer("Secure channels carry the same tokens")["input_ids"]
    _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=40, num_speculative_tokens=3,
                         metadata=[("authorization", f"Bearer {TOKEN}")])
    assert list(result.token_ids) == reference(tiny_pair[2], ids, 40)
    assert result.stats.accepted_tokens > 0  # the drafter was reached over mutual TLS too
    channel.close()


@pytest.mark.parametrize("metadata", [None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)],
                                      [("authorization", f"Basic {TOKEN}")]])
def test_generate_without_the_token_is_unauthenticated(secured, metadata):
    cluster, (_, _, o), ours, _ = secured
    stub, channel = stub_for(o, ours)
    for call in (lambda: list(stub.Generate(pb.GenerateRequest(text="hi", max_new_tokens=2), metadata=metadata,
                                            timeout=10)),
                 lambda: stub.Complete(pb.GenerateRequest(text="hi", max_new_tokens=2), metadata=metadata,
                                       timeout=10)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()


def test_health_and_reflection_need_no_token(secured):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    cluster, (_, _, o), ours, _ = secured
    with grpc.secure_channel(o.address, ours) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for answer in answers for s in answer.list_services_response.service}
        assert "specdec.orchestrator.v1.OrchestratorService" in names


def test_the_plaintext_health_port_answers_health_only(secured):
    cluster, (v, _, _), _, _ = secured
    with grpc.insecure_channel(f"127.0.0.1:{cluster.health_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            drafter_pb2_grpc.DrafterServiceStub(channel).GetModelInfo(drafter_pb2.GetModelInfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("who", ["no certificate", "a stranger's certificate", "plaintext"])
def test_callers_without_our_certificate_are_refused(secured, who):
    cluster, (v, dr, o), _, theirs = secured
    ca = grpc.ssl_channel_credentials(cluster.ca)  # trusts the servers, shows no certificate
    credentials = {"no certificate": ca, "a stranger's certificate": theirs, "plaintext": None}[who]
    for service in (o, dr, v):
        channel = grpc.secure_channel(service.address, credentials) if credentials else grpc.insecure_channel(
            service.address)
        with channel:
            with pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), service.name


def test_specdec_generate_speaks_tls_and_token(secured, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    cluster, (_, _, o), _, _ = secured
    cert_args = o.argv[o.argv.index("--tls-ca") + 1:]
    ca, client_cert, client_key = cert_args[0], cert_args[2], cert_args[4]  # the orchestrator's own, as a client
    command = [str(Path(sys.executable).parent / "specdec"), "generate", "--raw", "Hello", "--max-new-tokens", "4",
               "--address", o.address, "--tls-ca", ca, "--tls-cert", client_cert, "--tls-key", client_key]
    done = subprocess.run([*command, "--token", TOKEN], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "4 tokens" in done.stderr, done.stderr
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr, done.stderr


def test_the_admin_commands_bring_the_token_and_certificate(secured):
    """`specdec ray drafters` against an orchestrator that demands both (before, the admin
    commands connected in plain text, with no token)."""
    cluster, (_, dr, o), _, _ = secured
    specdec = [str(Path(sys.executable).parent / "specdec"), "ray", "drafters", "--admin", o.admin_address,
               *cluster.client_files]
    done = subprocess.run([*specdec, "--token", TOKEN], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and dr.address in done.stdout, done.stderr
    done = subprocess.run(specdec, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr
