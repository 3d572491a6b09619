"""Drafter discovery by DNS (a Kubernetes headless Service): the orchestrator follows a
change in the resolved drafter set, and a request in flight moves off a replica that left
the set without failing and without a change in its output."""

import json
import time
from pathlib import Path

from cluster import Cluster, Stream, drafter, generate, orchestrator, pb, reference

FAKE_DNS = Path(__file__).resolve().parents[1] / "fakedns"
NAME = "specdec-drafter.test"


def test_follows_the_resolved_drafter_set(tiny_cluster, tiny_pair, smol_tokenizer, tmp_path):
    target_dir, draft_dir, model = tiny_pair
    first, second = drafter(draft_dir, "dns-drafter-a"), drafter(draft_dir, "dns-drafter-b")
    tiny_cluster.start(first, second)
    table = tmp_path / "dns.json"
    table.write_text(json.dumps({NAME: [first.address]}))

    dns_cluster = Cluster()
    dns_cluster.env.update(PYTHONPATH=f"{FAKE_DNS}:{dns_cluster.env.get('PYTHONPATH', '')}",
                           SPECDEC_TEST_DNS_TABLE=str(table))
    o = orchestrator(tiny_cluster.roles["verifier"], [], target_dir, "orchestrator-dns",
                     extra=["--drafter-dns", f"{NAME}:50052", "--drafter-refresh-interval", "0.2"])
    try:
        dns_cluster.start(o)
        stub = dns_cluster.orchestrator_stub(o)
        ids = smol_tokenizer("A long time ago in a galaxy far, far away")["input_ids"]
        want = reference(model, ids, 600)

        stream = Stream(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=600, num_speculative_tokens=4)
        # The headless Service now resolves to the other replica only...
        table.write_text(json.dumps({NAME: [second.address]}))
        time.sleep(1.0)
        # ...so the request has left the first one, which can go away unnoticed.
        tiny_cluster.kill(first)
        result = stream.finish()
        assert list(result.token_ids) == want
        assert result.stats.drafter_failovers == 0  # it moved because of DNS, not because of the kill
        assert result.stats.accepted_tokens > 0

        # New requests go to the replica in the set.
        _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=40, num_speculative_tokens=4)
        assert list(result.token_ids) == want[:40]
        assert result.stats.drafter_failovers == 0 and result.stats.accepted_tokens > 0
    finally:
        dns_cluster.close()
