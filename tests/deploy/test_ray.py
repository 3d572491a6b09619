"""specdec on a real local Ray instance: launch, scale drafters 1 -> 3 -> 1 and verifiers
1 -> 2 -> 1 under a steady stream of requests, a drafter actor, the controller and a
verifier killed and found again, chaos under load, and the autoscaler."""

import random
import subprocess
import sys
from pathlib import Path
import threading
import time

import grpc
import pytest

ray = pytest.importorskip("ray")

from cluster import QUANTIZE, Stream, cases, generate, pb, reference  # noqa: E402
from deploy.launch import free_port  # noqa: E402
from specdec.api.orchestrator.v1 import orchestrator_pb2_grpc  # noqa: E402

# The numerics the references run with (the services' own default is `auto`).
NUMERICS = dict(verifier_flags=["--quantize", QUANTIZE], drafter_flags=["--quantize", QUANTIZE])
PROMPTS = ["The river", "Once there was a robot", "def sort(items):", "Monday, Tuesday,", "Dear friend,"]


@pytest.fixture(scope="module")
def deployment(tiny_pair):
    from deploy.ray import launcher

    # Logical CPUs: two deployments of up to 3 drafters each must fit (the machine has 2 cores).
    ray.init(num_cpus=16, namespace=f"specdec-test-{free_port()}", include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    target_dir, draft_dir, _ = tiny_pair
    started = time.monotonic()
    d = launcher.up(str(target_dir), str(draft_dir), 1, port=free_port(), admin_port=free_port(),
                    startup_timeout_s=180, **NUMERICS)
    print(f"launched on Ray in {time.monotonic() - started:.1f} s")
    yield d
    d.down()
    ray.shutdown()


@pytest.fixture(scope="module")
def stubs(deployment):
    channel, admin = grpc.insecure_channel(deployment.address), grpc.insecure_channel(deployment.admin_address)
    yield (orchestrator_pb2_grpc.OrchestratorServiceStub(channel),
           orchestrator_pb2_grpc.OrchestratorAdminServiceStub(admin))
    channel.close()
    admin.close()


@pytest.fixture(scope="module")
def expected(tiny_pair, smol_tokenizer):
    return cases(tiny_pair[2], smol_tokenizer, PROMPTS, 60)


def wait_for_replicas(admin, n: int, timeout_s: float = 90, listing=None) -> float:
    """Seconds until the orchestrator's pool holds n replicas (drafters, or what `listing` lists)."""
    listing = listing or (lambda: admin.ListDrafters(pb.ListDraftersRequest(), timeout=5))
    started = time.monotonic()
    while len(listing().replicas) != n:
        assert time.monotonic() - started < timeout_s, f"the orchestrator never saw {n} replicas"
        time.sleep(0.2)
    return time.monotonic() - started


def test_generate_through_ray_matches_target(stubs, expected):
    stub, admin = stubs
    for ids, want in expected.values():
        _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=60, num_speculative_tokens=4)
        assert list(result.token_ids) == want
    listing = admin.ListDrafters(pb.ListDraftersRequest())
    assert listing.source == "ray" and len(listing.replicas) == 1


class ClosedLoop:
    """Three clients sending requests back to back (K fixed per client: 0, 1, 2, or chosen
    per round) until stopped: whether each output was the target's, the errors, and each
    request's moves to another verifier replica."""

    def __init__(self, stub, expected, ks=(None, None, None)):
        self.stop, self.results, self.errors, self.moves = threading.Event(), [], [], []
        self.threads = [threading.Thread(target=self.client, args=(stub, expected, i, k)) for i, k in enumerate(ks)]
        for t in self.threads:
            t.start()

    def client(self, stub, expected, i, k):
        while not self.stop.is_set():
            ids, want = expected[PROMPTS[i % len(PROMPTS)]]
            try:
                _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=60,
                                     **({} if k is None else {"num_speculative_tokens": k}))
                self.results.append(list(result.token_ids) == want)
                self.moves.append(result.stats.verifier_moves)
            except grpc.RpcError as err:
                self.errors.append(err)
            i += 1

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        assert not self.errors, self.errors[:3]
        assert len(self.results) >= 10 and all(self.results), (len(self.results), self.results.count(False))


def test_scale_drafters_under_load(stubs, expected):
    stub, admin = stubs
    load = ClosedLoop(stub, expected)
    try:
        time.sleep(1)
        assert admin.ScaleDrafters(pb.ScaleDraftersRequest(replicas=3)).replicas == 3
        print(f"1 -> 3 drafters seen by the orchestrator in {wait_for_replicas(admin, 3):.1f} s")
        time.sleep(2)
        assert admin.ScaleDrafters(pb.ScaleDraftersRequest(replicas=1)).replicas == 1
        print(f"3 -> 1 drafters seen by the orchestrator in {wait_for_replicas(admin, 1):.1f} s")
        time.sleep(5)  # past the drain: the removed replicas are stopped under load
    finally:
        load.finish()


def wait_for_verifiers(admin, n: int) -> float:
    return wait_for_replicas(admin, n, 120, lambda: admin.ListVerifiers(pb.ListVerifiersRequest(), timeout=5))


