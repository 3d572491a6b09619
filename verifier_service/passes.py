"""A session's calls to the target: a round's pass over its drafts (`verify`), a prompt's
log-probabilities (`score`), and what they share with the runs of the target alone
(verifier_service.runs): a constraint brought to the committed tokens, log-probabilities
of a position, the target's features from the cache or the pass."""

import asyncio

import torch

from specdec import grammar, sampling
from specdec.api.common.v1 import common_pb2
from specdec.runtime.engine import PagedSequence, Pass
from specdec.errors import InvalidArgument
from specdec.features import encode as encode_features
from specdec.api.verifier.v1 import verifier_pb2
from verifier_service.acceptance import judge
from verifier_service.feature_cache import FeatureCache, Pending, join as join_features


async def verify(seq: PagedSequence, request: verifier_pb2.VerifyRequest, guide: grammar.Guide | None = None,
                 cache: FeatureCache | None = None, session=None
                 ) -> tuple[int, int, Pass, common_pb2.Features | None, list[common_pb2.TokenLogprobs]]:
    """One round on a session: bring the cache to the committed history, run the target
    once over the new tokens and the drafts (in a pass shared with the other sessions
    ready at the same time), and apply the acceptance rule, to the target's distributions
    masked by the session's constraint (`guide`) where it has one. -> (accepted, the
    target's token, the pass, the features asked for: from `cache` where it holds them,
    else from the pass; the session's whole blocks of them join it; the log-probabilities
    of the committed tokens where asked)."""
    tail = pending_features(cache, session, request)
    seq.sync(request.start, list(request.new_tokens))
    n = len(seq.tokens)  # committed length: drafts start here
    drafts = list(request.draft_tokens)
    if guide is not None:
        await beside_the_loop(guide, constrained, guide, seq.tokens, request.start)
    layers, first = tuple(request.features.layers), request.features.first_position
    rows = features = None
    held, cached = cached_features(cache, layers, seq.tokens, first)
    seq.extend(drafts)
    if layers:  # the features the cache lacks come from the pass's rows: it computes them
        logits, done, rows = await seq.logits(max(len(drafts) + 1, len(seq.tokens) - held), layers=layers,
                                              logits_last=len(drafts) + 1)
    else:
        logits, done = await seq.logits(len(drafts) + 1)  # [K+1, vocab]
    logits = sampling.penalize(logits, request.sampling, seq.tokens, n)
    accepted, token, logits = await beside_the_loop(guide, judge, logits, drafts, list(request.draft_probs),
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


async def beside_the_loop(guide: grammar.Guide | None, call, *args):
    """call(*args), on a thread where a constraint's masks are computed in it (a large
    schema's take tens of milliseconds each, K + 1 a round), so that the other sessions'
    calls go on; on the event loop otherwise (a thread's hand-off would cost every
    round). The session is held meanwhile: nothing else touches its guide."""
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


def pending_features(cache: FeatureCache | None, session, request) -> Pending | None:
    """The session's features since its last whole block (for `cache`), as far as the
    call's start keeps them."""
    if cache is None or not cache.budget or session is None or not request.features.layers:
        return None
    if session.pending_features is None:
        session.pending_features = Pending()
    session.pending_features.crop(request.start, cache.block_size)
    return session.pending_features


def cached_features(cache: FeatureCache | None, layers: tuple[int, ...], committed: list[int],
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
