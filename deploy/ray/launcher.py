"""Launching specdec on Ray, locally (`ray.init()`) or on an existing cluster
(`address=`): M verifier replicas (each with a GPU when the cluster has one) and N
drafter replicas (CPUs), each set under its controller, and the orchestrator, which
follows both controllers."""

import logging
import time
from dataclasses import dataclass

import ray

from deploy import launch
from deploy.ray.actors import ReplicaController, ServiceActor
from specdec.runtime import modeling

log = logging.getLogger("specdec.ray")


class PlacementError(RuntimeError):
    """The cluster cannot hold the deployment as asked."""


def local_cpus(total: float, num_verifiers: int = 1) -> dict[str, float]:
    """CPU requests on a local Ray: the deployment shares this machine's cores (the
    drafters and the orchestrator are light beside the verifiers, which share half of
    them), so that the default deployment with up to three drafters fits on 2 cores. On
    a cluster each asks for 1."""
    return {"verifier": min(1.0, total / 2) / num_verifiers, "drafter": min(0.25, total / 8),
            "orchestrator": min(0.25, total / 8)}


def check_placement(actors: list[tuple[str, dict[str, float]]]) -> None:
    """Fails at once, naming the actor and what it asks for, when the cluster's free
    resources cannot hold the actors in order (rather than leaving one pending forever)."""
    free = ray.available_resources()
    total = ray.cluster_resources()
    placed: list[str] = []
    for name, asks in actors:
        for resource, amount in asks.items():
            if amount <= 0:
                continue
            if free.get(resource, 0.0) + 1e-9 < amount:
                raise PlacementError(
                    f"cannot place the {name}: it asks for {amount:g} {resource}; the cluster has "
                    f"{total.get(resource, 0.0):g} {resource} in all and {max(0.0, free.get(resource, 0.0)):g} free"
                    + (f" after {', '.join(placed)}" if placed else "")
                    + " (ask for less: --verifier-cpus, --drafter-cpus, --orchestrator-cpus, --num-drafters, "
                      "--num-verifiers)")
            free[resource] = free.get(resource, 0.0) - amount
        placed.append(name)


@dataclass
class RayDeployment:
    verifier_controller: object
    controller: object  # the drafters'
    orchestrator: object
    address: str  # the orchestrator's Generate endpoint
    admin_address: str  # its admin service, on loopback of the orchestrator's node

    def scale_drafters(self, replicas: int) -> int:
        return ray.get(self.controller.scale.remote(replicas))

    def drafter_addresses(self) -> list[str]:
        return ray.get(self.controller.addresses.remote())

    def drafters(self) -> list:
        return ray.get(self.controller.replicas_now.remote())

    def scale_verifiers(self, replicas: int) -> int:
        return ray.get(self.verifier_controller.scale.remote(replicas))

    def verifier_addresses(self) -> list[str]:
        return ray.get(self.verifier_controller.addresses.remote())

    def verifiers(self) -> list:
        return ray.get(self.verifier_controller.replicas_now.remote())

    def down(self) -> None:
        actors = [self.orchestrator]
        for controller in (self.controller, self.verifier_controller):
            try:
                actors += ray.get(controller.replicas_now.remote(), timeout=10)
            except Exception:  # the controller is gone or stuck: its replicas go with it (they are its own)
                pass
            actors.append(controller)
        for actor in actors:
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


