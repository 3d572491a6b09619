"""`specdec bench split` as a smoke test on the tiny pair: each topology's deployment is
placed as its docstring says, every cell runs through real services, and the defaults'
outputs equal K = 0's. Not a timing test."""

import json
import os
import sys
import time

import pytest

from deploy import launch
from deploy.bench import split


def test_a_service_runs_on_the_cores_it_is_given():
    service = launch.Service("sleeper", 0, [sys.executable, "-c", "import time; time.sleep(30)"], cpus=(0,))
    launch.start([service])
    try:
        time.sleep(0.2)
        assert os.sched_getaffinity(service.process.pid) == {0}
    finally:
        service.process.kill()
        service.process.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the split topology needs 2 cores")
def test_the_split_topology_gives_the_verifier_its_cores_and_the_rest_the_last(tiny_pair):
    target, draft, _ = tiny_pair
    args = split.build_parser().parse_args(["--target", str(target), "--draft", str(draft)])
    cores = sorted(os.sched_getaffinity(0))
    placed = {s.name: s for s in split.deployment(args, "split")}
    verifier = placed.pop("verifier")
    assert verifier.cpus == tuple(cores[:-1])
    last = max(i for i, flag in enumerate(verifier.argv) if flag == "--threads")  # the last one given wins
    assert verifier.argv[last + 1] == str(len(cores) - 1)
    assert {s.cpus for s in placed.values()} == {(cores[-1],)} and {s.nice for s in placed.values()} == {0}
    assert all(s.cpus is None for s in split.deployment(args, "shared"))
    for topology in split.TOPOLOGIES:  # the overlap variant's orchestrator drafts ahead, the others' do not
        assert [split.deployment(args, topology, overlap)[-1].argv.count("--overlap") for overlap in (False, True)] \
            == [0, 1], topology


def test_bench_split_runs_each_cell_and_the_outputs_agree(tiny_pair, tmp_path):
    """The split topology's cells (the shared one's deployment is `specdec up`'s, placed
    as the test above checks)."""
    target, draft, _ = tiny_pair
    out = tmp_path / "out"
    args = split.build_parser().parse_args(
        ["--target", str(target), "--draft", str(draft), "--requests", "2", "--max-new-tokens", "8",
         "--passes", "1", "--quantize", "none", "--overlap", "--topologies", "split", "--out", str(out)])
    assert split.main_with(args) == 0
    report = json.loads((out / "split.json").read_text())
    assert [(r["topology"], r["variant"]) for r in report["rows"]] == [
        ("split", v) for v in ("defaults", "K = 0", "overlap")]
    assert all(r["tok_s"] > 0 and len(r["tokens"]) == 2 for r in report["rows"])
    assert all(r["drafted"] == 0 and r["draft_ms_a_token"] == 0 == r["lookaheads"]
               for r in report["rows"] if r["variant"] == "K = 0")
    assert all(r["verify_ms_a_token"] > 0 for r in report["rows"])
    # Rounds that drafted waited on the drafter; drafts offered to runs (--overlap alone) did not.
    assert all(r["draft_ms_a_token"] > 0 for r in report["rows"] if r["drafted"] and not r["offers"])
    assert all(r["offers"] == 0 for r in report["rows"] if r["variant"] != "overlap")
    assert all(r["offers"] >= 0 <= r["offered_accepted"] <= r["accepted"] for r in report["rows"])
    assert all(r["lookaheads"] >= r["lookahead_hits"] for r in report["rows"])
    assert all(r["lookaheads"] == 0 for r in report["rows"] if r["variant"] == "defaults")
    for topology, by_variant in report["summary"].items():
        assert {v: (a["same"], a["checked"]) for v, a in by_variant.items()} == {
            "defaults": (2, 2), "overlap": (2, 2)}, topology
        assert all(a["speedup"] > 0 for a in by_variant.values())
    assert "| split | overlap |" in (out / "split.md").read_text()
