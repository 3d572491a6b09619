"""One request's speculation statistics: what its rounds drafted, accepted and cost, and
what its links went through (resyncs, failovers, moves). Each event has one method here;
the Result, the log line and the deployment's metrics read them from this one object."""

from dataclasses import dataclass, field
from typing import Callable

from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb
from specdec.api.verifier.v1 import verifier_pb2


@dataclass
class Stats:
    rounds: int = 0  # a run of the target alone counts a round a token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    rounds_by_k: dict[int, int] = field(default_factory=dict)  # rounds per number of drafts
    draft_s: float = 0.0  # time the rounds waited on the drafter
    verify_s: float = 0.0  # and on the verifier
    pass_rows: int = 0  # rows of the verifier passes that ran the rounds, summed
    resyncs: int = 0
    drafter_resyncs: int = 0  # of resyncs, those of the drafter session
    drafter_failovers: int = 0
    verifier_moves: int = 0  # moves to another verifier replica (each a resync too, once synced)
    lookaheads: int = 0  # rounds drafted ahead, while the previous round was verified
    lookahead_hits: int = 0  # of those, rounds whose guess held and whose drafts were used
    lookup_rounds: int = 0  # rounds drafted by prompt lookup
    lookup_accepted: int = 0  # their accepted drafts
    memory_rounds: int = 0  # of lookup rounds, those drafted from earlier requests' outputs
    memory_accepted: int = 0  # and their accepted drafts
    runs_cut: int = 0  # runs of the target alone stopped early for a lookup round
    probes_beside_runs: int = 0  # drafts checked against a run's tokens, not verified in a round
    lookups_checked: int = 0  # tokens checked against the lookup's next one
    offers: int = 0  # drafter calls whose drafts were offered to runs of the target alone
    offered_passes: int = 0  # a run's passes that checked offered drafts
    offered_kept: int = 0  # and the drafts they kept
    feature_bytes: int = 0  # the target's features the verifier sent (a feature drafter's)
    feature_bytes_sent: int = 0  # and those sent on to drafters (a resync sends a window again)
    # Called after each round with (K asked, drafts verified, accepted, drafter call seconds
    # or None, verifier call seconds): the deployment's metrics.
    on_round: Callable[[int, int, int, float | None, float], None] | None = None

    # -- rounds ------------------------------------------------------------------------

    def round(self, k: int, drafts: int, accepted: int, draft_s: float, verify_s: float,
              batch_pass: verifier_pb2.BatchPass | None, lookup: bool = False, from_memory: bool = False) -> None:
        """A round of `drafts` drafts (k asked for) of which `accepted` were; `draft_s`: the
        time it waited for them, `verify_s` for the verifier."""
        self.rounds += 1
        self.rounds_by_k[drafts] = self.rounds_by_k.get(drafts, 0) + 1
        self.drafted(drafts, accepted)
        if len(self.accepted_per_position) < drafts:
            self.accepted_per_position.extend([0] * (drafts - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        self.draft_s += draft_s
        self.verify_s += verify_s
        if batch_pass is not None:
            self.pass_rows += batch_pass.rows
        self.lookup_rounds += lookup
        self.lookup_accepted += accepted if lookup else 0
        self.memory_rounds += from_memory
        self.memory_accepted += accepted if from_memory else 0
        if self.on_round is not None:
            self.on_round(k, drafts, accepted, draft_s if drafts else None, verify_s)

    def step(self, verify_s: float, batch_pass: verifier_pb2.BatchPass | None) -> None:
        """A token of a run of the target alone: a round without drafts."""
        self.round(0, 0, 0, 0.0, verify_s, batch_pass)

    def drafted(self, drafts: int, accepted: int) -> None:
        """Drafts judged by the target: a round's, or those the verifier made within a run."""
        self.draft_tokens += drafts
        self.accepted_tokens += accepted

    def waited_ahead(self, seconds: float) -> None:
        """A round waited this long for the drafts made ahead of the next one."""
        self.draft_s += seconds

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    # -- links ---------------------------------------------------------------------------

    def resynced(self, drafter: bool = False) -> None:
        self.resyncs += 1
        self.drafter_resyncs += drafter

    def failed_over(self) -> None:
        self.drafter_failovers += 1

    def moved(self, resync: bool) -> None:
        """Moved to another verifier replica; a resync unless nothing was synced yet."""
        self.verifier_moves += 1
        self.resyncs += resync

    def features_received(self, nbytes: int) -> None:
        self.feature_bytes += nbytes

    def features_sent(self, nbytes: int) -> None:
        self.feature_bytes_sent += nbytes

    # -- reports ------------------------------------------------------------------------

    def message(self) -> pb.SpeculationStats:
        return pb.SpeculationStats(
            rounds=self.rounds, draft_tokens=self.draft_tokens, accepted_tokens=self.accepted_tokens,
            acceptance_rate=self.acceptance, resyncs=self.resyncs, drafter_failovers=self.drafter_failovers,
            accepted_per_position=self.accepted_per_position, lookaheads=self.lookaheads,
            lookahead_hits=self.lookahead_hits, draft_seconds=self.draft_s, verify_seconds=self.verify_s,
            mean_batch_rows=self.pass_rows / self.rounds if self.rounds else 0.0,
            verifier_moves=self.verifier_moves, feature_bytes_received=self.feature_bytes,
            feature_bytes_sent=self.feature_bytes_sent, run_offers=self.offers,
            offered_accepted=self.offered_kept)

    def describe(self) -> str:
        return (f"{self.rounds} rounds (by drafts: {dict(sorted(self.rounds_by_k.items()))}; {self.lookup_rounds} "
                f"drafted by lookup, {self.runs_cut} runs of the target alone cut for one, {self.probes_beside_runs} "
                f"probes beside runs, {self.lookups_checked} lookup tokens checked, {self.offers} offers to runs: "
                f"{self.offered_kept} drafts kept in {self.offered_passes} passes), acceptance "
                f"{self.acceptance:.2f}, {self.resyncs} resyncs, {self.drafter_failovers} drafter failovers, "
                f"{self.verifier_moves} verifier moves")
