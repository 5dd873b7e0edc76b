"""A step's arrays: `empty_batch`, the all-padding StepBatch of a bucketed shape that
warm-up compiles and the engine's batch builder (jaxserve.engine.batch_builder) fills.
Plain numpy.

Every step is a flat ragged batch (jaxserve.model.inputs.StepBatch): T token rows,
each sequence's new tokens (a decode token, or a prompt chunk) packed one after another,
over S sequences with P block-table pages each; the shapes come from
jaxserve.worker.compilation.StepShapes. A decode plan (one token per sequence) is a decode
batch, T = S, row b being sequence b's. Padding tokens write to the null page; padding
sequences have seq_len 0 and no token rows.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import NULL_PAGE
from jaxserve.model.inputs import StepBatch


def empty_batch(T: int, S: int, P: int, decode: bool = False, verify: int = 0,
                lora: bool = False) -> StepBatch:
    """An all-padding batch of T token rows and S sequences with P pages each: every token
    writes to the null page, every sequence has seq_len 0 (and, for decode, T == S, row b
    belongs to sequence b; otherwise no sequence owns a row); builders fill in the real
    ones. verify > 0: a verify batch, logits read at `verify` rows per sequence
    (logits_indices [S, verify]). lora: with each row's LoRA slot (lora_slot [T], 0)."""
    if decode and T != S:
        raise ValueError(f"a decode batch has one token row per sequence, got T={T}, S={S}")
    return StepBatch(
        tokens=np.zeros((T,), np.int32),
        positions=np.zeros((T,), np.int32),
        slot_mapping=np.full((T,), NULL_PAGE, np.int32),
        block_tables=np.full((S, P), NULL_PAGE, np.int32),
        seq_lens=np.zeros((S,), np.int32),
        query_start=(np.arange(S + 1, dtype=np.int32) if decode
                     else np.zeros((S + 1,), np.int32)),
        logits_indices=np.zeros((S, verify) if verify else (S,), np.int32),
        decode=decode,
        lora_slot=np.zeros((T,), np.int32) if lora else None,
    )
