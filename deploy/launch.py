"""`specdec up`: the verifier, N drafters and the orchestrator as separate processes on
loopback. Waits until every service reports SERVING, prints the address, and stops them
all on Ctrl-C or SIGTERM (or when one of them dies)."""

import functools
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import fetch

log = logging.getLogger("specdec.up")
HOST = "127.0.0.1"


_handed_out: set[int] = set()


def _ephemeral_low() -> int | None:
    """The lowest port the kernel gives the local end of an outgoing connection (Linux)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port() -> int:
    """A port nothing listens on now, for a service about to start, never handed out twice
    by this process. Below the ephemeral range where it is known: a port from bind(0) is
    one the kernel may give the next outgoing connection before the service binds it (CI
    saw a service's metrics port taken while the bench started its deployments)."""
    low = _ephemeral_low()
    for _ in range(1000):
        port = random.randrange(max(1024, low - 10000), low) if low and low > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port found")


@dataclass
class Service:
    name: str
    port: int
    argv: list[str]
    process: subprocess.Popen | None = None
    nice: int = 0  # started at this much lower CPU priority (see `plan`)
    cpus: tuple[int, ...] | None = None  # the cores it may run on (None: any)
    admin_port: int | None = None  # the orchestrator's admin service
    credentials: grpc.ChannelCredentials | None = None  # how a client reaches it (None: plaintext)
    metrics_port: int | None = None  # its Prometheus /metrics
    http_port: int | None = None  # the orchestrator's OpenAI-compatible API

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def admin_address(self) -> str:
        return f"{HOST}:{self.admin_port}"


# Threads of a pass when all services share this machine, and how much the drafters
# yield to the verifier (see `plan`).
VERIFIER_THREADS, DRAFTER_THREADS, DRAFTER_NICE = os.cpu_count() or 1, 1, 15


def plan(target: str, draft: str, num_drafters: int, port: int, dtype: str = "float32",
         device: str = "cpu", overlap: bool = False, verifier_flags: list[str] = (),
         drafter_flags: list[str] = (), admin_port: int | None = None, http_port: int | None = None,
         drafter_device: str | None = None, drafter_dtype: str | None = None,
         draft_tokenizer: str = "") -> list[Service]:
    """The processes of one deployment; `draft` is "ngram" or a draft model (of another
    vocabulary than the target's: `draft_tokenizer` its tokenizer, if not its own), on
    `drafter_device` (default: the verifier's `device`) in `drafter_dtype` (default:
    drafter_dtype_for's). They share
    this machine's cores: the verifier's passes get all of them, each drafter's one, at
    a lower CPU priority (a pass's threads wait for each other at every operation, so a
    thread whose core goes to a drafter stalls the whole pass; the drafters' work beside
    a run of the target alone is off the request's path, and a round's drafting happens
    while the verifier waits). Measured on 2 cores, the default GGUF target, 1 and 8
    streams x 128 tokens (`specdec bench-load`, one run each): half the cores, 55.2 and
    102.0 tok/s at K = 0, 54.1 and 99.0 with the defaults; all of them and the drafters
    niced, 99.8 and 141.4, 80.4 and 134.4; all of them and the drafters not niced, 88.1
    and 165.8, 62.7 and 142.0."""
    python = [sys.executable, "-m"]
    verifier = Service("verifier", free_port(), [])
    verifier.argv = [*python, "verifier_service", "--host", HOST, "--port", str(verifier.port),
                     "--model", target, "--dtype", dtype, "--device", device,
                     "--threads", str(VERIFIER_THREADS), *verifier_flags]
    drafters = []
    for i in range(num_drafters):
        d = Service(f"drafter-{i}", free_port(), [], nice=DRAFTER_NICE)
        proposer = ["--proposer", "ngram"] if draft == "ngram" else [  # the model's proposer: drafter_flags
            "--model", draft, "--dtype", drafter_dtype_for(dtype, drafter_device or device, drafter_dtype),
            "--device", drafter_device or device, "--threads", str(DRAFTER_THREADS)]
        d.argv = [*python, "drafter_service", "--host", HOST, "--port", str(d.port), *proposer, *drafter_flags]
        drafters.append(d)
    admin_port = admin_port or free_port()  # `specdec up` gives one; the benchmarks' deployments any free one
    orchestrator = Service("orchestrator", port, [], admin_port=admin_port)
    orchestrator.http_port = http_port or free_port()
    orchestrator.argv = [*python, "orchestrator", "--host", HOST, "--port", str(port), "--admin-port", str(admin_port),
                         "--http-port", str(orchestrator.http_port),
                         "--verifiers", verifier.address, "--drafters", ",".join(d.address for d in drafters),
                         "--tokenizer", target, "--overlap" if overlap else "--no-overlap"]
    if draft_tokenizer:
        orchestrator.argv += ["--draft-tokenizer", draft_tokenizer]
    services = [verifier, *drafters, orchestrator]
    for service in services:
        service.metrics_port = free_port()
        service.argv += ["--metrics-port", str(service.metrics_port)]
    return services


def drafter_dtype_for(dtype: str, device: str, drafter_dtype: str | None = None) -> str:
    """A drafter's weights dtype: `drafter_dtype` if given; on a CPU float32 (the CPU
    kernels' activations; a 16-bit model there takes torch's slower path, and a draft's
    numerics are not the output's: they change its speed and acceptance only); elsewhere
    the deployment's `dtype`."""
    return drafter_dtype or ("float32" if device == "cpu" else dtype)


def channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    return grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)


