"""The target's features of prompt blocks, kept after their sessions end: the prefix
cache keeps a shared prompt's keys and values, this keeps the features feature drafters
read of it, so a request whose prompt starts as an earlier one's (a system prompt, the
chat template, a chat's earlier turns) is not computed whole again for them.

Blocks are the KV pool's (block_size positions), known by the same prefix digests
(`prefix_digests`) and the layers they hold, and their tokens are compared on every hit.
The least recently used blocks go first past the budget. A block's features are the
target's hidden states after those exact tokens: whoever computed them, they are what a
drafter would have been sent (they guide drafts only; the verifier checks every draft)."""

from collections import OrderedDict

from specdec.common.v1 import common_pb2
from specdec.engine.block_manager import prefix_digests
from specdec.features import BYTES


class FeatureCache:
    def __init__(self, budget_bytes: int, block_size: int, metric=None):
        self.budget, self.block_size = budget_bytes, block_size
        self.metric = metric  # a counter of the positions served
        # (layers, prefix digest) -> (the block's tokens, its rows as float16 bytes)
        self.blocks: OrderedDict[tuple[tuple[int, ...], bytes], tuple[tuple[int, ...], bytes]] = OrderedDict()
        self.bytes = 0
        self.served = 0  # positions whose features came from here

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
        self.served += stop - first
        if self.metric is not None and stop > first:
            self.metric.inc(stop - first)
        return stop, b"".join(parts)

    def store(self, layers: tuple[int, ...], tokens: list[int], features: common_pb2.Features) -> None:
        """Keeps the full blocks of `features` (rows of committed positions of `tokens`)."""
        bs = self.block_size
        begin, end = -(-features.start // bs), (features.start + features.rows) // bs  # whole blocks
        if not self.budget or begin >= end:
            return
        row = features.width * BYTES
        digests = prefix_digests(tokens[:end * bs], bs)
        for i in range(begin, end):
            key = (layers, digests[i])
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            at = (i * bs - features.start) * row
            data = features.data[at:at + bs * row]
            self.blocks[key] = (tuple(tokens[i * bs:(i + 1) * bs]), data)
            self.bytes += len(data)
        while self.bytes > self.budget and self.blocks:
            _, (_, data) = self.blocks.popitem(last=False)
            self.bytes -= len(data)


def join(start: int, cached: bytes, computed: common_pb2.Features) -> common_pb2.Features:
    """The cached rows from `start`, then the computed ones (which follow them)."""
    if not cached:
        return computed
    rows = len(cached) // (computed.width * BYTES)
    assert start + rows == computed.start, (start, rows, computed.start)
    return common_pb2.Features(start=start, rows=rows + computed.rows, width=computed.width,
                               data=cached + computed.data)
