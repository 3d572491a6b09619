"""A request's window of the target's features: what the orchestrator keeps for a
feature drafter's resync, and what it asks the verifier for."""

import pytest

from orchestrator.pool import FeatureRule
from orchestrator.links import FeatureFeed
from specdec import features
from specdec.api.common.v1 import common_pb2
from specdec.errors import InvalidArgument

WIDTH = 2


def rows(start: int, n: int) -> common_pb2.Features:
    """Rows whose values name their position (position p: bytes p, p, p, p)."""
    return common_pb2.Features(start=start, rows=n, width=WIDTH,
                               data=b"".join(bytes([p % 256]) * (WIDTH * features.BYTES) for p in range(start, start + n)))


def positions(message: common_pb2.Features) -> list[int]:
    size = WIDTH * features.BYTES
    return [message.data[i * size] for i in range(message.rows)]


def test_the_window_keeps_the_last_positions_and_serves_runs_of_them():
    window = features.Window(5)
    window.add(rows(0, 3))
    window.add(rows(3, 4))  # 7 positions: the first two fall out
    assert (window.start, window.end) == (2, 7)
    assert positions(window.since(3, 6)) == [3, 4, 5]
    assert window.since(1, 4) is None  # fell out of the window
    assert window.since(5, 8) is None  # not there yet
    window.add(rows(6, 2))  # a position sent again (a run, then a round) replaces what was there
    assert (window.start, window.end) == (3, 8) and positions(window.since(6, 8)) == [6, 7]
    window.add(rows(20, 1))  # a gap: what it held is of no use, it starts again
    assert (window.start, window.end) == (20, 21)


def test_the_verifier_is_asked_from_the_first_position_the_window_lacks():
    feed = FeatureFeed(FeatureRule(layers=(2, 15, 27), window=4))
    request = feed.request(committed=10)  # nothing held: the last window of the prompt
    assert list(request.layers) == [2, 15, 27] and request.first_position == 6
    feed.window.add(rows(6, 3))  # positions 6-8: the committed history's all but the last
    assert feed.request(committed=12).first_position == 9
    assert feed.request(committed=1).first_position == 0


@pytest.mark.parametrize("bad, field", [
    (common_pb2.Features(start=0, rows=2, width=WIDTH, data=b"\0" * 3), "f.data"),
    (common_pb2.Features(start=-1, rows=0, width=WIDTH), "f"),
    (rows(0, 1), "f.width"),
])
def test_bad_features_name_the_field(bad, field):
    with pytest.raises(InvalidArgument) as err:
        features.check("f", bad, width=None if field != "f.width" else 3 * WIDTH)
    assert err.value.field == field


def test_features_round_trip_in_half_precision():
    import torch

    values = torch.tensor([[1.5, -2.25, 3.0], [0.0, 65504.0, -0.5]])
    assert torch.equal(features.decode(features.encode(7, values)), values)
    assert features.encode(7, values).start == 7
