"""Proposers: whatever produces draft tokens sits behind this one interface.

A proposer keeps nothing between calls except the per-session TokenSequence the service
hands it; the service syncs that sequence with the committed history before `propose`.
A model proposer runs its steps through the batching engine, so the draft steps of
sessions drafting at the same time share forward passes. Prompt lookup is not drafted
here: a drafter reports its rule (`with_lookup_rule`) and the orchestrator, which owns
the history, drafts those rounds itself."""

import abc
import os
import asyncio
from typing import AsyncIterator

import torch

from specdec import features as specdec_features, model_files, sampling, sampling_params
from specdec.runtime import eagle, modeling
from specdec.api.common.v1 import common_pb2
from specdec.runtime.engine import Engine, PagedSequence, TokenSequence

# One draft token, and the sparse distribution it was sampled from (None: one-hot).
Draft = tuple[int, common_pb2.SparseDistribution | None]


class Proposer(abc.ABC):
    @abc.abstractmethod
    def info(self) -> common_pb2.ModelInfo: ...

    @abc.abstractmethod
    def new_sequence(self) -> TokenSequence: ...

    def release(self, seq: TokenSequence) -> None:
        """A session closed: give back what its sequence holds."""

    def take_features(self, seq: TokenSequence, features: common_pb2.Features) -> None:
        """The target's features of committed positions, for a proposer that drafts from
        them (others ignore them)."""

    @abc.abstractmethod
    def propose(self, seq: TokenSequence, k: int, params: common_pb2.SamplingParams,
                draw_at: int | None = None) -> AsyncIterator[Draft]:
        """Yields up to k draft tokens following seq.tokens, appending each to seq; a
        sampled i-th draft's draw is keyed by draw_at + i (default: its own position)."""


def draw(logits: torch.Tensor, params: common_pb2.SamplingParams, draws: sampling.Draws, position: int,
         history: list[int], output_ids: torch.Tensor | None, max_support: int) -> Draft:
    """A draft token after `history` from logits [vocab] (over the tokens `output_ids`
    names, if given), with the request's bias and penalties as the target applies them:
    greedy, the argmax and no q; sampled, a draw keyed by `position` from the top
    `max_support` tokens of q, and exactly that sparse distribution."""
    def token_of(index):
        return index if output_ids is None else output_ids[index]

    logits = sampling.penalize(logits[None], params, history, columns=output_ids)[0]
    if sampling_params.is_greedy(params):
        return int(token_of(sampling.argmax(logits)[0])), None
    p = sampling.probs(logits, params)
    support = torch.topk(p, min(max_support, p.shape[-1]))
    # One copy to the host per step; the draw is made there (Draws is host-side).
    values, support_ids = support.values.cpu(), token_of(support.indices).cpu()
    kept = values > 0
    values, support_ids = values[kept], support_ids[kept]
    q_probs = values / values.sum()
    token = int(support_ids[draws.sample(q_probs, position)])
    return token, common_pb2.SparseDistribution(token_ids=support_ids.tolist(), probs=q_probs.tolist())


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

    def info(self) -> common_pb2.ModelInfo:
        info = modeling.model_info(self.model, self.tokenizer, self.name, "model")
        info.numerics = self.engine.numerics  # which path its passes take, as the verifier's says
        return info

    def new_sequence(self) -> PagedSequence:
        return self.engine.new_sequence()

    def release(self, seq: PagedSequence) -> None:
        self.engine.release(seq)

    async def propose(self, seq: PagedSequence, k: int, params: common_pb2.SamplingParams,
                      draw_at: int | None = None) -> AsyncIterator[Draft]:
        draws = sampling.Draws(params.seed, "draft")
        draw_at = len(seq.tokens) if draw_at is None else draw_at
        for i in range(k):
            logits = (await seq.logits(1, again=i + 1 < k))[0][0]  # [vocab]
            token, q = draw(logits, params, draws, draw_at + i, seq.tokens, self.output_ids, self.max_support)
            seq.extend([token])
            yield token, q


class FeatureSequence(TokenSequence):
    """A session of a feature drafter: its tokens, the head's keys and values of the
    committed positions it has features for (`cache`, up to `real`), and the features
    it was sent but has not run yet (`pending`, from position `pending_start`)."""

    def __init__(self):
        super().__init__()
        self.cache = eagle.HeadCache()
        self.real = 0  # the cache's committed positions end here; beyond: the last round's drafts
        self.pending: torch.Tensor | None = None
        self.pending_start = 0
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (g, logits) of position real - 1

    def sync(self, start: int, new_tokens: list[int]) -> int:
        kept = super().sync(start, new_tokens)
        # f[i] holds while x[..i] does, a pair (f[i], x[i+1]) while x[i+1] does too; the
        # cache's entries beyond `real` (a round's drafts) never hold.
        end = min(self.real, max(0, kept - 1))
        if end < self.cache.first:
            self.cache = eagle.HeadCache()
            self.cache.first = self.cache.end = end
        self.cache.crop(end)
        if end < self.real:
            self.real, self.last = end, None
        if self.pending is not None:
            self.pending = self.pending[:max(0, kept - self.pending_start)]
        return kept


