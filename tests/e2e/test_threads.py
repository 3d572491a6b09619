"""The default deployment with its verifier at 8 threads, more than this machine has
cores (users' servers have 16 to 64): how an operation splits a pass between threads
is what could change a row's bits, so a verify pass of K + 1 tokens, a prompt's chunks
and a batch of sessions must still give what the target alone gives. 32 prompts of 80
to 300 tokens, four at a time, greedy, prompts prefilled in chunks of 48 (the
reference takes each in one pass): speculation at a fixed K = 4 (every round a verify
pass) and K = 0 token-identical to the target's own generate.

(Before silu was row-invariant, this machine's chunks of 40 and one pass of an 86-token
prompt at 8 threads left keys apart from position 17 on.)"""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cluster import generate, pb, reference
from deploy import cli, launch
from deploy.launch import free_port
from specdec import defaults
from specdec.runtime import modeling
from specdec.runtime.quantize import quantize
from specdec.api.orchestrator.v1 import orchestrator_pb2_grpc

VERIFIER_THREADS = 8
MAX_NEW = 20
PROMPTS = Path(launch.__file__).parent / "bench" / "unseen_prompts.txt"


def long_prompts(tokenizer, count: int = 32) -> list[list[int]]:
    """Questions joined into texts of 80 to 300 tokens, each asking for answers."""
    lines = [line.strip() for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts, at = [], 0
    for i in range(count):
        want = 80 + (190 * i) // (count - 1)  # 80 .. 270 tokens, and a question more
        text = "Answer each question in one sentence.\n"
        while len(ids := tokenizer(text + "Answers:\n")["input_ids"]) < want:
            text += f"- {lines[at % len(lines)]}\n"
            at += 1
        assert 80 <= len(ids) <= 300
        prompts.append(ids)
    return prompts


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    args = cli.build_parser().parse_args(["up"])
    verifier_flags, drafter_flags = launch.service_flags(args)
    services = launch.plan(args.target, args.draft, 1, free_port(),
                           verifier_flags=[*verifier_flags, "--threads", str(VERIFIER_THREADS),
                                           "--max-batch-tokens", "48"],
                           drafter_flags=drafter_flags)
    argv = services[0].argv
    assert argv[len(argv) - argv[::-1].index("--threads")] == str(VERIFIER_THREADS)  # the last one is taken
    log = open(tmp_path_factory.mktemp("threads") / "services.log", "w")
    try:
        launch.start(services, log=log)
        launch.wait_serving(services, timeout_s=300)
        yield services[-1].address
    finally:
        launch.stop(services)
        log.close()


@pytest.fixture(scope="module")
def target():
    """The target as the deployment runs it on a CPU: its GGUF's blocks."""
    model, tokenizer = modeling.load_model(defaults.DEFAULT_TARGET)
    return quantize(model, "auto"), tokenizer


def test_speculation_at_more_threads_than_cores_is_token_identical_to_the_target(deployment, target):
    model, tokenizer = target
    prompts = long_prompts(tokenizer)
    want = [reference(model, ids, MAX_NEW) for ids in prompts]
    with grpc.insecure_channel(deployment) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

        def run(ids, k):
            _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW,
                                 num_speculative_tokens=k, timeout=300)
            return list(result.token_ids), result

        with ThreadPoolExecutor(4) as pool:
            alone = list(pool.map(lambda ids: run(ids, 0), prompts))
            speculated = list(pool.map(lambda ids: run(ids, 4), prompts))
    assert len({tuple(tokens) for tokens in want}) > 16  # the prompts' answers differ
    # Both of a round's ends ran: drafts accepted, and drafts corrected.
    drafted = sum(r.stats.draft_tokens for _, r in speculated)
    accepted = sum(r.stats.accepted_tokens for _, r in speculated)
    assert 0 < accepted < drafted, (accepted, drafted)
    for name, outputs in (("K = 0", alone), ("K = 4", speculated)):
        mismatched = [i for i, (w, (got, _)) in enumerate(zip(want, outputs)) if got != w[:len(got)] or
                      len(got) < min(len(w), MAX_NEW)]
        assert not mismatched, f"{name}: prompts {mismatched} differ from the target's own"
