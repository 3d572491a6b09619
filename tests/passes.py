"""The engine's pass of the same rows under different forwards, for tests that hold one
forward to another's bits."""

import torch


def logits_by_forward(engine, seqs, forwards, last: int = 3) -> list[list[torch.Tensor]]:
    """For each forward in turn: every sequence's cache dropped, then one pass of all of
    them together (each computing its tokens again) -> the logits of each one's last
    `last` positions."""
    outputs = []
    for forward in forwards:
        engine.runner.forward = forward
        for seq in seqs:
            engine.crop(seq, 0)
        with engine.cond:
            works = [engine.submit(seq, last) for seq in seqs]
        outputs.append([work.future.result()[0] for work in works])
    return outputs
