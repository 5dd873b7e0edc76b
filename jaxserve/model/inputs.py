"""What the model reads of one step: `StepBatch`, the flat ragged batch of token rows and
their sequences' block tables, and `next_decode_batch`, the same batch one decode token
later (multi-step decode and draft proposals advance it on device)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.kernels.common import query_sequence
from jaxserve.pytree import pytree_dataclass


@pytree_dataclass(meta=("decode",))
class StepBatch:
    """One flat ragged batch (all int32): T token rows packed by sequence, S sequences.

    tokens, positions, slot_mapping: [T] (padding tokens: position 0, slot in the null
    page). block_tables: [S, P] page ids. seq_lens: [S] context length after this step (0
    for padding sequences). query_start: [S + 1], non-decreasing: sequence b owns token
    rows query_start[b] : query_start[b + 1] (padding sequences own none; rows past
    query_start[S] are padding). logits_indices: [S] the row of each sequence's last token,
    which predicts its next token.
    decode (static): every sequence brings exactly one token and T == S, token row b being
    sequence b's (lets attention use its decode specialisation).
    lora_slot: [T] int32, each token row's LoRA adapter slot (0: none; padding rows 0),
    or None when the engine serves no adapters (jaxserve.lora.batched).
    """

    tokens: Any
    positions: Any
    slot_mapping: Any
    block_tables: Any
    seq_lens: Any
    query_start: Any
    logits_indices: Any
    decode: bool = False
    lora_slot: Any = None


def next_decode_batch(batch: StepBatch, tokens: jax.Array, page_size: int,
                      live: jax.Array | None = None) -> StepBatch:
    """The decode batch one token later (multi-step decode, a drafter's proposal loop):
    each `live` row ([S] bool; default: the real sequences, seq_len > 0) feeds tokens [S]
    int32 at its next position, written to the slot its block table gives for it (those
    pages must be there); the other rows write to the null page (slot 0) and keep their
    position and length."""
    live = batch.seq_lens > 0 if live is None else live
    positions = batch.positions + live
    page = jnp.take_along_axis(batch.block_tables, (positions // page_size)[:, None], axis=1,
                               mode="clip")[:, 0]
    slots = jnp.where(live, page * page_size + positions % page_size, 0)
    return dataclasses.replace(batch, tokens=tokens, positions=positions, slot_mapping=slots,
                               seq_lens=batch.seq_lens + live)


def shift_sequences(batch: StepBatch, shift: jax.Array, page_size: int) -> StepBatch:
    """The batch with every token row of sequence b moved shift[b] positions later (shift:
    [S] int32, >= 0): its positions, their slots (from its block table, whose pages must
    hold them) and its seq_len; padding rows and sequences keep theirs. Speculation with
    async scheduling plans a verify step before the previous one's accepted count is read,
    as if it had kept one token; the step moves each sequence by the rest on device."""
    S = batch.seq_lens.shape[0]
    owner = query_sequence(batch.query_start, batch.tokens.shape[0])   # S past the last
    seq = jnp.clip(owner, 0, S - 1)
    row_shift = jnp.where(owner < S, shift[seq], 0)
    positions = batch.positions + row_shift
    page = batch.block_tables[seq, positions // page_size]
    slots = jnp.where(row_shift > 0, page * page_size + positions % page_size,
                      batch.slot_mapping)
    return dataclasses.replace(batch, positions=positions, slot_mapping=slots,
                               seq_lens=batch.seq_lens + jnp.where(batch.seq_lens > 0, shift, 0))
