"""Launch time, scale-up time and throughput with 1 vs 3 drafters, in one run on a local
Ray instance:

    python -m deploy.ray.measure [--target T] [--draft D] [--clients 4] [--seconds 30]
"""

import argparse
import threading
import time

import grpc
import ray

from deploy.ray import launcher
from specdec.runtime import modeling
from deploy.launch import free_port
from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc

PROMPTS = ["Tell me about the sea.", "Write a haiku about autumn.", "List five fruits.", "What is a prime number?"]


def load(stub, clients: int, seconds: float, max_new_tokens: int) -> tuple[float, int]:
    """(tokens/s, requests) of `clients` closed-loop clients over `seconds`."""
    stop, tokens, requests = threading.Event(), [0], [0]
    lock = threading.Lock()

    def client(i):
        while not stop.is_set():
            request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(
                role="user", content=PROMPTS[i % len(PROMPTS)])]), max_new_tokens=max_new_tokens)
            result = stub.Complete(request, timeout=300)
            with lock:
                tokens[0] += len(result.token_ids)
                requests[0] += 1
            i += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return tokens[0] / (time.monotonic() - started), requests[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET)
    parser.add_argument("--draft", default=modeling.DEFAULT_DRAFT)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    started = time.monotonic()
    deployment = launcher.up(args.target, args.draft, 1, port=free_port(), admin_port=free_port())
    launch_s = time.monotonic() - started
    channel, admin_channel = grpc.insecure_channel(deployment.address), grpc.insecure_channel(deployment.admin_address)
    stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
    admin = orchestrator_pb2_grpc.OrchestratorAdminServiceStub(admin_channel)
    try:
        one = load(stub, args.clients, args.seconds, args.max_new_tokens)
        started = time.monotonic()
        admin.ScaleDrafters(pb.ScaleDraftersRequest(replicas=3))
        while len(admin.ListDrafters(pb.ListDraftersRequest()).replicas) < 3:
            time.sleep(0.1)
        scale_s = time.monotonic() - started
        three = load(stub, args.clients, args.seconds, args.max_new_tokens)
    finally:
        channel.close()
        admin_channel.close()
        deployment.down()
        ray.shutdown()
    print(f"target {args.target}, draft {args.draft}, {args.clients} concurrent clients, "
          f"{args.max_new_tokens} new tokens per request, {args.seconds:.0f} s per phase")
    print(f"launch (verifier + 1 drafter + orchestrator serving): {launch_s:.1f} s")
    print(f"scale 1 -> 3 drafters (until the orchestrator uses all 3, idle): {scale_s:.1f} s")
    print("| drafters | tokens/s | requests |")
    print("|---|---|---|")
    print(f"| 1 | {one[0]:.1f} | {one[1]} |")
    print(f"| 3 | {three[0]:.1f} | {three[1]} |")


if __name__ == "__main__":
    main()