def health_status(address: str, timeout: float = 1.0, credentials: grpc.ChannelCredentials | None = None) -> int:
    with channel(address, credentials) as channel_:
        try:
            response = health_pb2_grpc.HealthStub(channel_).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return response.status
        except grpc.RpcError:
            return health_pb2.HealthCheckResponse.UNKNOWN


def wait_serving(services: list[Service], timeout_s: float) -> None:
    """Blocks until every service is SERVING; raises if one exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(services)
    while pending:
        for service in list(pending):
            code = service.process.poll() if service.process else None
            if code is not None:
                raise RuntimeError(f"{service.name} exited with code {code} while starting (see its log above)")
            status = health_status(service.address, credentials=service.credentials)
            if status == health_pb2.HealthCheckResponse.SERVING:
                print(f"specdec up: {service.name} serving on {service.address}", file=sys.stderr, flush=True)
                pending.remove(service)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not serving after {timeout_s:.0f} s: {', '.join(s.name for s in pending)}")
        time.sleep(0.3)


def _placed(nice: int, cpus: tuple[int, ...] | None) -> None:
    """In a service's process before it runs: its priority and its cores."""
    if nice:
        os.nice(nice)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def start(services: list[Service], env: dict | None = None, log=None) -> None:
    """log: a file the services write their output to (None: this process's terminal)."""
    for service in services:
        placed = service.nice or service.cpus is not None
        service.process = subprocess.Popen(service.argv, env=env or os.environ.copy(), stdout=log,
                                           stderr=subprocess.STDOUT if log else None,
                                           preexec_fn=functools.partial(_placed, service.nice, service.cpus)
                                           if placed else None)


def stop(services: list[Service], grace_s: float = 10.0) -> None:
    for service in services:
        if service.process and service.process.poll() is None:
            service.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for service in services:
        if service.process:
            try:
                service.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                service.process.kill()
                service.process.wait()


def service_flags(args) -> tuple[list[str], list[str]]:
    """The verifier's and the drafters' flags from the deployment flags both `specdec up`
    and `specdec ray up` take."""
    shared = ["--max-batch-rows", str(args.max_batch_rows), "--quantize", args.quantize]
    proposer = [] if args.draft == "ngram" else ["--proposer", args.proposer]
    # CUDA graphs for every model on a GPU (a drafter on a CPU runs its passes as before);
    # batch-invariant passes are the verifier's: its numerics are the output's.
    shared += ["--cuda-graphs", args.cuda_graphs]
    verifier = ["--kv-cache-bytes", str(args.kv_cache_bytes), "--batch-invariant", str(args.batch_invariant)]
    return [*shared, *verifier], [*shared, *proposer]


def up(args) -> int:
    from specdec.server import taken

    in_use = [f"specdec up: {HOST}:{port} is in use; choose another with {flag}" for flag, port in
              (("--port", args.port), ("--admin-port", args.admin_port), ("--http-port", args.http_port))
              if port and taken(HOST, port)]
    if in_use:
        print("\n".join(in_use), file=sys.stderr, flush=True)
        return 2
    try:  # here, where its progress shows, rather than in each service's log
        fetch.fetch_all((args.target, args.draft, args.draft_tokenizer),
                        lambda line: print(f"specdec up: {line}", file=sys.stderr, flush=True))
    except (RuntimeError, OSError) as err:
        print(f"specdec up: {err}", file=sys.stderr, flush=True)
        return 1
    verifier_flags, drafter_flags = service_flags(args)
    services = plan(args.target, args.draft, args.num_drafters, args.port, args.dtype, args.device or "cpu",
                    args.overlap, verifier_flags=verifier_flags, drafter_flags=drafter_flags,
                    admin_port=args.admin_port, http_port=args.http_port, drafter_device=args.drafter_device,
                    drafter_dtype=args.drafter_dtype, draft_tokenizer=args.draft_tokenizer)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The services' logs go to a file, so that what a user reads in this terminal (an answer
    # streamed beside it) is not interleaved with them; "-" keeps them here (containers).
    log = None if args.logs == "-" else open(args.logs, "a", buffering=1)
    where = "here" if log is None else f"to {Path(args.logs).resolve()}"
    print(f"specdec up: starting the verifier ({args.target}), {args.num_drafters} drafter(s) ({args.draft}) "
          f"and the orchestrator; the first start of the default target converts it (about 30 s); their logs go "
          f"{where}", file=sys.stderr, flush=True)
    try:
        start(services, log=log)
        wait_serving(services, args.startup_timeout)
        print(f"specdec is up: Generate at {services[-1].address} (admin: {services[-1].admin_address})",
              flush=True)
        print(f"specdec up: OpenAI-compatible API at http://{HOST}:{services[-1].http_port}/v1", flush=True)
        print("specdec up: metrics at " + ", ".join(f"{s.name} http://{HOST}:{s.metrics_port}/metrics"
                                                  for s in services), flush=True)
        while not stopping:
            for service in services:
                if service.process.poll() is not None:
                    print(f"specdec up: {service.name} exited with code {service.process.returncode}"
                          + ("" if log is None else f" (its log: {Path(args.logs).resolve()})"), file=sys.stderr)
                    return 1
            time.sleep(0.5)
        return 0
    except (RuntimeError, TimeoutError) as err:
        print(f"specdec up: {err}", file=sys.stderr)
        return 1
    finally:
        stop(services)
        if log is not None:
            log.close()
