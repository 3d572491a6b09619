"""A feature drafter for a target as wide as Llama-3.1-8B (hidden 4,096) with a window of
256 positions: its window of features (256 x 3 layers x 4,096 x 2 bytes, 6 MiB) rides in
one message from the verifier and to the drafter, over gRPC's 4 MiB default. Before,
every such request failed RESOURCE_EXHAUSTED at its first call."""

import subprocess
import sys

import pytest

from cluster import Cluster, drafter, generate, orchestrator, pb, verifier
from conftest import MICRO_WORDS
from models import build_llama, eagle_head_for, word_tokenizer
from specdec.runtime import eagle
from specdec.wire import SERVICE_MESSAGE_BYTES

HIDDEN, WINDOW = 4096, 256


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    tok = word_tokenizer(MICRO_WORDS)
    # The width of a real head, not its cost: a small MLP and vocabulary.
    target = build_llama(tok, root / "target", seed=11, hidden=HIDDEN, layers=2, intermediate=128, heads=32,
                         kv_heads=8, init_range=0.05)
    eagle_head_for(target, tok, root / "head", seed=12)
    return root / "target", root / "head"


def test_a_window_of_a_wide_heads_features_passes_through_the_services(wide):
    target_dir, head_dir = wide
    cluster = Cluster()
    try:
        v = verifier(target_dir, "wide-verifier")
        d = drafter(head_dir, "wide-head", extra=["--feature-window", str(WINDOW)])
        cluster.start(v, d)
        o = orchestrator(v, [d], target_dir, "wide-orchestrator", extra=["--no-warm-up"])
        cluster.start(o)
        stub = cluster.orchestrator_stub(o)
        ids = [1 + i % 7 for i in range(WINDOW + 40)]
        _, alone = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=6, num_speculative_tokens=0)
        _, drafted = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=6, num_speculative_tokens=2)
        assert list(drafted.token_ids) == list(alone.token_ids)
        assert drafted.stats.draft_tokens > 0
        # The window came from the verifier, and went to the drafter, whole.
        assert drafted.stats.feature_bytes_received >= WINDOW * 3 * HIDDEN * 2
        assert drafted.stats.feature_bytes_sent >= WINDOW * 3 * HIDDEN * 2
    finally:
        cluster.close()


def test_a_window_past_the_services_message_bound_is_refused_at_start(wide):
    """A window whose message would not fit is refused when the drafter starts, naming the flag."""
    _, head_dir = wide
    too_many = SERVICE_MESSAGE_BYTES // (3 * HIDDEN * 2) + 1
    done = subprocess.run([sys.executable, "-m", "drafter_service", "--port", "0", "--proposer", "model",
                           "--model", str(head_dir), "--feature-window", str(too_many)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--feature-window" in done.stderr, done.stderr[-500:]
    assert eagle.is_head(head_dir)
