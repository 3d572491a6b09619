"""`specdec bench wire` as a smoke test: each way of carrying a round runs
against a real server process and give sane figures. Not a timing test."""

from deploy.bench import wire


def test_each_way_of_carrying_a_round_runs():
    for support in (0, 8):
        result = wire.measure(k=3, support=support, rounds=20)
        assert set(result) == {"calls", "per-draft", "streams"}
        for figures in result.values():
            assert 0 < figures["median_ms"] <= figures["p90_ms"] < 1000
