"""Which draft tokens the target keeps, and the target's own next token.

Names follow Leviathan et al. 2023 (Algorithm 1): p is the target distribution and q
the draft distribution, both after the same sampling processing; x_i are the draft
tokens. The target keeps the longest accepted prefix and adds one token: the
*correction* at the first rejected position, or the *bonus* when all were accepted.
"""

import asyncio
import collections
import contextlib
from types import SimpleNamespace
from typing import AsyncIterator

import torch

from specdec import grammar, sampling
from specdec.features import encode as encode_features
from specdec.lookup import LookupIndex
from specdec.common.v1 import common_pb2
from specdec.engine import PagedSequence, Pass
from specdec.errors import InvalidArgument
from specdec.sampling import Draws
from specdec.verifier.v1 import verifier_pb2
from verifier_service.feature_cache import FeatureCache, Pending, join as join_features


async def verify(seq: PagedSequence, request: verifier_pb2.VerifyRequest, guide: grammar.Guide | None = None,
                 cache: FeatureCache | None = None, session=None
                 ) -> tuple[int, int, Pass, common_pb2.Features | None]:
    """One round on a session: bring the cache to the committed history, run the target
    once over the new tokens and the drafts (in a pass shared with the other sessions
    ready at the same time), and apply the acceptance rule, to the target's distributions
    masked by the session's constraint (`guide`) where it has one. -> (accepted, the
    target's token, the pass, the features asked for: from `cache` where it holds them,
    else from the pass; the session's whole blocks of them join it)."""
    tail = _pending(cache, session, request)
    seq.sync(request.start, list(request.new_tokens))
    n = len(seq.tokens)  # committed length: drafts start here
    drafts = list(request.draft_tokens)
    if guide is not None:
        await _beside_the_loop(guide, constrained, guide, seq.tokens, request.start)
    layers, first = tuple(request.features.layers), request.features.first_position
    rows = features = None
    held, cached = _cached_features(cache, layers, seq.tokens, first)
    seq.extend(drafts)
    if layers:  # the features the cache lacks come from the pass's rows: it computes them
        logits, done, rows = await seq.logits(max(len(drafts) + 1, len(seq.tokens) - held), layers=layers,
                                              logits_last=len(drafts) + 1)
    else:
        logits, done = await seq.logits(len(drafts) + 1)  # [K+1, vocab]
    logits = sampling.penalize(logits, request.sampling, seq.tokens, n)
    accepted, token, logits = await _beside_the_loop(guide, judge, logits, drafts, list(request.draft_probs),
                                                     request.sampling, n, guide, request.logprobs)
    logprobs = [token_logprobs(logits[i], t, request.top_logprobs)
                for i, t in enumerate(drafts[:accepted] + [token])] if request.logprobs else []
    if rows is not None:
        # Positions [first, n + accepted): each one's next token is committed.
        computed_from = len(seq.tokens) - len(rows)
        fresh = encode_features(held, rows[held - computed_from:n + accepted - computed_from])
        if cache is not None:
            cache.store(layers, seq.tokens, fresh, tail)
        features = join_features(first, cached, fresh)
    return accepted, token, done, features, logprobs


async def _beside_the_loop(guide: grammar.Guide | None, call, *args):
    """call(*args), on a thread where a constraint's masks are computed in it (a large
    schema's: about 20 ms each, K + 1 a round), so that the other sessions' calls go on;
    on the event loop otherwise (a thread's hand-off would cost every round). The session
    is held meanwhile: nothing else touches its guide."""
    if guide is None:
        return call(*args)
    return await asyncio.to_thread(call, *args)


SCORE_CHUNK = 256  # positions a Score pass computes logits for: [256, vocab] at a time, not a whole prompt's


