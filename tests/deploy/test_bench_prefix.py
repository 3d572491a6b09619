"""deploy.bench_prefix runs end to end on the tiny pair (the mechanics; its figures are
the default target's, in the README): both routings, every request timed."""

from types import SimpleNamespace

from deploy import bench_prefix


def test_bench_prefix_times_both_routings(tiny_pair):
    args = SimpleNamespace(target=str(tiny_pair[0]), replicas=2, threads=1, prefix_tokens=96, prefixes=3, rounds=2,
                           kv_cache_bytes="64MiB")
    results = bench_prefix.run(args)
    assert set(results) == set(bench_prefix.ROUTINGS)
    for r in results.values():
        assert len(r["cold_s"]) == 3 and len(r["follow_up_s"]) == 6
        assert all(s > 0 for s in r["cold_s"] + r["follow_up_s"]) and r["median_ratio"] > 0
