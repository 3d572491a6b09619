"""The KubeRay manifest: no CRD schema is available offline, so its structure is checked
here (and the plain Kubernetes objects validate against the schemas): the entrypoint is
a real `specdec ray up` command line, the GPU sits only in the GPU worker group, the
Service reaches the orchestrator's port on the head, versions and images match."""

import re
import shlex
from pathlib import Path

import kubernetes_validate
import yaml

from deploy.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [d for d in yaml.safe_load_all((ROOT / "deploy/ray/kuberay.yaml").read_text()) if d]


def test_objects():
    kinds = [(d["apiVersion"], d["kind"]) for d in DOCS]
    assert kinds == [("ray.io/v1", "RayJob"), ("v1", "Service")]
    kubernetes_validate.validate(DOCS[1], "1.32.0", strict=True)


def test_entrypoint_is_a_real_command():
    argv = shlex.split(DOCS[0]["spec"]["entrypoint"])
    assert argv[0] == "specdec"
    args = build_parser().parse_args(argv[1:])  # exits on an unknown flag
    assert (args.command, args.ray_command, args.address) == ("ray", "up", "auto")
    service_port = DOCS[1]["spec"]["ports"][0]
    head = DOCS[0]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    (head_container,) = head["spec"]["containers"]
    grpc_port = {p["name"]: p["containerPort"] for p in head_container["ports"]}["grpc"]
    assert args.port == grpc_port and service_port["targetPort"] == "grpc"
    assert DOCS[1]["spec"]["selector"].items() <= head["metadata"]["labels"].items()


def test_gpu_only_in_the_gpu_group_and_versions_match():
    spec = DOCS[0]["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g["template"]["spec"]["containers"][0] for g in spec["workerGroupSpecs"]}
    assert groups["gpu"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in groups["cpu"]["resources"].get("limits", {})
    assert "nvidia.com/gpu" not in spec["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"].get(
        "limits", {})
    pinned = re.search(r'"ray==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert spec["rayVersion"] == pinned
    images = {c["image"] for c in groups.values()} | {
        spec["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]}
    assert images == {"specdec:0.1.0-ray"}
    assert "PIP_EXTRAS" in (ROOT / "deploy/docker/Dockerfile").read_text()