async def score(seq: PagedSequence, tokens: list[int], top: int) -> tuple[list[common_pb2.TokenLogprobs], Pass]:
    """The target's log-probabilities of tokens[1:], each after the tokens before it: the
    session reset to them, a prefill in chunks of SCORE_CHUNK positions (each row's
    logits are its own whatever the pass: the same as any other call's there)."""
    logprobs, done = [], None
    for start in range(0, len(tokens), SCORE_CHUNK):
        chunk = tokens[start:start + SCORE_CHUNK]
        seq.sync(start, chunk)
        logits, done = await seq.logits(len(chunk))  # [len(chunk), vocab]: after each of its tokens
        following = tokens[start + 1:start + 1 + len(chunk)]
        logprobs.extend(token_logprobs(logits[i], t, top) for i, t in enumerate(following))
    return logprobs, done


def _pending(cache: FeatureCache | None, session, request) -> Pending | None:
    """The session's features since its last whole block (for `cache`), as far as the
    call's start keeps them."""
    if cache is None or not cache.budget or session is None or not request.features.layers:
        return None
    if session.pending_features is None:
        session.pending_features = Pending()
    session.pending_features.crop(request.start, cache.block_size)
    return session.pending_features


def _cached_features(cache: FeatureCache | None, layers: tuple[int, ...], committed: list[int],
                     first: int) -> tuple[int, bytes]:
    """(the position from which the pass must compute the features asked for, those of
    the positions before it from `cache`). The last committed position is always computed:
    a pass's logits come from it."""
    if cache is None or not layers:
        return first, b""
    return cache.lookup(layers, committed, first, len(committed) - 1)


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> common_pb2.TokenLogprobs:
    """The target's log-probabilities at a position (its logits there, after any
    constraint: a forbidden token is -inf and never among the top ones)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out = common_pb2.TokenLogprobs(token_id=token, logprob=float(logprobs[token]))
    if top:
        values, ids = torch.topk(logprobs, top)
        for value, i in zip(values.tolist(), ids.tolist()):
            if value != float("-inf"):
                out.top_token_ids.append(i)
                out.top_logprobs.append(value)
    return out


async def decode(seq: PagedSequence, request: verifier_pb2.DecodeRequest, max_positions: int,
                 guide: grammar.Guide | None = None, notes: collections.deque | None = None,
                 session=None, cache: FeatureCache | None = None
                 ) -> AsyncIterator[tuple[int, Pass, common_pb2.Features | None]]:
    """The target alone on a session: bring the cache to the committed history, then a
    token per pass (each pass shared with the other sessions ready), each picked as a
    round without drafts would pick it (under the session's constraint, `guide`), until
    max_tokens, a stop token, the model's limit or a grammar that allows nothing more.
    With `draft_forced`, the tokens the grammar forces after a pass's token are drafts of
    the next pass, checked as a round checks drafts: a pass can commit several; with
    `draft_lookup`, where nothing is forced, the prompt-lookup match of the committed
    tokens is (one draft before any of the session's lookup drafts passed, then up to
    twice as many as its last lookup-drafted pass kept: `session.lookup_passed`, carried
    from run to run of a request).
    With each token, the features asked for of the positions its pass computed (the
    first one's: those `cache` held, then those it computed); into
    `notes`, for each token in order: (whether it was a kept draft, the drafts its pass
    rejected where it is the pass's own token, its log-probabilities if asked, whether it
    is the own token of a pass whose drafts came from the lookup)."""
    tail = _pending(cache, session, request)
    seq.sync(request.start, list(request.new_tokens))
    if guide is not None:
        await _beside_the_loop(guide, constrained, guide, seq.tokens, request.start)
    layers, first = tuple(request.features.layers), request.features.first_position
    end = len(seq.tokens) + min(request.max_tokens, max_positions - len(seq.tokens))
    stop, params = set(request.stop_token_ids), request.sampling
    jump = guide is not None and request.draft_forced and not layers
    # The in-run lookup's state lives with the session: a request's next run goes on from it.
    state = session if session is not None else SimpleNamespace(lookup_passed=None, lookup_index=None)
    lookup = None
    if request.HasField("draft_lookup") and not layers:
        rule = request.draft_lookup
        lookup = state.lookup_index
        # Kept where it still describes the committed history: each call then indexes only
        # its new tokens, not the whole prompt again.
        if lookup is None or (lookup.min_n, lookup.max_n) != (rule.min_match, rule.max_match) \
                or seq.tokens[:len(lookup.tokens)] != lookup.tokens:
            lookup = state.lookup_index = LookupIndex(rule.max_match, rule.min_match)
        lookup.update(seq.tokens)
    pending: list[int] = []  # the drafts of the running pass (Engine.decode keeps them in the sequence)
    by_lookup = False  # whether `pending` came from the lookup

    def pick(logits: torch.Tensor) -> tuple[list[int], list[int], bool]:  # on the engine's thread
        nonlocal pending, by_lookup
        position = len(seq.tokens) - len(pending)  # of the pass's first pick
        logits = sampling.penalize(logits, params, seq.tokens, position)
        accepted, token, logits = judge(logits, pending, [], params, position, guide, request.logprobs)
        if by_lookup:
            state.lookup_passed = accepted
        tokens = sampling.until_stop(pending[:accepted] + [token], stop)[:end - position]
        if notes is not None:
            own = len(tokens) - 1 >= accepted  # the last token is the pass's own (not a draft cut short)
            for i, t in enumerate(tokens):
                logprobs = token_logprobs(logits[i], t, request.top_logprobs) if request.logprobs else None
                last = own and i == len(tokens) - 1
                notes.append((i < len(tokens) - 1 or not own, len(pending) - accepted if last else 0, logprobs,
                              last and by_lookup))
        if guide is not None:
            for t in tokens:
                # Picked under this guide's own mask: refused never, but for an end after the
                # grammar stopped (llguidance takes none then), unless its state moved meanwhile.
                if guide.advance(t) or t in stop:
                    continue
                if guide.matcher.is_error():  # a step past the grammar's bounds
                    raise InvalidArgument("constraint", f"failed at position {guide.end}: "
                                                        f"{guide.error.splitlines()[0]}")
                guide.vocab.refused += 1
                raise RuntimeError(f"the constraint refused the target's own pick {t} at position {guide.end}")
        end_of_run = tokens[-1] in stop or position + len(tokens) >= end or (guide is not None and guide.dead)
        drafts, by_lookup = [], False
        if not end_of_run and jump:
            drafts = guide.forced()
        if not end_of_run and not drafts and lookup is not None:
            lookup.update(seq.tokens[:position] + tokens)  # the committed history only grows within a run
            passed = state.lookup_passed  # what the last lookup drafts kept (None: none drafted yet)
            drafts = lookup.match(min(rule.max_drafts, 1 if passed is None else max(1, 2 * passed)))
            if guide is not None:
                drafts = drafts[:guide.allowed(drafts)]  # a forbidden draft could only be rejected
            by_lookup = bool(drafts)
        pending = drafts[:end - position - len(tokens) - 1]
        by_lookup = by_lookup and bool(pending)
        return tokens, pending, not end_of_run

    if not layers:
        async with contextlib.aclosing(seq.decode(pick)) as steps:  # closed with this generator
            async for token, done in steps:
                yield token, done, None
        return
    position, cached = _cached_features(cache, layers, seq.tokens, first)  # of the next pass's first row
    first_pass = True  # it computes the committed positions the cache lacks (a prompt, or its end)
    async with contextlib.aclosing(seq.decode(pick, layers, len(seq.tokens) - position)) as steps:
        async for token, done, rows in steps:
            fresh = encode_features(position, rows)
            position += len(rows)
            if cache is not None:
                cache.store(layers, seq.tokens, fresh, tail)
            if first_pass:
                fresh, first_pass = join_features(first, cached, fresh), False
            yield token, done, fresh


def judge(logits: torch.Tensor, drafts: list[int], draft_probs: list[common_pb2.SparseDistribution],
          params: common_pb2.SamplingParams, start: int, guide: grammar.Guide | None = None,
          logprobs: bool = False) -> tuple[int, int, torch.Tensor]:
    """The acceptance rule over a pass's logits after the committed tokens and each draft
    [K+1, vocab] (drafts from absolute position `start`), masked by the constraint where
    there is one (`guide`, where the committed tokens are): (accepted, the target's token,
    the logits masked, as log-probabilities read them where they are asked for)."""
    if guide is not None and sampling.is_greedy(params) and not logprobs:
        return *accept_greedy(guide.greedy(logits, drafts), drafts), logits
    if guide is not None:
        logits = grammar.apply(logits, guide.masks(drafts))
    if sampling.is_greedy(params):
        return *accept_greedy(sampling.argmax(logits), drafts), logits
    # The rule runs on the host, from one copy of p per round (K+1 rows): its draws come
    # from host generators keyed by position, whatever the model's device.
    p = sampling.probs(logits, params).cpu()
    q = dense_q(draft_probs, drafts, p.shape[-1])
    return *accept_sampled(p, q, drafts, start, Draws(params.seed, "accept"), Draws(params.seed, "target")), logits


def constrained(guide: grammar.Guide, committed: list[int], start: int) -> None:
    """Brings the constraint to a pass after `committed`. `start`: the call's, from which
    the committed tokens may differ from those the guide took (a run's last picks its
    caller never read). INVALID_ARGUMENT where the committed output is not the grammar's,
    or it allows no token."""
    if not guide.sync(committed, since=start):
        refused = guide.end + guide.allowed(committed[guide.end:])
        if refused >= len(committed):  # no token refused: the matcher itself failed (a step over its limits)
            raise InvalidArgument("constraint", f"failed after the committed tokens ({guide.error or 'no reason'})")
        raise InvalidArgument("new_tokens", f"the session's constraint does not allow token {committed[refused]} "
                                            f"at position {refused} (constrained from {guide.start})")
    if guide.dead:
        raise InvalidArgument("constraint", "allows no token after the committed tokens "
                                            f"({guide.error or 'the grammar ends without accepting'})")


def accept_greedy(target_argmax: list[int], drafts: list[int]) -> tuple[int, int]:
    """target_argmax: [K+1] the target's choice after each prefix. Longest match wins."""
    a = 0
    while a < len(drafts) and drafts[a] == target_argmax[a]:
        a += 1
    return a, target_argmax[a]


def dense_q(draft_probs: list[common_pb2.SparseDistribution], drafts: list[int], vocab: int) -> torch.Tensor:
    """q: [K, vocab]. No distributions on the wire means deterministic drafting: one-hot."""
    q = torch.zeros(len(drafts), vocab)
    if not draft_probs:
        q[torch.arange(len(drafts)), torch.tensor(drafts, dtype=torch.long)] = 1.0
        return q
    for i, dist in enumerate(draft_probs):
        q[i, torch.tensor(list(dist.token_ids), dtype=torch.long)] = torch.tensor(list(dist.probs))
    return q / q.sum(dim=-1, keepdim=True)


def accept_sampled(
    p: torch.Tensor,  # [K+1, vocab] target probs after each prefix
    q: torch.Tensor,  # [K, vocab] draft probs the drafts were sampled from
    drafts: list[int],  # [K]
    start: int,  # absolute position of drafts[0]
    accept: Draws,
    target: Draws,
) -> tuple[int, int]:
    for i, x in enumerate(drafts):
        # Accept x with probability min(1, p(x) / q(x)); q(x) <= p(x) always accepts.
        if accept.uniform(start + i) * q[i, x] < p[i, x]:
            continue
        # Rejected: the correction comes from norm(max(0, p - q)).
        residual = (p[i] - q[i]).clamp(min=0)
        return i, target.sample(residual / residual.sum(), start + i)
    # All accepted: the bonus comes from p after the last draft.
    return len(drafts), target.sample(p[-1], start + len(drafts))
