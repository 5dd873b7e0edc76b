"""StepPlan -> padded numpy arrays of fixed bucketed shapes. Plain Python + numpy.

Every step is a flat ragged batch (jaxserve.model.transformer.StepBatch): T token rows,
the sequences' new tokens packed one after another, over S sequences with P block-table
pages each. Prefill: T from `prefill_lengths` (the prompts' summed length), S from
`prefill_batch_sizes`, P = ceil(T / page_size) rounded up to `page_counts`. Decode:
T = S from `decode_batch_sizes` (one row per sequence), P the longest block table rounded
up to `page_counts`. Padding tokens write to the null page; padding sequences have
seq_len 0 and no token rows.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.buckets import bucket_for, prefill_shape
from jaxserve.engine.page_pool import NULL_PAGE
from jaxserve.model.transformer import StepBatch
from jaxserve.sampling import SamplingBatch


def empty_batch(T: int, S: int, P: int, decode: bool = False) -> StepBatch:
    """An all-padding batch of T token rows and S sequences with P pages each: every token
    writes to the null page, every sequence has seq_len 0 (and, for decode, T == S, row b
    belongs to sequence b; otherwise no sequence owns a row); builders fill in the real
    ones."""
    if decode and T != S:
        raise ValueError(f"a decode batch has one token row per sequence, got T={T}, S={S}")
    return StepBatch(
        prev_index=np.full((T,), -1, np.int32),
        tokens=np.zeros((T,), np.int32),
        positions=np.zeros((T,), np.int32),
        slot_mapping=np.full((T,), NULL_PAGE, np.int32),
        block_tables=np.full((S, P), NULL_PAGE, np.int32),
        seq_lens=np.zeros((S,), np.int32),
        query_start=(np.arange(S + 1, dtype=np.int32) if decode
                     else np.zeros((S + 1,), np.int32)),
        logits_indices=np.zeros((S,), np.int32),
        decode=decode,
    )


def _slots(block_table: list[int], start: int, stop: int, page_size: int) -> np.ndarray:
    pos = np.arange(start, stop)
    return np.asarray(block_table, np.int32)[pos // page_size] * page_size + pos % page_size


def _sampling(seqs, S: int) -> SamplingBatch:
    return SamplingBatch.from_params([s.params for s in seqs], [s.seed for s in seqs],
                                     [len(s.output_ids) for s in seqs], S)


def prefill_batch(seqs, cfg: EngineConfig, prev_rows=None) -> tuple[StepBatch, SamplingBatch]:
    """All tokens of each sequence (prompt, plus earlier outputs after a preemption),
    packed one sequence after another; they must all be known (no PLACEHOLDER: raises
    ValueError). prev_rows is ignored."""
    for s in seqs:
        if s.has_placeholder:
            raise ValueError(f"request {s.request_id!r}: prefill of a sequence whose last "
                             "token is still being sampled")
    T, S, P = prefill_shape([s.num_tokens for s in seqs], cfg)
    b = empty_batch(T, S, P)
    start = 0
    for i, s in enumerate(seqs):
        n = s.num_tokens
        rows = slice(start, start + n)
        b.tokens[rows] = s.all_ids
        b.positions[rows] = np.arange(n)
        b.slot_mapping[rows] = _slots(s.block_table, 0, n, cfg.cache.page_size)
        b.block_tables[i, :len(s.block_table)] = s.block_table
        b.seq_lens[i] = n
        b.logits_indices[i] = start + n - 1
        start += n
        b.query_start[i + 1:] = start
    return b, _sampling(seqs, S)


def decode_batch(seqs, cfg: EngineConfig, prev_rows=None) -> tuple[StepBatch, SamplingBatch]:
    """The last token of each sequence, whose K/V are not yet in the pages.

    prev_rows: {sequence: row} of the previous (still running) step; a sequence whose last
    token is a PLACEHOLDER reads it from that row on device (raises ValueError if it is
    not there)."""
    S = bucket_for(len(seqs), cfg.decode_batch_sizes)
    P = bucket_for(max(len(s.block_table) for s in seqs), cfg.page_counts)
    b = empty_batch(S, S, P, decode=True)
    for i, s in enumerate(seqs):
        n = s.num_tokens
        if s.has_placeholder:
            if not prev_rows or s not in prev_rows:
                raise ValueError(f"request {s.request_id!r}: its last token is pending but "
                                 "was not sampled by the previous step")
            b.prev_index[i] = prev_rows[s]
        else:
            b.tokens[i] = s.last_token
        b.positions[i] = n - 1
        b.slot_mapping[i] = _slots(s.block_table, n - 1, n, cfg.cache.page_size)[0]
        b.block_tables[i, :len(s.block_table)] = s.block_table
        b.seq_lens[i] = n
        b.logits_indices[i] = i
    return b, _sampling(seqs, S)
