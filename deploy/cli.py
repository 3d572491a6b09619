"""The `specdec` command: `specdec up` starts the services on loopback, `specdec
generate` streams a completion from a running orchestrator, `specdec fetch` brings
models by name into the cache."""

import argparse
import sys
import time

from specdec import defaults, fetch, flags


def generate(args) -> int:
    import grpc
    from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc

    request = pb.GenerateRequest(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_p=args.top_p, top_k=args.top_k, stop=args.stop or [])
    if args.raw:
        request.text = args.prompt
    else:
        request.chat.messages.add(role="user", content=args.prompt)
    if args.seed is not None:
        request.seed = args.seed
    if args.k is not None:
        request.num_speculative_tokens = args.k
    for kind in ("json_schema", "regex", "lark", "gbnf"):
        if getattr(args, kind) is not None:
            setattr(request.constraint, kind, getattr(args, kind))
    if args.json_object:
        request.constraint.json_object = True
    from deploy.launch import channel as open_channel

    credentials = client_credentials(args)
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    result = None
    with open_channel(args.address, credentials) as channel:
        if args.wait:
            wait_until_serving(args.address, args.wait, credentials)
        started = time.monotonic()
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        try:
            for event in stub.Generate(request, wait_for_ready=bool(args.wait), timeout=args.timeout,
                                       metadata=metadata):
                if event.HasField("chunk"):
                    sys.stdout.write(event.chunk.text)
                    sys.stdout.flush()
                else:
                    result = event.result
        except grpc.RpcError as err:
            print(f"\nspecdec generate: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    elapsed = time.monotonic() - started
    print(flush=True)
    if result is None:
        print("specdec generate: the stream ended without its result (the orchestrator went away?)", file=sys.stderr)
        return 1
    s = result.stats
    print(f"-- {result.usage.completion_tokens} tokens in {elapsed:.2f} s "
          f"({result.usage.completion_tokens / elapsed:.1f} tokens/s), finish "
          f"{pb.FinishReason.Name(result.finish_reason)}, {s.rounds} rounds, acceptance {s.acceptance_rate:.2f} "
          f"({s.accepted_tokens}/{s.draft_tokens})", file=sys.stderr)
    return 0


def client_credentials(args):
    """TLS to the orchestrator when --tls-ca or a client certificate is given."""
    import grpc
    from pathlib import Path

    if not (args.tls_ca or args.tls_cert):
        return None
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))


def add_client_flags(parser) -> None:
    """What a client of the orchestrator may need: its token, its TLS."""
    flags.add(parser, "--token", env="SPECDEC_TOKEN", default="", help="bearer token, when the orchestrator asks "
              "for one")
    flags.add(parser, "--tls-ca", env="SPECDEC_TLS_CA", default="",
              help="PEM CA that signed the orchestrator's certificate")
    flags.add(parser, "--tls-cert", env="SPECDEC_TLS_CERT", default="", help="PEM client certificate (mutual TLS)")
    flags.add(parser, "--tls-key", env="SPECDEC_TLS_KEY", default="", help="PEM key of --tls-cert")


def wait_until_serving(address: str, timeout_s: float, credentials=None) -> None:
    from grpc_health.v1 import health_pb2
    from deploy.launch import health_status

    deadline = time.monotonic() + timeout_s
    while health_status(address, credentials=credentials) != health_pb2.HealthCheckResponse.SERVING:
        if time.monotonic() > deadline:
            raise SystemExit(f"specdec generate: {address} is not serving after {timeout_s:.0f} s")
        time.sleep(0.5)


