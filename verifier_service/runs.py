"""Runs of the target alone on a session: a token per pass (each pass shared with the
other sessions ready), each picked as a round without drafts would pick it, by the same
rule (verifier_service.acceptance). A run may draft within itself, at no round trip: the
tokens a constraint forces next (`draft_forced`), or, where nothing is forced, the
prompt-lookup match of the committed tokens (`draft_lookup`), or else the drafts a
drafter offered meanwhile (`Offers`: made while the run went on, so the run never waits
for them); the next pass checks them as a round checks drafts, so a pass can commit
several."""

import collections
import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import AsyncIterator

import torch

from specdec import grammar, sampling, sampling_params
from specdec.api.common.v1 import common_pb2
from specdec.runtime.engine import PagedSequence, Pass
from specdec.errors import InvalidArgument
from specdec.features import encode as encode_features
from specdec.lookup import LookupIndex
from specdec.api.verifier.v1 import verifier_pb2
from verifier_service.acceptance import judge
from verifier_service.feature_cache import FeatureCache, join as join_features
from verifier_service.passes import beside_the_loop, cached_features, constrained, pending_features, token_logprobs


@dataclass
class Picked:
    """A token of a run, with what its pass says of it."""
    token: int
    batch_pass: Pass
    features: common_pb2.Features | None  # the target's features of the positions its pass computed, if asked
    drafted: bool  # a draft the pass kept (else the pass's own token)
    rejected: int  # on a pass's own token: the drafts that pass rejected
    logprobs: common_pb2.TokenLogprobs | None  # where asked
    by_lookup: bool  # the own token of a pass whose drafts came from the lookup
    offered: bool  # the own token of a pass whose drafts came from an offer


class Offers:
    """The latest drafts offered to a run: set on the event loop as they arrive, read on
    the engine's thread at each pick (one reference, replaced whole)."""

    def __init__(self):
        self.latest: tuple[int, list[int], list[common_pb2.SparseDistribution]] | None = None

    def offer(self, offer: verifier_pb2.DraftOffer) -> None:
        self.latest = (offer.position, list(offer.tokens), list(offer.probs))

    def after(self, history: list[int], position: int, tokens: list[int]
              ) -> tuple[list[int], list[common_pb2.SparseDistribution]]:
        """The latest offer's drafts after the committed history, `history[:position] +
        tokens`, and their q: none where the offer's first tokens (a guess when it was
        made) are not what the history committed there, or where it is spent."""
        if self.latest is None:
            return [], []
        start, drafts, probs = self.latest
        known = position + len(tokens) - start  # the offer's tokens the history has decided since
        if not 0 <= known < len(drafts):
            return [], []
        decided = history[start:position] + tokens if start < position else tokens[start - position:]
        if decided != drafts[:known]:
            return [], []
        return drafts[known:], probs[known:]


async def decode(seq: PagedSequence, request: verifier_pb2.DecodeRequest, max_positions: int,
                 guide: grammar.Guide | None = None, session=None, cache: FeatureCache | None = None,
                 offers: Offers | None = None) -> AsyncIterator[Picked]:
    """The target alone on a session: bring the cache to the committed history, then its
    picks until max_tokens, a stop token, the model's limit or a grammar that allows
    nothing more. With each token, the features asked for of the positions its pass
    computed (the first one's: those `cache` held, then those it computed)."""
    tail = pending_features(cache, session, request)
    seq.sync(request.start, list(request.new_tokens))
    if guide is not None:
        await beside_the_loop(guide, constrained, guide, seq.tokens, request.start)
    layers, first = tuple(request.features.layers), request.features.first_position
    end = len(seq.tokens) + min(request.max_tokens, max_positions - len(seq.tokens))
    # The in-run lookup's state lives with the session: a request's next run goes on from it.
    state = session if session is not None else SimpleNamespace(lookup_passed=None, lookup_index=None)
    run = _Run(seq, request, guide, state, end, drafts=not layers, offers=offers)  # a feature pass drafts nothing
    if not layers:
        async with contextlib.aclosing(seq.decode(run.pick)) as steps:  # closed with this generator
            async for token, done in steps:
                yield run.picked(token, done)
        return
    position, cached = cached_features(cache, layers, seq.tokens, first)  # of the next pass's first row
    first_pass = True  # it computes the committed positions the cache lacks (a prompt, or its end)
    async with contextlib.aclosing(seq.decode(run.pick, layers, len(seq.tokens) - position)) as steps:
        async for token, done, rows in steps:
            fresh = encode_features(position, rows)
            position += len(rows)
            if cache is not None:
                cache.store(layers, seq.tokens, fresh, tail)
            if first_pass:
                fresh, first_pass = join_features(first, cached, fresh), False
            yield run.picked(token, done, fresh)


