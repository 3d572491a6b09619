"""Launching specdec on Ray, locally (`ray.init()`) or on an existing cluster
(`address=`): the verifier (with a GPU when the cluster has one), N drafter replicas
(CPUs) under the controller, and the orchestrator, which follows the controller."""

import logging
import time
from dataclasses import dataclass

import ray

from deploy.ray.actors import DrafterController, ServiceActor
from specdec import modeling
from specdec.launch import free_port

log = logging.getLogger("specdec.ray")


@dataclass
class RayDeployment:
    verifier: object
    controller: object
    orchestrator: object
    address: str  # the orchestrator's Generate endpoint

    def scale_drafters(self, replicas: int) -> int:
        return ray.get(self.controller.scale.remote(replicas))

    def drafter_addresses(self) -> list[str]:
        return ray.get(self.controller.drafter_addresses.remote())

    def drafters(self) -> list:
        return ray.get(self.controller.replicas_now.remote())

    def down(self) -> None:
        for replica in self.drafters():
            ray.kill(replica, no_restart=True)
        for actor in (self.orchestrator, self.controller, self.verifier):
            ray.kill(actor, no_restart=True)


def wait_serving(actors: dict, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = dict(actors)
    while pending:
        for name, actor in list(pending.items()):
            if ray.get(actor.serving.remote()):
                log.info("%s serving on %s", name, ray.get(actor.address.remote()))
                del pending[name]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not serving after {timeout_s:.0f} s: {', '.join(pending)}")
        time.sleep(0.5)


def up(target: str, draft: str = modeling.DEFAULT_DRAFT, num_drafters: int = 1, *, port: int = 50051,
       address: str | None = None, namespace: str = "specdec", verifier_gpus: str | float = "auto",
       verifier_cpus: float = 1, drafter_cpus: float = 1, orchestrator_cpus: float = 1,
       dtype: str = "float32", refresh_s: float = 0.5, drain_s: float = 3.0,
       autoscale: dict | None = None, name: str = "specdec",
       startup_timeout_s: float = 600) -> RayDeployment:
    """Starts the deployment and returns once every service is serving. Its actors are
    named `{name}-verifier`, `{name}-drafter-controller`, `{name}-drafter-<i>`,
    `{name}-orchestrator`; on a cluster the orchestrator runs on the head node (where
    a Kubernetes Service can reach it).

    autoscale: {"min": 1, "max": 4, "target_sessions": 4, "cooldown_s": 30} turns the
    orchestrator's drafter autoscaler on."""
    if not ray.is_initialized():
        # A local Ray stays on loopback, like every service of a one-machine deployment.
        ray.init(address=address, namespace=namespace,
                 **({} if address else {"_node_ip_address": "127.0.0.1", "include_dashboard": False}))
    namespace = ray.get_runtime_context().namespace
    on_cluster = address is not None
    host = "0.0.0.0" if on_cluster else "127.0.0.1"
    if verifier_gpus == "auto":
        verifier_gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    verifier_gpus = float(verifier_gpus)
    device = "cuda" if verifier_gpus else "cpu"

    # The verifier keeps its port across a restart: the orchestrator holds its address.
    verifier_port = 50053 if on_cluster else free_port()
    verifier = ray.remote(ServiceActor).options(
        name=f"{name}-verifier", num_cpus=verifier_cpus, num_gpus=verifier_gpus, max_restarts=3,
    ).remote("verifier", ["--host", host, "--port", str(verifier_port), "--model", target, "--dtype", dtype,
                          "--device", device])
    proposer = ["--proposer", "ngram"] if draft == "ngram" else ["--proposer", "model", "--model", draft]
    controller_name = f"{name}-drafter-controller"
    controller = ray.remote(DrafterController).options(name=controller_name, num_cpus=0, max_restarts=3).remote(
        name, ["--host", host, "--port", "0", *proposer], drafter_cpus, 0, drain_s)
    ray.get(controller.scale.remote(num_drafters))

    verifier_address = ray.get(verifier.address.remote())
    argv = ["--host", host, "--port", str(port), "--verifier", verifier_address, "--tokenizer", target,
            "--drafter-ray", controller_name, "--ray-namespace", namespace,
            "--drafter-refresh-interval", str(refresh_s)]
    if autoscale:
        argv += ["--autoscale", "--autoscale-min-replicas", str(autoscale.get("min", 1)),
                 "--autoscale-max-replicas", str(autoscale.get("max", 4)),
                 "--autoscale-target-sessions", str(autoscale.get("target_sessions", 4)),
                 "--autoscale-cooldown", str(autoscale.get("cooldown_s", 30))]
    orchestrator = ray.remote(ServiceActor).options(
        name=f"{name}-orchestrator", num_cpus=orchestrator_cpus, max_restarts=3,
        resources={"node:__internal_head__": 0.001} if on_cluster else {},
    ).remote("orchestrator", argv)
    wait_serving({"verifier": verifier, "orchestrator": orchestrator}, startup_timeout_s)
    return RayDeployment(verifier, controller, orchestrator, ray.get(orchestrator.address.remote()))