class HeadBatcher:
    """The head's steps of the sessions drafting at the same time go through one pass:
    a step waits for the pass running now, and the next pass takes every step that
    came meanwhile. Passes run on one thread of their own with `threads` torch threads."""

    def __init__(self, head: eagle.Eagle3Head, threads: int):
        import concurrent.futures

        self.head = head
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "head", initializer=torch.set_num_threads,
                                                          initargs=(threads,))
        self.waiting: list[tuple[tuple, asyncio.Future]] = []
        self.running = False

    async def step(self, row: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((row, future))
        if not self.running:
            self.running = True
            asyncio.ensure_future(self._passes())
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The row's cache is being written: the session must not change before the pass ends.
            await asyncio.wait([future])
            raise

    async def _passes(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.waiting:
                await asyncio.sleep(0)  # the steps ready now join this pass
                batch, self.waiting = self.waiting, []
                try:
                    outs = await loop.run_in_executor(self.pool, self.head.step, [row for row, _ in batch])
                except Exception as err:  # the pass's rows fail, never the batcher
                    for _, future in batch:
                        future.set_exception(err)
                    continue
                for (_, future), g, logits in zip(batch, *outs):
                    future.set_result((g, logits))
        finally:
            self.running = False


class FeatureProposer(Proposer):
    """An EAGLE-3 head (specdec.runtime.eagle): drafts from the target's features, which the
    orchestrator forwards from the verifier, and from its own outputs. Where it lacks the
    features of any committed position up to the one before the last (within its window)
    it drafts nothing: it never guesses a feature. Sampled drafting sends q as the model
    proposer does."""

    def __init__(self, head: eagle.Eagle3Head, tokenizer, name: str, threads: int, max_support: int = 64):
        self.head, self.tokenizer, self.name, self.max_support = head, tokenizer, name, max_support
        self.batcher = HeadBatcher(head, max(1, threads or (os.cpu_count() or 1)))
        self.output_ids = head.token_ids
        self.width = len(head.aux_layers) * head.config.target_hidden

    def info(self) -> common_pb2.ModelInfo:
        config = self.head.config
        eos = self.tokenizer.eos_token_id
        return common_pb2.ModelInfo(
            model_name=self.name, vocab_size=self.head.embed_tokens.num_embeddings,
            vocab_fingerprint=model_files.vocab_fingerprint(self.tokenizer), eos_token_ids=[] if eos is None else [eos],
            max_positions=int(config.layer.get("max_position_embeddings") or 1 << 20), kind="feature",
            feature_layers=list(self.head.aux_layers), feature_window=self.head.window,
            hidden_size=config.target_hidden)

    def new_sequence(self) -> FeatureSequence:
        return FeatureSequence()

    def take_features(self, seq: FeatureSequence, features: common_pb2.Features) -> None:
        if not features.rows:
            return
        rows = specdec_features.decode(features).to(self.head.fc.weight.device, self.head.fc.weight.dtype)
        start = features.start
        if seq.pending is not None and seq.pending_start <= start <= seq.pending_start + len(seq.pending):
            rows = torch.cat([seq.pending[:start - seq.pending_start], rows])
            start = seq.pending_start
        if start > seq.real or start < seq.cache.first:
            # What the head holds does not reach these features: it starts again from them
            # (a resync sends the window from its start).
            seq.cache, seq.real, seq.last = eagle.HeadCache(), start, None
            seq.cache.first = seq.cache.end = start
        seq.pending, seq.pending_start = rows, start

    async def _catch_up(self, seq: FeatureSequence, committed: int) -> bool:
        """Runs the pairs (f[i], x[i+1]) of committed positions the head has features for
        but has not run; -> whether it now holds every one up to committed - 2."""
        seq.cache.crop(seq.real)  # the last round's drafts
        want = committed - 1  # pairs i < want: x[i+1] is committed
        if seq.pending is not None and seq.pending_start <= seq.real < want:
            rows = seq.pending[seq.real - seq.pending_start:want - seq.pending_start]
            if len(rows):
                tokens = torch.tensor(seq.tokens[seq.real + 1:seq.real + 1 + len(rows)],
                                      device=rows.device)
                seq.last = await self.batcher.step((seq.cache, tokens, rows, seq.real, True))
                seq.real += len(rows)
        if seq.pending is not None and seq.pending_start + len(seq.pending) <= seq.real:
            seq.pending = None
        return seq.real == want and seq.last is not None

    async def propose(self, seq: FeatureSequence, k: int, params: common_pb2.SamplingParams,
                      draw_at: int | None = None) -> AsyncIterator[Draft]:
        committed = len(seq.tokens)
        if committed < 2 or not await self._catch_up(seq, committed):
            return
        draws = sampling.Draws(params.seed, "draft")
        draw_at = committed if draw_at is None else draw_at
        g, logits = seq.last
        try:
            for j in range(k):
                token, q = draw(logits, params, draws, draw_at + j, seq.tokens, self.output_ids, self.max_support)
                seq.extend([token])
                yield token, q
                if j + 1 < k:
                    tokens = torch.tensor([token], device=g.device)
                    g, logits = await self.batcher.step((seq.cache, tokens, g[None], seq.real + j, False))
        finally:
            seq.cache.crop(seq.real)


class NoModel(Proposer):
    """A drafter without a model (--proposer ngram): it drafts nothing itself. The
    orchestrator owns the history and drafts lookup rounds from it by the rule this
    drafter reports (specdec.lookup), so a lookup costs no call."""

    def info(self) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(model_name="ngram", max_positions=1 << 30, kind="ngram")

    def new_sequence(self) -> TokenSequence:
        return TokenSequence()

    async def propose(self, seq: TokenSequence, k: int, params: common_pb2.SamplingParams,
                      draw_at: int | None = None) -> AsyncIterator[Draft]:
        return
        yield


def with_lookup_rule(info: common_pb2.ModelInfo, kind: str, min_n: int, max_n: int) -> common_pb2.ModelInfo:
    """The proposer's info, reporting the prompt-lookup rule the orchestrator drafts by:
    the shortest and longest suffix it matches."""
    reported = common_pb2.ModelInfo()
    reported.CopyFrom(info)
    reported.kind, reported.lookup_min_match, reported.lookup_max_match = kind, min_n, max_n
    return reported
