"""The local launcher's ports."""

import socket

import pytest

from deploy import launch


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    # A port the kernel may give an outgoing connection's local end can be gone before the
    # service binds it; one handed out twice goes to two services.
    ports = [launch.free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    low = launch._ephemeral_low()
    if low is not None:
        assert all(port < low for port in ports)
    with socket.socket() as s:
        s.bind((launch.HOST, ports[-1]))


def test_a_port_in_use_is_refused_with_its_flag_before_anything_listens():
    """A second deployment on one host: each service, and `specdec up`, says which flag's
    port is taken and exits 2, before binding anything (before, the orchestrator said it
    listened, then died with a traceback on its admin port)."""
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as held:
        held.bind((launch.HOST, 0))
        held.listen()
        port = held.getsockname()[1]
        free = str(launch.free_port())
        for argv, flag in (
                ([sys.executable, "-m", "orchestrator", "--port", free, "--admin-port", str(port)], "--admin-port"),
                ([sys.executable, "-m", "verifier_service", "--port", free, "--metrics-port", str(port)],
                 "--metrics-port"),
                ([sys.executable, "-m", "drafter_service", "--port", str(port)], "--port"),
                ([str(Path(sys.executable).parent / "specdec"), "up", "--http-port", str(port)], "--http-port")):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert done.returncode == 2, (argv, done.stderr)
            assert f"127.0.0.1:{port} is in use; choose another with {flag}" in done.stderr
            assert "Traceback" not in done.stderr and "listening" not in done.stderr


def test_the_verifier_gets_every_core_and_the_drafters_yield_to_it():
    """`plan` gives the verifier's passes all cores and starts the drafters at a lower
    CPU priority: a drafter's work beside a run of the target alone must not take a core
    from the verifier's pass."""
    import os
    import subprocess
    import sys

    from deploy import launch

    services = launch.plan("target-dir", "draft-dir", 2, launch.free_port())
    verifier, *drafters, _ = services
    assert verifier.argv[verifier.argv.index("--threads") + 1] == str(os.cpu_count())
    assert verifier.nice == 0 and [d.nice for d in drafters] == [launch.DRAFTER_NICE] * 2
    probe = launch.Service("probe", 0, [sys.executable, "-c", "import os; print(os.nice(0))"], nice=launch.DRAFTER_NICE)
    plain = launch.Service("plain", 0, [sys.executable, "-c", "import os; print(os.nice(0))"])
    base = os.nice(0)
    for service, want in ((probe, base + launch.DRAFTER_NICE), (plain, base)):
        launch.start([service], log=subprocess.PIPE)  # as `specdec up` starts every service
        out, _ = service.process.communicate(timeout=30)
        assert int(out) == min(19, want), service.name


def test_the_gpu_flags_of_a_deployment_go_where_they_apply():
    """`specdec up --cuda-graphs on --batch-invariant 64` (and `specdec ray up`): graphs
    for every service (one whose model is on a CPU runs its passes as before), the
    batch-invariant passes for the verifier, whose numerics are the output's."""
    from deploy import cli
    from drafter_service.server import build_parser as drafter_parser
    from verifier_service.server import build_parser

    args = cli.build_parser().parse_args(["up", "--cuda-graphs", "on", "--batch-invariant", "64"])
    verifier_flags, drafter_flags = launch.service_flags(args)
    parsed = build_parser().parse_args(["--model", "target-dir", *verifier_flags])
    assert (parsed.cuda_graphs, parsed.batch_invariant) == ("on", 64)
    parsed = drafter_parser().parse_args(["--model", "draft-dir", *drafter_flags])
    assert (parsed.cuda_graphs, parsed.batch_invariant) == ("on", 0)
    default = cli.build_parser().parse_args(["up"])
    parsed = build_parser().parse_args(["--model", "target-dir", *launch.service_flags(default)[0]])
    assert (parsed.cuda_graphs, parsed.batch_invariant) == ("off", 0)


def test_up_passes_a_drafts_tokenizer_to_the_orchestrator():
    """`specdec up --draft-tokenizer`, which the orchestrator's refusal of a draft of
    another vocabulary whose tokenizer is not at hand tells the user to pass."""
    from deploy import cli
    from orchestrator.server import build_parser

    for argv, want in ((["up", "--draft-tokenizer", "draft-tok-dir"], "draft-tok-dir"), (["up"], "")):
        args = cli.build_parser().parse_args(argv)
        *_, orchestrator = launch.plan(args.target, args.draft, 1, launch.free_port(),
                                       draft_tokenizer=args.draft_tokenizer)
        assert build_parser().parse_args(orchestrator.argv[3:]).draft_tokenizer == want


def test_the_drafters_run_on_their_own_device_beside_the_verifiers():
    """`specdec up --device cuda --drafter-device cpu`: the verifier on the GPU, the
    drafters on this machine's cores (a drafter node beside a GPU server); without the
    flag the drafters take the verifier's device; Ray's drafter actors are on CPUs and
    any other device is refused there with the flag named."""
    from deploy import cli
    from drafter_service.server import build_parser as drafter_parser
    from verifier_service.server import build_parser

    def devices(argv):
        args = cli.build_parser().parse_args(argv)
        services = launch.plan(args.target, args.draft, 2, launch.free_port(), args.dtype, args.device or "cpu",
                               drafter_device=args.drafter_device, drafter_dtype=args.drafter_dtype)
        verifier, *drafters, _ = services
        parsed = build_parser().parse_args(verifier.argv[3:])
        return ((parsed.device, parsed.dtype),
                [(d.device, d.dtype) for d in (drafter_parser().parse_args(d.argv[3:]) for d in drafters)])

    # A draft on a CPU in float32, where its kernels are (bfloat16 there takes torch's path);
    # on a GPU in the deployment's dtype, or the one asked for.
    bf16 = ["--dtype", "bfloat16"]
    assert devices(["up", "--device", "cuda", "--drafter-device", "cpu", *bf16]) == (
        ("cuda", "bfloat16"), [("cpu", "float32")] * 2)
    assert devices(["up", "--device", "cuda", *bf16]) == (("cuda", "bfloat16"), [("cuda", "bfloat16")] * 2)
    assert devices(["up", "--device", "cuda", "--drafter-device", "cpu", "--drafter-dtype", "bfloat16", *bf16]) == (
        ("cuda", "bfloat16"), [("cpu", "bfloat16")] * 2)
    assert devices(["up"]) == (("cpu", "float32"), [("cpu", "float32")] * 2)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stopped:
        cli.main(["ray", "up", "--drafter-device", "cuda"])
    assert stopped.value.code == 2 and "--drafter-device cuda" in err.getvalue()


def test_a_speculation_limit_past_the_verifiers_is_refused_at_start():
    """--max-speculative-tokens 65 started, then failed every request that drafted 65
    tokens with INVALID_ARGUMENT on draft_tokens, blamed on the client."""
    import subprocess
    import sys

    free = str(launch.free_port())
    for flag in ("--max-speculative-tokens", "--adaptive-max-speculative-tokens", "--num-speculative-tokens"):
        done = subprocess.run([sys.executable, "-m", "orchestrator", "--port", free, "--admin-port",
                               str(launch.free_port()), flag, "65"], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and flag in done.stderr and "64" in done.stderr, (flag, done.stderr)


def test_a_service_started_by_hand_takes_the_fast_numerics():
    """`specdec-verifier --model X` ran float32 (81 ms a token on the default target where
    `specdec up`'s `auto` took 6.7 ms): every service now defaults to `auto`."""
    from drafter_service.server import build_parser as drafter
    from verifier_service.server import build_parser as verifier

    assert verifier().parse_args([]).quantize == "auto"
    assert drafter().parse_args([]).quantize == "auto"