def up(target: str, draft: str = modeling.DEFAULT_DRAFT, num_drafters: int = 1, *, num_verifiers: int = 1,
       port: int = 50051,
       address: str | None = None, namespace: str = "specdec", verifier_gpus: str | float = "auto",
       verifier_cpus: float | None = None, drafter_cpus: float | None = None,
       orchestrator_cpus: float | None = None, dtype: str = "float32", device: str | None = None,
       drafter_device: str | None = None, drafter_dtype: str | None = None,
       verifier_flags: list[str] = (), drafter_flags: list[str] = (), orchestrator_flags: list[str] = (),
       refresh_s: float = 0.5, drain_s: float = 3.0, autoscale: dict | None = None,
       autoscale_verifiers: dict | None = None, name: str = "specdec",
       startup_timeout_s: float = 600, admin_port: int = 50050) -> RayDeployment:
    """Starts the deployment and returns once every service is serving. Its actors are
    named `{name}-verifier-controller`, `{name}-verifier-<incarnation>-<i>`,
    `{name}-drafter-controller`, `{name}-drafter-<incarnation>-<i>`, `{name}-orchestrator`; on a cluster the orchestrator runs on the head node (where
    a Kubernetes Service can reach it), its admin service on that node's loopback at
    `admin_port`.

    CPU requests left unset are `local_cpus` on a local Ray and 1 each on a cluster; a
    deployment the cluster cannot hold raises PlacementError before any actor starts.
    autoscale: {"min": 1, "max": 4, "target_sessions": 4, "cooldown_s": 30} turns the
    orchestrator's drafter autoscaler on; autoscale_verifiers (the same keys, target_sessions
    16 by default) its verifier autoscaler."""
    if drafter_device not in (None, "cpu"):
        raise PlacementError(f"--drafter-device {drafter_device}: Ray's drafter actors ask for CPUs only")
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
    device = device or ("cuda" if verifier_gpus else "cpu")
    sized = local_cpus(ray.cluster_resources().get("CPU", 1.0), max(1, num_verifiers)) if not on_cluster else {}
    verifier_cpus = sized.get("verifier", 1.0) if verifier_cpus is None else verifier_cpus
    drafter_cpus = sized.get("drafter", 1.0) if drafter_cpus is None else drafter_cpus
    orchestrator_cpus = sized.get("orchestrator", 1.0) if orchestrator_cpus is None else orchestrator_cpus
    if num_verifiers < 1:
        raise PlacementError(f"num_verifiers must be >= 1, got {num_verifiers}")
    check_placement([*[(f"verifier actor {i + 1}", {"CPU": verifier_cpus, "GPU": verifier_gpus})
                       for i in range(num_verifiers)],
                     *[(f"drafter actor {i + 1}", {"CPU": drafter_cpus}) for i in range(num_drafters)],
                     ("orchestrator actor", {"CPU": orchestrator_cpus})])

    # Any free port, as drafters: two replicas may share a node, and the orchestrator asks
    # the controller where they listen (again after a restart: a new node, a new port).
    verifier_controller = ray.remote(ReplicaController).options(
        name=f"{name}-verifier-controller", num_cpus=0, max_restarts=3).remote(
        name, "verifier", ["--host", host, "--port", "0", "--model", target, "--dtype", dtype, "--device", device,
                           *verifier_flags], verifier_cpus, verifier_gpus, drain_s, num_verifiers)
    proposer = ["--proposer", "ngram"] if draft == "ngram" else [  # the model's proposer: drafter_flags
        "--model", draft, "--dtype", launch.drafter_dtype_for(dtype, "cpu", drafter_dtype),
        "--device", "cpu"]  # drafter actors ask for CPUs
    controller_name = f"{name}-drafter-controller"
    controller = ray.remote(ReplicaController).options(name=controller_name, num_cpus=0, max_restarts=3).remote(
        name, "drafter", ["--host", host, "--port", "0", *proposer, *drafter_flags], drafter_cpus, 0, drain_s,
        num_drafters)

    argv = ["--host", host, "--port", str(port), "--admin-port", str(admin_port),
            "--verifier-ray", f"{name}-verifier-controller", "--tokenizer", target,
            "--drafter-ray", controller_name, "--ray-namespace", namespace,
            "--drafter-refresh-interval", str(refresh_s), *orchestrator_flags]
    if autoscale:
        argv += ["--autoscale", "--autoscale-min-replicas", str(autoscale.get("min", 1)),
                 "--autoscale-max-replicas", str(autoscale.get("max", 4)),
                 "--autoscale-target-sessions", str(autoscale.get("target_sessions", 4)),
                 "--autoscale-cooldown", str(autoscale.get("cooldown_s", 30))]
    if autoscale_verifiers:
        argv += ["--autoscale-verifiers",
                 "--autoscale-verifiers-min-replicas", str(autoscale_verifiers.get("min", 1)),
                 "--autoscale-verifiers-max-replicas", str(autoscale_verifiers.get("max", 4)),
                 "--autoscale-verifiers-target-sessions", str(autoscale_verifiers.get("target_sessions", 16)),
                 "--autoscale-cooldown", str(autoscale_verifiers.get("cooldown_s", 30))]
    orchestrator = ray.remote(ServiceActor).options(
        name=f"{name}-orchestrator", num_cpus=orchestrator_cpus, max_restarts=3,
        resources={"node:__internal_head__": 0.001} if on_cluster else {},
    ).remote("orchestrator", argv)
    verifiers = ray.get(verifier_controller.replicas_now.remote())
    wait_serving({**{f"verifier {i + 1}": v for i, v in enumerate(verifiers)}, "orchestrator": orchestrator},
                 startup_timeout_s)
    return RayDeployment(verifier_controller, controller, orchestrator, ray.get(orchestrator.address.remote()),
                         f"127.0.0.1:{admin_port}")