def ray_command(args) -> int:
    import grpc
    from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc

    if args.ray_command == "up":
        import signal


        try:
            import ray  # noqa: F401  (the launcher's, imported here to say what is missing)
        except ModuleNotFoundError as err:
            if err.name != "ray":
                raise
            print("specdec ray up: Ray is not installed here: pip install 'specdec[ray]' (ray==2.60.0), "
                  "or start the services without Ray: specdec up", file=sys.stderr, flush=True)
            return 2
        from deploy.ray import launcher
        from deploy import launch

        autoscale = None
        if args.autoscale:
            autoscale = {"min": args.autoscale_min_replicas, "max": args.autoscale_max_replicas,
                         "target_sessions": args.autoscale_target_sessions, "cooldown_s": args.autoscale_cooldown}
        autoscale_verifiers = None
        if args.autoscale_verifiers:
            autoscale_verifiers = {"min": args.autoscale_verifiers_min_replicas,
                                   "max": args.autoscale_verifiers_max_replicas,
                                   "target_sessions": args.autoscale_verifiers_target_sessions,
                                   "cooldown_s": args.autoscale_cooldown}
        import ray

        started = time.monotonic()
        verifier_flags, drafter_flags = launch.service_flags(args)
        try:
            deployment = launcher.up(
                args.target, args.draft, args.num_drafters, num_verifiers=args.num_verifiers, port=args.port,
                address=args.address,
                verifier_gpus=args.verifier_gpus, verifier_cpus=args.verifier_cpus, drafter_cpus=args.drafter_cpus,
                orchestrator_cpus=args.orchestrator_cpus, dtype=args.dtype, device=args.device,
                drafter_device=args.drafter_device, drafter_dtype=args.drafter_dtype,
                verifier_flags=verifier_flags, drafter_flags=drafter_flags,
                orchestrator_flags=["--overlap" if args.overlap else "--no-overlap",
                                    "--http-port", str(args.http_port)],
                autoscale=autoscale, autoscale_verifiers=autoscale_verifiers,
                admin_port=args.admin_port,
                startup_timeout_s=args.startup_timeout)
        except (launcher.PlacementError, TimeoutError) as err:
            print(f"specdec ray up: {err}", file=sys.stderr, flush=True)
            ray.shutdown()
            return 2
        print(f"specdec is up: Generate at {deployment.address} (on Ray, in {time.monotonic() - started:.1f} s; "
              f"admin at {deployment.admin_address} on the orchestrator's node; OpenAI-compatible API on port "
              f"{args.http_port})", flush=True)
        stop = []
        # Handlers of our own: a process started in the background inherits SIGINT ignored,
        # and Python then raises no KeyboardInterrupt.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.append(1))
        while not stop:
            time.sleep(0.5)
        print("specdec ray up: stopping", file=sys.stderr, flush=True)
        deployment.down()
        ray.shutdown()  # a local Ray goes with it; on a cluster this only disconnects
        return 0
    from deploy.launch import channel as open_channel

    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    with open_channel(args.admin, client_credentials(args)) as channel:
        admin = orchestrator_pb2_grpc.OrchestratorAdminServiceStub(channel)
        try:
            if args.ray_command in ("scale-drafters", "scale-verifiers"):
                if args.ray_command == "scale-drafters":
                    reply = admin.ScaleDrafters(pb.ScaleDraftersRequest(replicas=args.replicas), timeout=120,
                                                metadata=metadata)
                else:
                    reply = admin.ScaleVerifiers(pb.ScaleVerifiersRequest(replicas=args.replicas), timeout=120,
                                                 metadata=metadata)
                what = args.ray_command.split("-")[1][:-1]
                print(f"{what} replicas: {reply.replicas} ({reply.replicas - reply.starting - reply.pending} "
                      f"serving, {reply.starting} starting, {reply.pending} pending)")
                if reply.pending:
                    print(f"specdec ray: {reply.detail}", file=sys.stderr)
                    return 3
            elif args.ray_command == "verifiers":
                listing = admin.ListVerifiers(pb.ListVerifiersRequest(), timeout=10, metadata=metadata)
                print(f"{len(listing.replicas)} verifier replicas ({listing.source})")
                for r in listing.replicas:
                    blocks = r.free_kv_blocks if r.free_kv_blocks >= 0 else "?"
                    print(f"  {r.address}  sessions={r.sessions}  healthy={r.healthy}  free_kv_blocks={blocks}  "
                          f"waiting={r.waiting_sessions}  pass={r.pass_seconds * 1000:.1f}ms  "
                          f"routed: prefix={r.routed_by_prefix} load={r.routed_by_load}  moved_away={r.moved_away}"
                          + ("" if r.in_set else "  (leaving)"))
                if listing.last_scaling_decision:
                    print(f"last autoscaling decision: {listing.last_scaling_decision}")
            else:
                listing = admin.ListDrafters(pb.ListDraftersRequest(), timeout=10, metadata=metadata)
                print(f"{len(listing.replicas)} drafter replicas ({listing.source})")
                for r in listing.replicas:
                    print(f"  {r.address}  sessions={r.sessions}  healthy={r.healthy}")
                if listing.starting or listing.pending:
                    print(f"and {listing.starting} starting (placed, loading the model), {listing.pending} pending "
                          "(waiting for resources)")
                if listing.last_scaling_decision:
                    print(f"last autoscaling decision: {listing.last_scaling_decision}")
        except grpc.RpcError as err:
            print(f"specdec ray: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 0


def add_deployment_flags(p: argparse.ArgumentParser) -> None:
    """What `specdec up` and `specdec ray up` both take."""
    flags.add(p, "--dtype", env="SPECDEC_DTYPE", default="float32",
              help="weights dtype of the target, and of a draft on a GPU")
    flags.add(p, "--drafter-dtype", env="SPECDEC_DRAFTER_DTYPE", default=None, choices=["float32", "float16", "bfloat16"],
              help="weights dtype of the draft (default: float32 on a CPU, where its kernels are, else --dtype's; "
                   "a draft's numerics change its speed and acceptance, never the output)")
    flags.add(p, "--proposer", env="SPECDEC_PROPOSER", default="hybrid", choices=["model", "hybrid"],
              help="how a model draft drafts: prompt lookup when the context holds a long match and the model "
                   "otherwise (hybrid), or the model alone")
    flags.add(p, "--quantize", env="SPECDEC_QUANTIZE", default="auto", choices=flags.QUANTIZE,
              help=flags.QUANTIZE_HELP + " (of both models)")
    flags.add(p, "--device", env="SPECDEC_DEVICE", default=None,
              help="torch device of the verifier, and of the drafters unless --drafter-device (default: cpu; under "
                   "Ray, the verifier's is cuda when it got a GPU)")
    flags.add(p, "--drafter-device", env="SPECDEC_DRAFTER_DEVICE", default=None,
              help="torch device of the drafters (default: --device's; cpu beside a GPU verifier: the drafters on "
                   "this machine's cores, as a drafter node beside a GPU server; under Ray always cpu)")
    flags.add(p, "--cuda-graphs", env="SPECDEC_CUDA_GRAPHS", default="off", choices=["off", "on", "compiled"],
              help="every model on a GPU (Llama-family): passes of up to 64 tokens replayed from CUDA graphs, "
                   "captured at start-up (on), of torch.compile's kernels (compiled: each shape's first pass "
                   "compiles for about a minute); a service whose model is on a CPU runs its passes as before")
    flags.add(p, "--batch-invariant", env="SPECDEC_BATCH_INVARIANT", type=int, default=0,
              help="N > 0: the verifier runs every pass as passes of exactly N tokens, so a token's logits do not "
                   "depend on what else its pass holds: greedy speculation in bfloat16/float16 gives the target "
                   "alone's tokens (8: a single stream; 64: many sessions)")
    flags.add(p, "--overlap", env="SPECDEC_OVERLAP", type=bool, default=False,
              help="the orchestrator drafts each round's successor while the round is verified")
    flags.add(p, "--kv-cache-bytes", env="SPECDEC_KV_CACHE_BYTES", type=flags.byte_size, default="1GiB",
              help="the verifier's KV pool, shared by all sessions")
    flags.add(p, "--max-batch-rows", env="SPECDEC_MAX_BATCH_ROWS", type=int, default=64,
              help="sessions one forward pass of the verifier or a drafter may run (1: no batching)")
    flags.add(p, "--startup-timeout", env="SPECDEC_STARTUP_TIMEOUT", type=float, default=600.0,
              help="seconds to wait for every service to serve")
    flags.add(p, "--admin-port", env="SPECDEC_ADMIN_PORT", type=int, default=50050,
              help="the orchestrator's admin port, on loopback of its machine")
    flags.add(p, "--http-port", env="SPECDEC_HTTP_PORT", type=int, default=8000,
              help="the orchestrator's OpenAI-compatible HTTP API (/v1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start the verifier, drafters and orchestrator on loopback")
    flags.add(p, "--target", env="SPECDEC_TARGET", default=defaults.DEFAULT_TARGET, help="target model")
    flags.add(p, "--draft", env="SPECDEC_DRAFT", default=defaults.DEFAULT_DRAFT,
              help='draft model (directory, hub id or .gguf), or "ngram" for prompt lookup')
    flags.add(p, "--draft-tokenizer", env="SPECDEC_DRAFT_TOKENIZER", default="",
              help="for a draft of another vocabulary than the target's: its tokenizer (a directory, hub id or "
                   ".gguf file; default: the draft model's own)")
    flags.add(p, "--num-drafters", env="SPECDEC_NUM_DRAFTERS", type=int, default=1, help="drafter replicas")
    flags.add(p, "--port", env="SPECDEC_PORT", type=int, default=50051, help="the orchestrator's port")
    flags.add(p, "--logs", env="SPECDEC_LOGS", default="specdec-up.log",
              help='file the services\' logs are appended to; "-": this terminal')
    add_deployment_flags(p)

    g = sub.add_parser("generate", help="stream a completion from a running orchestrator")
    g.add_argument("prompt")
    flags.add(g, "--address", env="SPECDEC_ADDRESS", default="127.0.0.1:50051", help="orchestrator host:port")
    g.add_argument("--raw", action="store_true", help="send the prompt as plain text, not as a chat message")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=None)
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", help="constrain the output to this JSON schema (JSON text)")
    shape.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    shape.add_argument("--regex", help="constrain the output to this regular expression")
    shape.add_argument("--lark", help="constrain the output to this Lark grammar (start rule `start`)")
    shape.add_argument("--gbnf", help="constrain the output to this GBNF grammar (start rule `root`)")
    g.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the orchestrator to be up")
    g.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
    add_client_flags(g)
    fetch_parser = sub.add_parser("fetch", help="fetch models by name into the cache (specdec up does it too)")
    fetch_parser.add_argument("names", nargs="*", help="the models: " + ", ".join(sorted(fetch.CATALOG)))
    r = sub.add_parser("ray", help="launch on Ray and scale drafters and verifiers")
    ray_sub = r.add_subparsers(dest="ray_command", required=True)
    ru = ray_sub.add_parser("up", help="start the services as Ray actors (local Ray, or --address)")
    flags.add(ru, "--address", env="SPECDEC_RAY_ADDRESS", default=None,
              help='an existing Ray cluster ("auto", "ray://host:10001"); a local Ray when unset')
    flags.add(ru, "--target", env="SPECDEC_TARGET", default=defaults.DEFAULT_TARGET, help="target model")
    flags.add(ru, "--draft", env="SPECDEC_DRAFT", default=defaults.DEFAULT_DRAFT, help='draft model, or "ngram"')
    flags.add(ru, "--num-drafters", env="SPECDEC_NUM_DRAFTERS", type=int, default=1, help="drafter replicas")
    flags.add(ru, "--num-verifiers", env="SPECDEC_NUM_VERIFIERS", type=int, default=1,
              help="verifier replicas (each asks for --verifier-gpus and --verifier-cpus)")
    flags.add(ru, "--port", env="SPECDEC_PORT", type=int, default=50051, help="the orchestrator's port")
    flags.add(ru, "--verifier-gpus", env="SPECDEC_VERIFIER_GPUS", default="auto",
              help='GPUs for each verifier actor; "auto": 1 when the cluster has a GPU')
    flags.add(ru, "--verifier-cpus", env="SPECDEC_VERIFIER_CPUS", type=float, default=None,
              help="CPUs each verifier actor asks for (unset: 1 on a cluster; on a local Ray the verifiers share "
                   "half the machine's, at most 1)")
    flags.add(ru, "--drafter-cpus", env="SPECDEC_DRAFTER_CPUS", type=float, default=None,
              help="CPUs each drafter actor asks for (unset: 1 on a cluster, 0.25 on a local Ray)")
    flags.add(ru, "--orchestrator-cpus", env="SPECDEC_ORCHESTRATOR_CPUS", type=float, default=None,
              help="CPUs the orchestrator actor asks for (unset: 1 on a cluster, 0.25 on a local Ray)")
    add_deployment_flags(ru)
    flags.add(ru, "--autoscale", env="SPECDEC_AUTOSCALE", type=bool, default=False,
              help="size the drafter pool from the load")
    flags.add(ru, "--autoscale-min-replicas", env="SPECDEC_AUTOSCALE_MIN_REPLICAS", type=int, default=1,
              help="fewest drafters")
    flags.add(ru, "--autoscale-max-replicas", env="SPECDEC_AUTOSCALE_MAX_REPLICAS", type=int, default=4,
              help="most drafters")
    flags.add(ru, "--autoscale-target-sessions", env="SPECDEC_AUTOSCALE_TARGET_SESSIONS", type=float, default=4.0,
              help="requests per drafter the pool is sized for")
    flags.add(ru, "--autoscale-verifiers", env="SPECDEC_AUTOSCALE_VERIFIERS", type=bool, default=False,
              help="size the verifier pool from the load (sessions, and sessions waiting for KV memory)")
    flags.add(ru, "--autoscale-verifiers-min-replicas", env="SPECDEC_AUTOSCALE_VERIFIERS_MIN_REPLICAS", type=int,
              default=1, help="fewest verifiers")
    flags.add(ru, "--autoscale-verifiers-max-replicas", env="SPECDEC_AUTOSCALE_VERIFIERS_MAX_REPLICAS", type=int,
              default=4, help="most verifiers")
    flags.add(ru, "--autoscale-verifiers-target-sessions", env="SPECDEC_AUTOSCALE_VERIFIERS_TARGET_SESSIONS",
              type=float, default=16.0, help="requests per verifier the pool is sized for")
    flags.add(ru, "--autoscale-cooldown", env="SPECDEC_AUTOSCALE_COOLDOWN", type=float, default=30.0,
              help="seconds between two scaling decisions")
    rs = ray_sub.add_parser("scale-drafters", help="set the number of drafter replicas")
    rs.add_argument("replicas", type=int)
    rl = ray_sub.add_parser("drafters", help="list the drafter replicas and their load")
    rsv = ray_sub.add_parser("scale-verifiers", help="set the number of verifier replicas")
    rsv.add_argument("replicas", type=int)
    rlv = ray_sub.add_parser("verifiers", help="list the verifier replicas, their load and routing")
    for p in (rs, rl, rsv, rlv):
        flags.add(p, "--admin", env="SPECDEC_ADMIN_ADDRESS", default="127.0.0.1:50050",
                  help="host:port of the orchestrator's admin service (loopback on the orchestrator's machine)")
        add_client_flags(p)

    # The benchmarks load torch and the models: their own parsers take the rest of the
    # line, so that the thin commands above start without them.
    sub.add_parser("bench", help="the benchmarks: specdec bench NAME (compare, load, repeat, structured, prefix, "
                                 "engine, wire, fidelity); specdec bench --help lists them", add_help=False)
    sub.add_parser("top", help="a live view of a deployment from its metrics endpoints (--help for its flags)",
                   add_help=False)
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from deploy import bench

        bench.main(rest)
    if args.command == "top":
        from deploy import top

        raise SystemExit(top.main(rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "fetch":
        raise SystemExit(fetch.main(args.names))
    if args.command == "up":
        from deploy.launch import up

        raise SystemExit(up(args))
    if args.command == "ray":
        raise SystemExit(ray_command(args))
    raise SystemExit(generate(args))


if __name__ == "__main__":
    main()