class _Run:
    """A run's picks. `pick` runs on the engine's thread after each pass: it commits the
    pass's tokens and names the next pass's drafts (Engine.decode keeps them in the
    sequence); what it learnt of each token waits in `notes` for `picked`, in order."""

    def __init__(self, seq: PagedSequence, request: verifier_pb2.DecodeRequest, guide: grammar.Guide | None,
                 state, end: int, drafts: bool, offers: Offers | None = None):
        self.seq, self.request, self.guide, self.state, self.end = seq, request, guide, state, end
        self.offers = offers if drafts else None
        self.params, self.stop = request.sampling, set(request.stop_token_ids)
        self.forced = drafts and guide is not None and request.draft_forced
        self.lookup = self._lookup_index() if drafts and request.HasField("draft_lookup") else None
        self.pending: list[int] = []  # the drafts of the running pass
        self.pending_q: list[common_pb2.SparseDistribution] = []  # their q (empty: one-hot)
        self.source: str | None = None  # where `pending` came from: "lookup", "offer" (else forced, or none)
        self.notes: collections.deque = collections.deque()  # (drafted, rejected, logprobs, source) a token

    def _lookup_index(self) -> LookupIndex:
        """The session's index, kept where it still describes the committed history: each
        call then indexes only its new tokens, not the whole prompt again."""
        rule, tokens = self.request.draft_lookup, self.seq.tokens
        lookup = self.state.lookup_index
        if lookup is None or (lookup.min_n, lookup.max_n) != (rule.min_match, rule.max_match) \
                or tokens[:len(lookup.tokens)] != lookup.tokens:
            lookup = self.state.lookup_index = LookupIndex(rule.max_match, rule.min_match)
        lookup.update(tokens)
        return lookup

    def pick(self, logits: torch.Tensor) -> tuple[list[int], list[int], bool]:
        """-> (the tokens the pass commits, the next pass's drafts, whether the run goes on)."""
        position = len(self.seq.tokens) - len(self.pending)  # of the pass's first pick
        logits = sampling.penalize(logits, self.params, self.seq.tokens, position)
        accepted, token, logits = judge(logits, self.pending, self.pending_q, self.params, position, self.guide,
                                        self.request.logprobs)
        if self.source == "lookup":
            self.state.lookup_passed = accepted
        tokens = sampling_params.until_stop(self.pending[:accepted] + [token], self.stop)[:self.end - position]
        self._note(tokens, accepted, logits)
        if self.guide is not None:
            self._advance(tokens)
        goes_on = not (tokens[-1] in self.stop or position + len(tokens) >= self.end
                       or (self.guide is not None and self.guide.dead))
        drafts, qs, source = self._drafts(position, tokens) if goes_on else ([], [], None)
        self.pending = drafts[:self.end - position - len(tokens) - 1]
        self.pending_q = qs[:len(self.pending)]
        self.source = source if self.pending else None
        return tokens, self.pending, goes_on

    def _note(self, tokens: list[int], accepted: int, logits: torch.Tensor) -> None:
        own = len(tokens) - 1 >= accepted  # the last token is the pass's own (not a draft cut short)
        for i, t in enumerate(tokens):
            logprobs = token_logprobs(logits[i], t, self.request.top_logprobs) if self.request.logprobs else None
            last = own and i == len(tokens) - 1
            self.notes.append((not last, len(self.pending) - accepted if last else 0, logprobs,
                               self.source if last else None))

    def _advance(self, tokens: list[int]) -> None:
        guide = self.guide
        for t in tokens:
            # Picked under this guide's own mask: refused never, but for an end after the
            # grammar stopped (llguidance takes none then), unless its state moved meanwhile.
            if guide.advance(t) or t in self.stop:
                continue
            if guide.matcher.is_error():  # a step past the grammar's bounds
                raise InvalidArgument("constraint", f"failed at position {guide.end}: "
                                                    f"{guide.error.splitlines()[0]}")
            guide.vocab.refused += 1
            raise RuntimeError(f"the constraint refused the target's own pick {t} at position {guide.end}")

    def _drafts(self, position: int, tokens: list[int]) -> tuple[list[int], list, str | None]:
        """The next pass's drafts, their q (empty: one-hot) and where they came from: the
        tokens the grammar forces, else the lookup match (one draft before any of the
        session's lookup drafts passed, then up to twice as many as its last lookup-drafted
        pass kept: `lookup_passed`, carried from run to run of a request), else the latest
        offer's drafts after the committed history."""
        drafts = self.guide.forced() if self.forced else []
        if drafts:
            return drafts, [], None
        if self.lookup is not None:
            self.lookup.update(self.seq.tokens[:position] + tokens)  # the committed history only grows within a run
            passed = self.state.lookup_passed  # what the last lookup drafts kept (None: none drafted yet)
            k = min(self.request.draft_lookup.max_drafts, 1 if passed is None else max(1, 2 * passed))
            if drafts := self._allowed(self.lookup.match(k)):
                return drafts, [], "lookup"
        if self.offers is not None:
            drafts, qs = self.offers.after(self.seq.tokens, position, tokens)
            drafts = self._allowed(drafts)
            return drafts, qs[:len(drafts)], "offer"
        return [], [], None

    def _allowed(self, drafts: list[int]) -> list[int]:
        """A forbidden draft could only be rejected."""
        return drafts if self.guide is None else drafts[:self.guide.allowed(drafts)]

    def picked(self, token: int, done: Pass, features: common_pb2.Features | None = None) -> Picked:
        """The token as the engine hands it over, with its note."""
        drafted, rejected, logprobs, source = self.notes.popleft()
        return Picked(token, done, features, drafted, rejected, logprobs, source == "lookup", source == "offer")
