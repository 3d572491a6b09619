"""The target's features of the blocks sessions computed, kept after the sessions end:
the prefix cache keeps a shared prefix's keys and values, this keeps the features that
feature drafters read of it, so a request whose prompt starts as an earlier one's (the
chat template, a system prompt, a chat's earlier turns and answers) is not computed
whole again for them.

Blocks are the KV pool's (block_size positions), known by the same prefix digests
(`prefix_digests`) and the layers they hold, and their tokens are compared on every hit.
The least recently used blocks go first past the budget. A block's features are the
target's hidden states after those exact tokens: whoever computed them, they are what a
drafter would have been sent (they guide drafts only; the verifier checks every draft)."""

from collections import OrderedDict

from specdec.api.common.v1 import common_pb2
from specdec.runtime.engine.block_manager import prefix_digests
from specdec.features import BYTES, Window


class FeatureCache:
    def __init__(self, budget_bytes: int, block_size: int, metric=None):
        self.budget, self.block_size = budget_bytes, block_size
        self.metric = metric  # a counter of the positions served
        # (layers, prefix digest) -> (the block's tokens, its rows as float16 bytes)
        self.blocks: OrderedDict[tuple[tuple[int, ...], bytes], tuple[tuple[int, ...], bytes]] = OrderedDict()
        self.bytes = 0

    def lookup(self, layers: tuple[int, ...], tokens: list[int], first: int, end: int) -> tuple[int, bytes]:
        """The features held of positions [first, stop) for the largest stop <= end, as
        float16 rows: (stop, their bytes); (first, b"") where the block of `first` is not held."""
        bs = self.block_size
        if not self.budget or end - first < bs:  # a round's few positions: not worth the digests
            return first, b""
        digests = prefix_digests(tokens[:end - end % bs], bs)
        parts, stop = [], first
        for i in range(first // bs, len(digests)):
            held = self.blocks.get((layers, digests[i]))
            if held is None or held[0] != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            self.blocks.move_to_end((layers, digests[i]))
            row = len(held[1]) // bs
            parts.append(held[1][(stop - i * bs) * row:])
            stop = (i + 1) * bs
        if self.metric is not None and stop > first:
            self.metric.inc(stop - first)
        return stop, b"".join(parts)

    def store(self, layers: tuple[int, ...], tokens: list[int], features: common_pb2.Features,
              pending: "Pending | None" = None) -> None:
        """Keeps the whole blocks of `features` (rows of committed positions of `tokens`);
        with `pending`, the session's rows since its last whole block come first, and the
        rows after its new last whole block wait there for the next call's."""
        bs = self.block_size
        if not self.budget or not features.rows:
            return
        row = features.width * BYTES
        start, data = features.start, features.data
        if pending is not None:
            pending.add(layers, features)
            start, data = pending.rows.start, pending.rows.data
        begin, end = -(-start // bs), (start + len(data) // row) // bs  # whole blocks
        if begin >= end:
            return
        digests = prefix_digests(tokens[:end * bs], bs, pending.digests if pending is not None else [])
        for i in range(begin, end):
            key = (layers, digests[i])
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            at = (i * bs - start) * row
            block = bytes(data[at:at + bs * row])
            self.blocks[key] = (tuple(tokens[i * bs:(i + 1) * bs]), block)
            self.bytes += len(block)
        while self.bytes > self.budget and self.blocks:
            _, (_, block) = self.blocks.popitem(last=False)
            self.bytes -= len(block)
        if pending is not None:
            pending.digests = digests
            pending.rows.cut(end * bs)  # the rows after the last whole block wait for the next call's


class Pending:
    """A session's features since its last whole block, and the prefix digests of its
    tokens' blocks so far: a session whose features come a few rows a call (each round's,
    each step of a run) adds its output's blocks to the cache too, for the next turn of a
    chat, which sends them back as its prompt."""

    def __init__(self):
        self.layers: tuple[int, ...] = ()
        self.rows = Window(None)
        self.digests: list[bytes] = []

    def crop(self, position: int, block_size: int) -> None:
        """The session's tokens from `position` on may change (a call's start)."""
        del self.digests[position // block_size:]
        self.rows.crop(position)

    def add(self, layers: tuple[int, ...], rows: common_pb2.Features) -> None:
        """`rows` after those held (they replace those held from their start on)."""
        if layers != self.layers:
            self.layers, self.rows = layers, Window(None)
        self.rows.add(rows)


def join(start: int, cached: bytes, computed: common_pb2.Features) -> common_pb2.Features:
    """The cached rows from `start`, then the computed ones (which follow them)."""
    if not cached:
        return computed
    rows = len(cached) // (computed.width * BYTES)
    assert start + rows == computed.start, (start, rows, computed.start)
    return common_pb2.Features(start=start, rows=rows + computed.rows, width=computed.width,
                               data=cached + computed.data)
