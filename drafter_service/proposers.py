"""Proposers: whatever produces draft tokens sits behind this one interface.

A proposer keeps nothing between calls except the per-session TokenSequence the service
hands it; the service syncs that sequence with the committed history before `propose`.
A model proposer runs its steps through the batching engine, so the draft steps of
sessions drafting at the same time share forward passes."""

import abc
from typing import AsyncIterator

import torch

from specdec import modeling, sampling
from specdec.common.v1 import common_pb2
from specdec.engine import Engine, PagedSequence, TokenSequence
from specdec.lookup import suffix_match

# One draft token, and the sparse distribution it was sampled from (None: one-hot).
Draft = tuple[int, common_pb2.SparseDistribution | None]


class Proposer(abc.ABC):
    @abc.abstractmethod
    def info(self) -> common_pb2.ModelInfo: ...

    @abc.abstractmethod
    def new_sequence(self) -> TokenSequence: ...

    def release(self, seq: TokenSequence) -> None:
        """A session closed: give back what its sequence holds."""

    def by_model(self) -> "Proposer | None":
        """The proposer that drafts with the model alone (None: there is no model)."""
        return None

    @abc.abstractmethod
    def propose(self, seq: TokenSequence, k: int, params: common_pb2.SamplingParams) -> AsyncIterator[Draft]:
        """Yields up to k draft tokens following seq.tokens, appending each to seq."""


class ModelProposer(Proposer):
    """A small causal LM. Greedy drafting sends token ids only; sampled drafting samples
    from the top `max_support` tokens of q and sends exactly that sparse distribution,
    so what crosses the network is the distribution actually used. A model whose output
    head was cut to a draft vocabulary (`output_ids`: the token id of each logit) drafts
    from that vocabulary only; q is zero elsewhere, which the verifier's rule allows."""

    def __init__(self, engine: Engine, tokenizer, name: str, max_support: int = 64,
                 output_ids: torch.Tensor | None = None):
        self.engine, self.model, self.tokenizer, self.name = engine, engine.model, tokenizer, name
        self.max_support, self.output_ids = max_support, output_ids

    def _token(self, index: torch.Tensor):
        return index if self.output_ids is None else self.output_ids[index]

    def info(self) -> common_pb2.ModelInfo:
        return modeling.model_info(self.model, self.tokenizer, self.name, "model")

    def new_sequence(self) -> PagedSequence:
        return self.engine.new_sequence()

    def release(self, seq: PagedSequence) -> None:
        self.engine.release(seq)

    def by_model(self) -> Proposer:
        return self

    async def propose(self, seq: PagedSequence, k: int, params: common_pb2.SamplingParams) -> AsyncIterator[Draft]:
        draws = sampling.Draws(params.seed, "draft")
        for i in range(k):
            logits = (await seq.logits(1, again=i + 1 < k))[0][0]  # [vocab]
            if sampling.is_greedy(params):
                token, q = int(self._token(logits.argmax())), None
            else:
                p = sampling.probs(logits, params)
                support = torch.topk(p, min(self.max_support, p.shape[-1]))
                # One copy to the host per step; the draw is made there (Draws is host-side).
                values, support_ids = support.values.cpu(), self._token(support.indices).cpu()
                kept = values > 0
                values, support_ids = values[kept], support_ids[kept]
                q_probs = values / values.sum()
                token = int(support_ids[draws.sample(q_probs, len(seq.tokens))])
                q = common_pb2.SparseDistribution(token_ids=support_ids.tolist(), probs=q_probs.tolist())
            seq.extend([token])
            yield token, q


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (longest n first) and propose the tokens that followed it. No model, no
    probabilities: q is one-hot, and the verifier's rule still holds."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= ngram min ({min_n}) <= ngram max ({max_n})")
        self.max_n, self.min_n = max_n, min_n

    def info(self) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(model_name="ngram", max_positions=1 << 30, kind="ngram",
                                    lookup_min_match=self.min_n, lookup_max_match=self.max_n)

    def new_sequence(self) -> TokenSequence:
        return TokenSequence()

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        return suffix_match(tokens, k, self.max_n, self.min_n)

    async def propose(self, seq: TokenSequence, k: int, params: common_pb2.SamplingParams) -> AsyncIterator[Draft]:
        for token in self.lookup(seq.tokens, k):
            seq.extend([token])
            yield token, None


class HybridProposer(Proposer):
    """Prompt lookup when the context holds a long match, the model's draft otherwise,
    chosen per round. Where the output copies its context (edit this text, fix this
    code, extract these fields) a long match predicts a long run at no cost; elsewhere a
    short match mostly predicts wrong, and the model drafts better (SuffixDecoding, Oliaro
    et al. 2024, makes the same split with a suffix tree and match scores). A lookup round
    sends one-hot q, a model round what the model sends: within a round all drafts come
    from one source, and the verifier's rule holds for either."""

    def __init__(self, model: ModelProposer, lookup: NgramProposer):
        self.model, self.lookup = model, lookup

    def info(self) -> common_pb2.ModelInfo:
        info = self.model.info()
        info.kind = "hybrid"
        info.lookup_min_match, info.lookup_max_match = self.lookup.min_n, self.lookup.max_n
        return info

    def new_sequence(self) -> PagedSequence:
        return self.model.new_sequence()

    def release(self, seq: PagedSequence) -> None:
        self.model.release(seq)

    def by_model(self) -> Proposer:
        return self.model

    async def propose(self, seq: PagedSequence, k: int, params: common_pb2.SamplingParams) -> AsyncIterator[Draft]:
        found = self.lookup.lookup(seq.tokens, k)
        if found:
            for token in found:  # the model's cache catches up with them at its next step
                seq.extend([token])
                yield token, None
            return
        async for draft in self.model.propose(seq, k, params):
            yield draft
