"""Speculative decoding's host-side policy and state: when a step may verify drafts, the
drafts of each sequence, when bursts of plain multi-step decode take over, and the counters.
Plain Python; the scheduler asks it while it plans a step, the engine tells it what a
verify step accepted.

Policy (vLLM's `disable_by_batch_size`; the burst rule is ours, PERFORMANCE.md
"Speculative decoding"):
- a step may verify drafts while 1..disable_by_batch_size sequences run, all decoding
  (none part-way through its prompt), and no waiting request could start instead;
- a sequence gets at most num_speculative_tokens drafts, no more than its max_tokens and
  max_model_len leave room for after the token each step adds, and none while it is held
  or constrained by a grammar;
- after SPEC_BURST_AFTER_MISSES speculating steps in a row whose proposer found nothing,
  decode steps may sample decode_steps tokens per dispatch again, until it finds drafts;
- a verify step may run SpeculativeConfig.verify_steps rounds on device (`verify_rounds`)
  when its proposer proposes on device and every sequence has room for all of them;
- with async scheduling, the next verify step may be planned before the current one's
  tokens are read (`can_propose_ahead`, `propose_ahead`) when the proposer proposes on
  device (a draft model, an EAGLE head, n-gram lookup through
  jaxserve.spec_decode.ngram_device) and the last verify step read had drafts: its draft
  rows are planned for the furthest case (every unread draft accepted) and filled in on
  device.
"""

from __future__ import annotations

import dataclasses
import time

from jaxserve.config import SpeculativeConfig
from jaxserve.spec_decode.proposers import make_proposer

# Speculating steps in a row whose proposer found no drafts before decode steps may sample
# multi-step bursts again (PERFORMANCE.md, "Speculative decoding").
SPEC_BURST_AFTER_MISSES = 3


@dataclasses.dataclass
class SpecDecodeStats:
    """Counters since start (vLLM's spec_decode_* names).

    num_drafts: proposals verified (a sequence's drafts in one verify round);
    num_draft_tokens / num_accepted_tokens: draft tokens verified / accepted;
    num_accepted_tokens_per_pos[j]: accepted drafts at position j + 1 of their proposal;
    propose_seconds: host time spent proposing."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)
    propose_seconds: float = 0.0

    def snapshot(self) -> SpecDecodeStats:
        """A copy that later steps do not change."""
        return dataclasses.replace(
            self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verified proposal (1 + accepted / drafts); None before the first."""
        if not self.num_drafts:
            return None
        return round(1 + self.num_accepted_tokens / self.num_drafts, 4)


class SpecDecodeController:
    """The policy above for one SpeculativeConfig. Raises ConfigError (make_proposer) for
    an unknown method."""

    def __init__(self, spec: SpeculativeConfig, max_num_seqs: int, max_model_len: int):
        self.spec = spec
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.proposer = make_proposer(spec)
        self.stats = SpecDecodeStats(
            num_accepted_tokens_per_pos=[0] * spec.num_speculative_tokens)
        self._misses = 0  # speculating steps in a row whose proposer found no drafts

    def active(self, running: list, num_waiting: int) -> bool:
        """Whether the next step may verify drafts (see the module docstring). running:
        the engine's running Sequences."""
        if num_waiting and len(running) < self.max_num_seqs:
            return False
        return (0 < len(running) <= self.spec.disable_by_batch_size
                and all(s.num_tokens - s.num_computed == 1 for s in running))

    def propose(self, running: list, hold) -> dict:
        """{sequence: draft tokens} for each of `running` not in `hold` (see the module
        docstring); counts the step as a miss when none are found."""
        t0 = time.perf_counter()
        drafts = {}
        for seq in running:
            room = self._room(seq)
            if seq in hold or room <= 0 or seq.matcher is not None:
                continue
            context = seq.ids(0, seq.num_tokens) if self.proposer.needs_context else None
            d = self.proposer.propose(context, room)
            if d:
                drafts[seq] = d
        self.stats.propose_seconds += time.perf_counter() - t0
        self._misses = 0 if drafts else self._misses + 1
        return drafts

    def can_propose_ahead(self) -> bool:
        """Whether the next verify step may be planned before the current one is read: the
        proposer proposes on device (`proposes_ahead`), and no step read since the last
        proposal found none (an n-gram proposer that stops finding drafts goes back to
        the host's proposals, and from there to bursts)."""
        return getattr(self.proposer, "proposes_ahead", False) and self._misses == 0

    def propose_ahead(self, seqs: list, unread: dict) -> dict:
        """{sequence: draft rows (0s, filled in on device)} for each of `seqs` while the
        verify step that samples its last token is not read: unread[seq] is that step's
        draft count, and the room left (as `propose`: num_speculative_tokens, max_tokens,
        max_model_len) is counted for the furthest case, all of them accepted."""
        drafts = {}
        for seq in seqs:
            room = self._room(seq, unread[seq])  # more tokens than the one the plan counts
            if room > 0:
                drafts[seq] = [0] * room
        return drafts

    def verify_rounds(self, seqs: list, drafts: list[list[int]], more: dict,
                      num_waiting: int, planned_ahead: bool) -> int:
        """Rounds the verify step of `seqs` (batch order, drafts[i] its draft rows) may run:
        SpeculativeConfig.verify_steps when every draft is proposed on device (a step
        planned ahead, `propose_ahead`, or a drafter's placeholders: the rows of each round
        are then those a step of its own would have had, so the rounds give the tokens of
        as many steps, draws included), no request waits, no sequence samples under a
        grammar and each has room for every round's drafts, the tokens the step in flight
        may keep counted (more[seq]: beyond the one it records; absent = 0); else 1. Pages
        are the scheduler's to check."""
        R = self.spec.verify_steps
        on_device = planned_ahead or not self.proposer.needs_context
        if (R == 1 or num_waiting or not on_device
                or not getattr(self.proposer, "proposes_ahead", False)
                or any(s.matcher is not None for s in seqs)):
            return 1
        for seq, d in zip(seqs, drafts):
            if self._room(seq, more.get(seq, 0) + (R - 1) * (1 + len(d))) < len(d):
                return 1
        return R

    def _room(self, seq, more: int = 0) -> int:
        """Drafts `seq` may take after the token each step adds, were it `more` tokens
        longer: at most num_speculative_tokens, within max_tokens and max_model_len."""
        return min(self.spec.num_speculative_tokens,
                   seq.params.max_tokens - len(seq.output_ids) - more - 1,
                   self.max_model_len - seq.num_tokens - more - 1)

    def record_found(self, found: bool) -> None:
        """Count a verify step read whose proposals (made on device) found drafts for some
        sequence, or none."""
        self._misses = 0 if found else self._misses + 1

    def allows_burst(self) -> bool:
        """Whether a decode step of a speculating batch may sample a multi-step burst: the
        proposer has found nothing SPEC_BURST_AFTER_MISSES steps in a row."""
        return self._misses >= SPEC_BURST_AFTER_MISSES

    def record_verified(self, num_drafts: int, num_accepted: int) -> None:
        """Count one sequence's verified proposal of `num_drafts` tokens, `num_accepted`
        of them accepted (a sequence verified without drafts counts nothing)."""
        if not num_drafts:
            return
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.stats.num_accepted_tokens_per_pos[j] += 1