def test_scale_verifiers_under_load(stubs, expected):
    """1 -> 2 -> 1 verifiers while three clients send requests back to back: every request
    exact, none failed; the second replica takes sessions, and the sessions on the one
    retired move (a resync each) to the other."""
    stub, admin = stubs
    load = ClosedLoop(stub, expected, ks=(0, 1, 2))
    try:
        time.sleep(1)
        assert admin.ScaleVerifiers(pb.ScaleVerifiersRequest(replicas=2)).replicas == 2
        print(f"1 -> 2 verifiers seen by the orchestrator in {wait_for_verifiers(admin, 2):.1f} s")
        deadline = time.monotonic() + 60
        while min(r.routed_by_load + r.routed_by_prefix
                  for r in admin.ListVerifiers(pb.ListVerifiersRequest()).replicas) == 0:
            assert time.monotonic() < deadline, "the new verifier never took a session"
            time.sleep(0.2)
        assert admin.ScaleVerifiers(pb.ScaleVerifiersRequest(replicas=1)).replicas == 1
        print(f"2 -> 1 verifiers seen by the orchestrator in {wait_for_verifiers(admin, 1):.1f} s")
        time.sleep(5)  # past the drain: the removed replica is stopped under load
    finally:
        load.finish()
    assert max(load.moves) <= 1
    print(f"{len(load.results)} requests, {sum(load.moves)} moved to the other verifier")


def test_killed_drafter_actor_comes_back(deployment, stubs, expected, tiny_pair, smol_tokenizer):
    stub, admin = stubs
    wait_for_replicas(admin, 1)
    (replica,) = deployment.drafters()
    (before,) = deployment.drafter_addresses()
    ids = smol_tokenizer(PROMPTS[0] + " flows to the sea and the sea")["input_ids"]
    want = reference(tiny_pair[2], ids, 600)
    stream = Stream(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=600)
    ray.kill(replica, no_restart=False)  # Ray restarts it (max_restarts)
    assert list(stream.finish().token_ids) == want
    # The replica is back, on a new port, and the orchestrator follows it.
    deadline = time.monotonic() + 90
    while True:
        addresses = deployment.drafter_addresses()
        listed = [r.address for r in admin.ListDrafters(pb.ListDraftersRequest()).replicas]
        if addresses and addresses[0] != before and listed == addresses:
            break
        assert time.monotonic() < deadline, (before, addresses, listed)
        time.sleep(0.5)
    _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=40, num_speculative_tokens=4)
    assert list(result.token_ids) == want[:40] and result.stats.accepted_tokens > 0


def test_killed_controller_comes_back_with_its_replicas(deployment, stubs, expected):
    """Its replicas die with it (they are its own); restarted, it starts them again, and
    the orchestrator follows (it used to come back with none: verifier alone, silently)."""
    stub, admin = stubs
    wait_for_replicas(admin, 1)
    (before,) = deployment.drafter_addresses()
    ray.kill(deployment.controller, no_restart=False)
    deadline = time.monotonic() + 120
    while True:
        try:
            addresses = deployment.drafter_addresses()
        except ray.exceptions.RayActorError:
            addresses = []  # restarting
        listed = [r.address for r in admin.ListDrafters(pb.ListDraftersRequest()).replicas]
        if len(addresses) == 1 and addresses != [before] and listed == addresses:
            break
        assert time.monotonic() < deadline, (before, addresses, listed)
        time.sleep(0.5)
    ids, want = expected[PROMPTS[0]]
    _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=60, num_speculative_tokens=4)
    assert list(result.token_ids) == want and result.stats.accepted_tokens > 0


def test_killed_verifier_is_found_again_on_its_new_port(deployment, stubs, expected):
    stub, _ = stubs
    (verifier,) = deployment.verifiers()
    before = ray.get(verifier.address.remote())
    ray.kill(verifier, no_restart=False)
    deadline = time.monotonic() + 180
    while True:
        try:  # a call that meets the actor between incarnations is refused (ActorUnavailableError): again
            if ray.get(verifier.serving.remote(), timeout=10):
                after = ray.get(verifier.address.remote(), timeout=10)
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "the verifier never came back"
        time.sleep(0.5)
    assert after != before  # a new port: only looking it up again finds it
    ids, want = expected[PROMPTS[0]]
    deadline = time.monotonic() + 30
    while True:
        try:
            _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=60, timeout=30)
            break
        except grpc.RpcError as err:  # until the orchestrator's next look-up (0.5 s here)
            assert err.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, err
            time.sleep(0.5)
    assert list(result.token_ids) == want


