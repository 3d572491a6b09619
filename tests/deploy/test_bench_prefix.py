"""`specdec bench prefix` runs end to end on the tiny pair (the mechanics; its figures are
the default target's, in docs/benchmarks.md): both routings, every request timed."""

import json

from deploy.bench import prefix


def test_bench_prefix_times_both_routings(tiny_pair, tmp_path):
    out = tmp_path / "out"
    args = prefix.build_parser().parse_args(
        ["--target", str(tiny_pair[0]), "--replicas", "2", "--threads", "1", "--prefix-tokens", "96",
         "--prefixes", "3", "--rounds", "2", "--kv-cache-bytes", "64MiB", "--out", str(out)])
    assert prefix.main_with(args) == 0
    results = json.loads((out / "prefix.json").read_text())["results"]
    assert set(results) == set(prefix.ROUTINGS)
    for r in results.values():
        assert len(r["cold_s"]) == 3 and len(r["follow_up_s"]) == 6
        assert all(s > 0 for s in r["cold_s"] + r["follow_up_s"]) and r["median_ratio"] > 0
    assert "| round-robin |" in (out / "prefix.md").read_text()
