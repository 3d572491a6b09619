"""The engine's float64 attention kernel on a CPU (specdec/runtime/kernels/attention_cpu.cpp):
what transformers' float64 attention gives, to the float32 bit, for rows of different
lengths and widths with grouped key-value heads; a token's result the same alone and
among others; bad tables refused, not read."""

import pytest
import torch

from specdec.runtime.kernels import cpu
from specdec.runtime.quantize import float64_attention

HEADS, KV_HEADS, DIM, SLOTS = 6, 2, 64, 400


class Layer:  # what transformers' attention reads of its module
    is_causal = True
    num_key_value_groups = HEADS // KV_HEADS
    training = False


def pools(seed=0, dim=DIM):
    draw = torch.Generator().manual_seed(seed)
    return (torch.randn(SLOTS, KV_HEADS, dim, generator=draw), torch.randn(SLOTS, KV_HEADS, dim, generator=draw))


def reference(q, k_pool, v_pool, slots, start, n, softcap=None):
    """One row through transformers' float64 sdpa (with a softcap, the engine's written-out
    attention): its n new tokens from position `start`, reading slots[:start + n] causally."""
    k = k_pool[slots[:start + n]].transpose(0, 1)[None]  # [1, kv, L, d]
    v = v_pool[slots[:start + n]].transpose(0, 1)[None]
    mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    out, _ = float64_attention(Layer(), q.transpose(0, 1)[None], k, v, mask[None, None], scaling=q.shape[-1] ** -0.5,
                               dropout=0.0, softcap=softcap)
    return out[0]  # [n, heads, d]


def table(rows):
    """rows: [(slots, start, n)] -> the kernel's (slots [B, L], row of each token, lengths)."""
    slots = torch.nn.utils.rnn.pad_sequence([s[:start + n] for s, start, n in rows], batch_first=True)
    token_rows = torch.tensor([b for b, (_, _, n) in enumerate(rows) for _ in range(n)])
    lengths = torch.tensor([p + 1 for _, start, n in rows for p in range(start, start + n)])
    return slots, token_rows, lengths


@pytest.mark.parametrize("dim, softcap", [(DIM, None), (48, None), (DIM, 2.0)])  # 48: a head the widest path's
# blocks of 64 do not cover; 2.0: Gemma 2's cap of each score, small enough to count here
def test_rows_attend_as_transformers_float64_attention_does(dim, softcap):
    k_pool, v_pool = pools(dim=dim)
    draw = torch.Generator().manual_seed(1)
    rows = [(torch.randperm(SLOTS, generator=draw)[:200], start, n) for start, n in [(0, 1), (37, 5), (150, 1), (
        0, 48), (90, 9)]]
    q = torch.randn(sum(n for _, _, n in rows), HEADS, dim, generator=draw)
    out = cpu().attention(q, k_pool, v_pool, *table(rows), dim ** -0.5, softcap or 0.0)
    offset = 0
    for slots, start, n in rows:
        expected = reference(q[offset:offset + n], k_pool, v_pool, slots, start, n, softcap)
        assert torch.equal(out[offset:offset + n], expected), (start, n)
        offset += n
    if softcap:  # the control: the cap counts
        assert not torch.allclose(out, cpu().attention(q, k_pool, v_pool, *table(rows), dim ** -0.5), atol=1e-3)


def test_a_token_gets_the_same_bits_alone_and_among_others():
    k_pool, v_pool = pools(2)
    draw = torch.Generator().manual_seed(3)
    rows = [(torch.randperm(SLOTS, generator=draw)[:120], 100 + i, 3 + i) for i in range(4)]
    q = torch.randn(sum(n for _, _, n in rows), HEADS, DIM, generator=draw)
    together = cpu().attention(q, k_pool, v_pool, *table(rows), DIM ** -0.5)
    offset = 0
    for slots, start, n in rows:
        for j in range(n):  # each token alone, as a one-token step at its position
            alone = cpu().attention(q[offset + j:offset + j + 1], k_pool, v_pool, *table([(slots, start + j, 1)]),
                                    DIM ** -0.5)
            assert torch.equal(alone[0], together[offset + j])
        offset += n


def test_the_bits_do_not_depend_on_the_threads():
    """The work is split by the threads there are (more threads than cores too): no query's
    result depends on the split."""
    k_pool, v_pool = pools(4)
    draw = torch.Generator().manual_seed(5)
    rows = [(torch.randperm(SLOTS, generator=draw)[:300], start, n) for start, n in [(250, 1), (40, 7), (200, 3)]]
    q = torch.randn(sum(n for _, _, n in rows), HEADS, DIM, generator=draw)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            outs.append(cpu().attention(q, k_pool, v_pool, *table(rows), DIM ** -0.5))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_a_table_that_reads_outside_the_pool_or_its_row_is_refused():
    k_pool, v_pool = pools()
    q = torch.randn(1, HEADS, DIM)
    slots, rows, lengths = table([(torch.arange(10), 4, 1)])
    with pytest.raises(RuntimeError, match="out of the pool"):
        cpu().attention(q, k_pool, v_pool, slots + SLOTS, rows, lengths, 1.0)
    with pytest.raises(RuntimeError, match="outside its row"):
        cpu().attention(q, k_pool, v_pool, slots, rows, lengths + 10, 1.0)
    with pytest.raises(RuntimeError, match="heads"):
        cpu().attention(torch.randn(1, 5, DIM), k_pool, v_pool, slots, rows, lengths, 1.0)
