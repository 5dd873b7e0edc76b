"""StepPlan -> padded numpy arrays of fixed bucketed shapes. Plain Python + numpy.

Shapes: prefill [B, Q] with B from `prefill_batch_sizes`, Q from `prefill_lengths` and
P = ceil(Q / page_size) rounded up to `page_counts`; decode [B, 1] with B from
`decode_batch_sizes` and P the longest block table rounded up to `page_counts`. Padding
tokens write to the null page and padding rows have seq_len 0.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.buckets import bucket_for
from jaxserve.kv_cache import NULL_PAGE
from jaxserve.model.transformer import StepBatch
from jaxserve.sampling import SamplingBatch


def empty_batch(B: int, Q: int, P: int) -> StepBatch:
    """An all-padding batch of shape (B, Q, P): every token writes to the null page, every
    row has seq_len 0; builders fill in the real rows."""
    return StepBatch(
        prev_index=np.full((B,), -1, np.int32),
        tokens=np.zeros((B, Q), np.int32),
        positions=np.zeros((B, Q), np.int32),
        slot_mapping=np.full((B, Q), NULL_PAGE, np.int32),
        block_tables=np.full((B, P), NULL_PAGE, np.int32),
        seq_lens=np.zeros((B,), np.int32),
        logits_indices=np.zeros((B,), np.int32),
    )


def _slots(block_table: list[int], start: int, stop: int, page_size: int) -> np.ndarray:
    pos = np.arange(start, stop)
    return np.asarray(block_table, np.int32)[pos // page_size] * page_size + pos % page_size


def _sampling(seqs, B: int) -> SamplingBatch:
    return SamplingBatch.from_params([s.params for s in seqs], [s.seed for s in seqs],
                                     [len(s.output_ids) for s in seqs], B)


def prefill_batch(seqs, cfg: EngineConfig, prev_rows=None) -> tuple[StepBatch, SamplingBatch]:
    """All tokens of each sequence (prompt, plus earlier outputs after a preemption), which
    must all be known (no PLACEHOLDER: raises ValueError). prev_rows is ignored."""
    for s in seqs:
        if s.has_placeholder:
            raise ValueError(f"request {s.request_id!r}: prefill of a sequence whose last "
                             "token is still being sampled")
    B = bucket_for(len(seqs), cfg.prefill_batch_sizes)
    Q = bucket_for(max(s.num_tokens for s in seqs), cfg.prefill_lengths)
    P = bucket_for(-(-Q // cfg.page_size), cfg.page_counts)
    b = empty_batch(B, Q, P)
    for i, s in enumerate(seqs):
        n = s.num_tokens
        b.tokens[i, :n] = s.all_ids
        b.positions[i, :n] = np.arange(n)
        b.slot_mapping[i, :n] = _slots(s.block_table, 0, n, cfg.page_size)
        b.block_tables[i, :len(s.block_table)] = s.block_table
        b.seq_lens[i] = n
        b.logits_indices[i] = n - 1
    return b, _sampling(seqs, B)


def decode_batch(seqs, cfg: EngineConfig, prev_rows=None) -> tuple[StepBatch, SamplingBatch]:
    """The last token of each sequence, whose K/V are not yet in the pages.

    prev_rows: {sequence: row} of the previous (still running) step; a sequence whose last
    token is a PLACEHOLDER reads it from that row on device (raises ValueError if it is
    not there)."""
    B = bucket_for(len(seqs), cfg.decode_batch_sizes)
    P = bucket_for(max(len(s.block_table) for s in seqs), cfg.page_counts)
    b = empty_batch(B, 1, P)
    for i, s in enumerate(seqs):
        n = s.num_tokens
        if s.has_placeholder:
            if not prev_rows or s not in prev_rows:
                raise ValueError(f"request {s.request_id!r}: its last token is pending but "
                                 "was not sampled by the previous step")
            b.prev_index[i] = prev_rows[s]
        else:
            b.tokens[i, 0] = s.last_token
        b.positions[i, 0] = n - 1
        b.slot_mapping[i, 0] = _slots(s.block_table, n - 1, n, cfg.page_size)[0]
        b.block_tables[i, :len(s.block_table)] = s.block_table
        b.seq_lens[i] = n
    return b, _sampling(seqs, B)
