"""The target's features on the wire (common.v1.Features: rows of float16 values, one a
position) and the window of them a request keeps for its drafter's resync.

The orchestrator handles them as bytes only (it never loads torch): it slices rows and
joins runs of them."""

from specdec.api.common.v1 import common_pb2
from specdec.errors import InvalidArgument

BYTES = 2  # float16


def encode(start: int, rows) -> common_pb2.Features:
    """rows: a tensor [n, width] (any float dtype, any device) -> Features from `start`."""
    import torch

    half = rows.detach().to(device="cpu", dtype=torch.float16).contiguous()
    return common_pb2.Features(start=start, rows=half.shape[0], width=half.shape[1],
                               data=half.numpy().astype("<f2", copy=False).tobytes())


def decode(features: common_pb2.Features):
    """-> a float32 tensor [rows, width] on the CPU."""
    import numpy as np
    import torch

    values = np.frombuffer(features.data, dtype="<f2").reshape(features.rows, features.width)
    return torch.from_numpy(values.astype(np.float32))


def check(field: str, features: common_pb2.Features, width: int | None = None) -> None:
    """InvalidArgument naming `field` unless the message holds what it says."""
    if features.start < 0 or features.rows < 0 or features.width <= 0 and features.rows:
        raise InvalidArgument(field, f"start ({features.start}), rows ({features.rows}) and width "
                                     f"({features.width}) must be >= 0 (width > 0 with rows)")
    if len(features.data) != features.rows * features.width * BYTES:
        raise InvalidArgument(f"{field}.data", f"holds {len(features.data)} bytes; {features.rows} rows of "
                                               f"{features.width} half-precision values take "
                                               f"{features.rows * features.width * BYTES}")
    if width is not None and features.rows and features.width != width:
        raise InvalidArgument(f"{field}.width", f"must be {width} (hidden size times layers), got {features.width}")


class Window:
    """A request's features of its last `size` positions (None: all since the first one
    held), what a drafter that lost the session needs to draft again (its attention reads
    no further back)."""

    def __init__(self, size: int | None):
        self.size = size
        self.start = 0  # position of the first row held
        self.width = 0
        # Appended to and cut from the front in place (a bytearray moves its start on a
        # front cut): an add costs its own rows, not the window's.
        self.data = bytearray()

    @property
    def end(self) -> int:
        """One past the last position held."""
        return self.start + (len(self.data) // (self.width * BYTES) if self.width else 0)

    def add(self, features: common_pb2.Features) -> None:
        """Rows from features.start on: they replace what the window held from there (a
        run of the target alone, then a round, may send a position twice)."""
        if not features.rows:
            return
        row = features.width * BYTES
        if self.width != features.width or features.start > self.end or features.start < self.start:
            self.start, self.width, self.data = features.start, features.width, bytearray()  # a gap: start again
        del self.data[(features.start - self.start) * row:]
        self.data += features.data
        if self.size is not None and (over := len(self.data) // row - self.size) > 0:
            self.cut(self.start + over)

    def since(self, position: int, end: int) -> common_pb2.Features | None:
        """The rows of positions [position, end), or None where the window lacks one of them."""
        if not self.width or position < self.start or end > self.end or position > end:
            return None
        row = self.width * BYTES
        return common_pb2.Features(start=position, rows=end - position, width=self.width,
                                   data=bytes(self.data[(position - self.start) * row:(end - self.start) * row]))

    def cut(self, position: int) -> None:
        """Forgets the positions before `position`."""
        if self.width and position > self.start:
            n = min(position, self.end) - self.start
            del self.data[:n * self.width * BYTES]
            self.start += n

    def crop(self, end: int) -> None:
        """Forgets the positions from `end` on."""
        if self.width and end < self.end:
            del self.data[max(0, end - self.start) * self.width * BYTES:]
