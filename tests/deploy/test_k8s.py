"""The Kubernetes manifests: they render, validate offline against the Kubernetes
schemas, fit the code (names, ports, flags), and their commands really run the system."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml

from cluster import chat_ids, generate, pb, reference
from specdec import flags
from specdec.runtime import modeling
from specdec.runtime.quantize import quantize
from deploy.launch import HOST, Service, free_port, stop, wait_serving
from specdec.api.orchestrator.v1 import orchestrator_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ["cpu", "gpu", "cpu-tls"]
KUBERNETES_VERSION = "1.32.0"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize)")


def render(overlay: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)],
                         capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs, kind) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def environment(c: dict, docs) -> dict[str, str]:
    """A container's environment as Kubernetes would set it (envFrom, then env)."""
    configmaps = by_kind(docs, "ConfigMap")
    env = {}
    for source in c.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]]["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", [])})
    return env


def parsers():
    from drafter_service.server import build_parser as drafter
    from orchestrator.server import build_parser as orchestrator
    from verifier_service.server import build_parser as verifier

    return {"specdec-verifier": verifier(), "specdec-drafter": drafter(), "specdec-orchestrator": orchestrator()}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renders_and_validates(overlay):
    docs = render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    for kind in ("Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler", "PodDisruptionBudget"):
        assert kind in kinds
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_structure_fits_the_code(overlay):
    docs = render(overlay)
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    scripts = parsers()
    assert set(deployments) == {"specdec-verifier", "specdec-drafter", "specdec-orchestrator"}
    ports = {}
    for name, deployment in deployments.items():
        spec = deployment["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), name
        c = container(deployment)
        (command,) = c["command"]
        assert command == name, "the container runs its own service's console script"
        env = environment(c, docs)
        own = {e["name"] for e in c["env"]}
        assert own <= flags.env_names(scripts[command]), f"{name} sets variables its flags do not read"
        (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "grpc"]
        role = name.removeprefix("specdec-").upper()
        assert env[f"SPECDEC_{role}_PORT"] == str(port)
        assert env[f"SPECDEC_{role}_HOST"] == "0.0.0.0"
        # SIGTERM drains calls in flight for the service's grace, and Kubernetes waits longer than that.
        assert float(env[f"SPECDEC_{role}_SHUTDOWN_GRACE"]) < spec["template"]["spec"]["terminationGracePeriodSeconds"]
        # grpc.health.v1 on the service port, or on the plaintext health port under TLS (the probes speak no TLS).
        health_port = int(env.get(f"SPECDEC_{role}_HEALTH_PORT", port))
        assert (health_port != port) == (f"SPECDEC_{role}_TLS_CERT" in env), name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == health_port, (name, probe)
        # Prometheus finds the metrics port from the pod's annotations.
        annotations = spec["template"]["metadata"]["annotations"]
        (metrics_port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == metrics_port == int(env[f"SPECDEC_{role}_METRICS_PORT"])
        # Every file a variable names lies in a volume the container mounts.
        mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
        volumes = {v["name"] for v in spec["template"]["spec"].get("volumes", [])}
        assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, name
        for key, value in env.items():
            if key.endswith(("_CERT", "_KEY", "_CA", "_FILE")):
                assert any(value.startswith(m + "/") for m in mounts), (name, key, value)
        security = c["securityContext"]
        assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
        assert spec["template"]["spec"]["securityContext"]["runAsNonRoot"]
        ports[name] = port
        # GPUs only in the verifier's limits.
        resources = c["resources"]
        assert "nvidia.com/gpu" not in resources.get("requests", {})
        if name != "specdec-verifier":
            assert "nvidia.com/gpu" not in resources.get("limits", {})
    gpu = container(deployments["specdec-verifier"])["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert gpu == (1 if overlay == "gpu" else None)

    for name, service in services.items():
        target = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= target.items()
        (port,) = service["spec"]["ports"]
        assert port["port"] == ports[name] and port["targetPort"] == "grpc"
    for name in ("specdec-drafter", "specdec-verifier"):  # headless: one address per replica
        assert services[name]["spec"]["clusterIP"] == "None", name
    assert deployments["specdec-verifier"]["spec"]["replicas"] >= 2

    # The shared ConfigMap holds only variables some service reads (a typo would be ignored).
    read = set().union(*(flags.env_names(p) for p in scripts.values()))
    for configmap in by_kind(docs, "ConfigMap").values():
        assert set(configmap["data"]) <= read, set(configmap["data"]) - read

    env = environment(container(deployments["specdec-orchestrator"]), docs)
    assert env["SPECDEC_VERIFIER_DNS"] == f"specdec-verifier:{ports['specdec-verifier']}"
    assert env["SPECDEC_DRAFTER_DNS"] == f"specdec-drafter:{ports['specdec-drafter']}"

    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"]["name"] == "specdec-drafter"
    budgets = {}
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        selected = pdb["spec"]["selector"]["matchLabels"]
        (name,) = [n for n, d in deployments.items() if selected.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        budgets[name] = pdb["spec"]
    # A voluntary disruption (a node drain) leaves a verifier serving.
    assert budgets["specdec-verifier"]["maxUnavailable"] < deployments["specdec-verifier"]["spec"]["replicas"]


def test_dockerfile_installs_what_the_manifests_run():
    dockerfile = (ROOT / "deploy/docker/Dockerfile").read_text()
    for path in ("specdec", "drafter_service", "verifier_service", "orchestrator", "pyproject.toml"):
        assert f"COPY {path} " in dockerfile
        assert (ROOT / path).exists()
    pyproject = (ROOT / "pyproject.toml").read_text()
    for script in parsers():
        assert f"{script} = " in pyproject


@pytest.fixture(scope="module")
def default_target():
    """The target alone with the numerics the manifests give the verifier (auto: on a CPU,
    the default target's own GGUF blocks)."""
    model, tokenizer = modeling.load_model(modeling.DEFAULT_TARGET)
    docs = render("cpu")
    env = environment(container(by_kind(docs, "Deployment")["specdec-verifier"]), docs)
    return quantize(model, env["SPECDEC_VERIFIER_QUANTIZE"]), tokenizer


def test_cpu_overlay_commands_serve_generate(default_target):
    """Each container's command and environment, run as local processes, the verifier
    twice: ports mapped to free loopback ports, the Service names mapped to those
    addresses. (The headless verifier Service's name would resolve to both pods; two
    processes on one loopback address cannot share a port, so the orchestrator gets
    their two addresses as a list.)"""
    docs = render("cpu")
    deployments = by_kind(docs, "Deployment")
    names = ("specdec-verifier", "specdec-verifier", "specdec-drafter", "specdec-orchestrator")
    services = [Service(name, free_port(), []) for name in names]
    # "specdec-verifier:50053" (a Service name and port) -> "127.0.0.1:<free port>,..."
    local = {}
    for s in services:
        key = f"{s.name}:{container(deployments[s.name])['ports'][0]['containerPort']}"
        local[key] = ",".join(filter(None, [local.get(key), s.address]))
    envs, admin_port = [], free_port()
    for service in services:
        c = container(deployments[service.name])
        env = {key: local.get(value, value) for key, value in environment(c, docs).items()}
        if "SPECDEC_VERIFIER_DNS" in env:
            env["SPECDEC_VERIFIER_ADDRESSES"] = env.pop("SPECDEC_VERIFIER_DNS")
        role = service.name.removeprefix("specdec-").upper()
        env[f"SPECDEC_{role}_HOST"], env[f"SPECDEC_{role}_PORT"] = HOST, str(service.port)
        env["SPECDEC_ORCHESTRATOR_ADMIN_PORT"] = str(admin_port)  # on loopback
        env[f"SPECDEC_{role}_METRICS_PORT"] = str(free_port())
        service.argv = [str(Path(sys.executable).parent / c["command"][0]), *c.get("args", [])]
        envs.append({**os.environ, **env})
    try:
        for service, env in zip(services, envs):
            service.process = subprocess.Popen(service.argv, env=env)
        wait_serving(services, 300)
        model, tokenizer = default_target
        question = "Name a primary color."
        want = reference(model, chat_ids(tokenizer, question), 16)
        with grpc.insecure_channel(services[-1].address) as channel:
            _, result = generate(orchestrator_pb2_grpc.OrchestratorServiceStub(channel),
                                 chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=question)]),
                                 max_new_tokens=16)
            assert list(result.token_ids) == want
        with grpc.insecure_channel(f"{HOST}:{admin_port}") as channel:
            listing = orchestrator_pb2_grpc.OrchestratorAdminServiceStub(channel).ListVerifiers(
                pb.ListVerifiersRequest(), timeout=5)
        assert sorted(r.address for r in listing.replicas) == sorted(s.address for s in services[:2])
    finally:
        stop(services)