def test_cli_lists_and_scales(deployment):
    run = lambda *a: subprocess.run([str(Path(sys.executable).parent / "specdec"), "ray", *a, "--admin",
                                     deployment.admin_address], capture_output=True, text=True, timeout=60)
    done = run("scale-drafters", "2")
    assert done.returncode == 0 and "drafter replicas: 2" in done.stdout and "0 pending" in done.stdout, done.stderr
    done = run("drafters")
    assert done.returncode == 0 and "(ray)" in done.stdout
    # Every replica the scale made is listed, or said to be starting (a replica loading its
    # model under load is not "pending": the cluster has room for it).
    listed = int(done.stdout.split(" drafter replicas")[0])
    starting = int(done.stdout.split("and ")[1].split(" starting")[0]) if "starting" in done.stdout else 0
    assert listed + starting == 2, done.stdout
    done = run("verifiers")
    assert done.returncode == 0 and done.stdout.startswith("1 verifier replicas (ray)") and "sessions=" in done.stdout
    done = run("scale-verifiers", "0")
    assert done.returncode == 1 and "INVALID_ARGUMENT" in done.stderr and "replicas" in done.stderr


def test_chaos_under_ray(deployment, stubs, expected):
    """Clients in a closed loop while Ray's actors are killed and restarted by Ray: a
    drafter replica, the verifier, the orchestrator, each in turn after the last one has
    recovered. Every request is exact or fails UNAVAILABLE; none hangs."""
    stub, admin = stubs
    cases_ = list(expected.values())
    stop, lock = threading.Event(), threading.Lock()
    outcomes, wrong, done_at = {}, [], []

    def client(seed):
        rng = random.Random(seed)
        with grpc.insecure_channel(deployment.address) as channel:
            client_stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            while not stop.is_set():
                ids, want = rng.choice(cases_)
                begun = time.monotonic()
                try:
                    _, result = generate(client_stub, timeout=60, token_ids=pb.TokenIds(ids=ids), max_new_tokens=20,
                                         num_speculative_tokens=rng.choice([0, 3]))
                    outcome = "ok"
                except grpc.RpcError as err:
                    outcome, result = err.code().name, None
                with lock:
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                    if result is not None:
                        if list(result.token_ids) != want[:20]:
                            wrong.append(ids)
                        done_at.append((begun, time.monotonic()))
                if outcome != "ok":
                    time.sleep(0.5)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    recovery = {}
    try:
        time.sleep(2)
        for kind in ("drafter", "verifier", "orchestrator"):
            actor = {"drafter": lambda: deployment.drafters()[0], "verifier": lambda: deployment.verifiers()[0],
                     "orchestrator": lambda: deployment.orchestrator}[kind]()
            killed = time.monotonic()
            ray.kill(actor, no_restart=False)
            deadline = killed + 120
            while not any(begun >= killed for begun, _ in list(done_at)):
                assert time.monotonic() < deadline, f"no request succeeded within 120 s of killing the {kind}"
                time.sleep(0.2)
            recovery[kind] = min(end for begun, end in done_at if begun >= killed) - killed
            time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(90)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert not wrong
    assert set(outcomes) <= {"ok", "UNAVAILABLE"}, outcomes
    print(f"chaos under Ray: requests {outcomes}; time to recover (s): "
          + ", ".join(f"{kind} {s:.1f}" for kind, s in recovery.items()))


def test_autoscaler_grows_and_shrinks_the_pool(deployment, tiny_pair, expected):
    """A second deployment with the autoscaler on: three concurrent requests at one
    session per replica grow the pool to three; idle, it shrinks back to one."""
    from deploy.ray import launcher

    target_dir, draft_dir, _ = tiny_pair
    # The model proposer: every round asks the drafter (lookup rounds, which the orchestrator
    # drafts itself from the history or from the same request's earlier output, would not).
    scaled = launcher.up(str(target_dir), str(draft_dir), 1, port=free_port(), admin_port=free_port(),
                         name="autoscaled", verifier_flags=NUMERICS["verifier_flags"],
                         drafter_flags=["--proposer", "model", *NUMERICS["drafter_flags"]],
                         autoscale={"min": 1, "max": 3, "target_sessions": 1, "cooldown_s": 5})
    channel, admin_channel = grpc.insecure_channel(scaled.address), grpc.insecure_channel(scaled.admin_address)
    stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
    admin = orchestrator_pb2_grpc.OrchestratorAdminServiceStub(admin_channel)
    try:
        ids, want = expected[PROMPTS[1]]
        stop, outcomes = threading.Event(), []

        def client():
            while not stop.is_set():
                # A fixed K: every request drafts (K chosen per round may go to K = 0 under load,
                # and a request that does not draft holds no drafter session).
                _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=60, num_speculative_tokens=4)
                outcomes.append(list(result.token_ids) == want)

        threads = [threading.Thread(target=client) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            wait_for_replicas(admin, 3, timeout_s=120)
            grown = admin.ListDrafters(pb.ListDraftersRequest()).last_scaling_decision
            assert "-> 3 drafters" in grown, grown
        finally:
            stop.set()
            for t in threads:
                t.join()
        wait_for_replicas(admin, 1, timeout_s=120)
        # Clients finish at different times, so it may shrink in steps (3 -> 2 -> 1):
        # what matters is the last decision, made idle.
        assert "-> 1 drafters: 0 sessions" in admin.ListDrafters(pb.ListDraftersRequest()).last_scaling_decision
        assert outcomes and all(outcomes)
    finally:
        channel.close()
        admin_channel.close()
        scaled.down()
