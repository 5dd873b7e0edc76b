"""The batch builder: a scheduler's SchedulerOutput -> the padded numpy arrays of one step, of the
bucketed shape the runner compiled (jaxserve.worker.compilation.StepShapes). Plain Python
+ numpy, on the host: the worker sees only arrays.

Every step is a flat ragged batch (jaxserve.model.inputs.StepBatch): T token rows,
each sequence's new tokens (a decode token, or a prompt chunk) packed one after another,
over S sequences with P block-table pages each. A decode plan (one token per sequence) is
a decode batch, T = S, row b being sequence b's. Padding tokens write to the null page;
padding sequences have seq_len 0 and no token rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.engine.scheduler import SchedulerOutput
from jaxserve.engine.sequence import PLACEHOLDER
from jaxserve.model.inputs import StepBatch
from jaxserve.sample.logits_processors import LogitsControls
from jaxserve.sample.sampler import SamplingBatch
from jaxserve.worker.compilation import StepShapes
from jaxserve.worker.input_batch import empty_batch


def _slots(block_table: list[int], start: int, stop: int, page_size: int) -> np.ndarray:
    pos = np.arange(start, stop)
    return np.asarray(block_table, np.int32)[pos // page_size] * page_size + pos % page_size


def step_batch(plan: SchedulerOutput, shapes: StepShapes, prev_rows=None
               ) -> tuple[StepBatch, SamplingBatch, np.ndarray]:
    """The batch of `plan`: sequence i's tokens num_computed .. num_computed + num_new[i]
    (its pages must hold them; for a verify plan, its last token then its drafts), its last
    row's logits sampled (a verify plan: the logits of each of its 1 + len(drafts[i])
    rows, logits_indices [S, 1 + num_speculative_tokens], the last row repeated).

    prev_rows: {sequence: row} of the previous (still running) step; a sequence whose token
    is a PLACEHOLDER reads it from that row on device: the returned prev_index [T] int32
    (Runner.dispatch) gives, per token row, that row (-1: the batch's own token). A verify
    plan's sequence may bring a PLACEHOLDER before its drafts (planned ahead of the
    previous verify step's read: Scheduler.schedule_ahead). Raises ValueError if it is
    not there, or a PLACEHOLDER is not the one token of a sequence's chunk.

    The sampling batch carries the sequences' logits controls (`Sequence.controls`; the
    grammars' bitmasks are left to the engine: `constrained_rows`) and,
    for a sequence still needing prompt logprobs, the prompt token after each of its
    prompt rows (`SamplingBatch.prompt_targets`), only when some sequence has them."""
    seqs, num_new = plan.seqs, plan.num_new
    max_pages = max(len(s.block_table) for s in seqs)
    if plan.verify:
        if not all(plan.samples):
            raise ValueError("a verify step holds decoding sequences only")
        T, S, P = shapes.verify_shape(len(seqs), max_pages)
    else:
        T, S, P = shapes.shape_of(num_new, max_pages, plan.decode)
    J = shapes.verify_rows if plan.verify else 0
    b = empty_batch(T, S, P, decode=plan.decode, verify=J, lora=shapes.lora)
    prev_index = np.full((T,), -1, np.int32)
    page_size = shapes.page_size
    row = 0
    for i, (s, n, drafts) in enumerate(zip(seqs, num_new, plan.drafts)):
        start, stop = s.num_computed, s.num_computed + n
        rows = slice(row, row + n)
        own = s.ids(start, stop - len(drafts))
        if PLACEHOLDER in own:
            if len(own) != 1:
                raise ValueError(f"request {s.request_id!r}: a chunk of {n} tokens includes "
                                 "one still being sampled")
            if not prev_rows or s not in prev_rows:
                raise ValueError(f"request {s.request_id!r}: its last token is pending but "
                                 "was not sampled by the previous step")
            prev_index[row] = prev_rows[s]
            own = [0]
        b.tokens[rows] = own + drafts
        b.positions[rows] = np.arange(start, stop)
        b.slot_mapping[rows] = _slots(s.block_table, start, stop, page_size)
        b.block_tables[i, :len(s.block_table)] = s.block_table
        b.seq_lens[i] = stop
        if b.lora_slot is not None:
            b.lora_slot[rows] = s.lora_slot
        if J:
            b.logits_indices[i] = row + np.minimum(np.arange(J), n - 1)
        else:
            b.logits_indices[i] = row + n - 1
        row += n
        if not plan.decode:
            b.query_start[i + 1:] = row
    sampling = SamplingBatch.from_params([s.params for s in seqs], [s.seed for s in seqs],
                                         [len(s.output_ids) for s in seqs], S)
    controls = _controls(seqs, S)
    targets = None if plan.decode or plan.verify else _prompt_targets(seqs, num_new, T)
    if controls is not None or targets is not None:
        sampling = dataclasses.replace(sampling, controls=controls, prompt_targets=targets)
    return b, sampling, prev_index


def _controls(seqs, S: int) -> LogitsControls | None:
    """The logits-controls table of a step's sequences (row i: seqs[i]'s packed row; a
    structured-output sequence's bitmask row allows every token until the engine fills
    in its grammar's, `constrained_rows`), or None when none uses a control."""
    rows = [(i, s) for i, s in enumerate(seqs) if s.controls is not None]
    if not rows:
        return None
    row = rows[0][1].controls
    c = LogitsControls.neutral(S, len(row.bias_ids), 32 * len(row.allowed))
    names = [f.name for f in dataclasses.fields(row)]
    for i, s in rows:  # (dataclasses.asdict would deep-copy each row's arrays first)
        for name in names:
            getattr(c, name)[i] = getattr(s.controls, name)
    return c


def constrained_rows(plan: SchedulerOutput) -> list[int]:
    """The rows of `plan`'s sampling batch whose sequence samples under a grammar
    (structured output): the engine writes each one's next-token bitmask into
    `controls.allowed[row]` once the tokens before it are read."""
    return [i for i, (s, samples) in enumerate(zip(plan.seqs, plan.samples))
            if samples and s.matcher is not None]


def _prompt_targets(seqs, num_new: list[int], T: int) -> np.ndarray | None:
    """[T] int32: at each prompt row of a sequence whose prompt logprobs are not all
    computed, the prompt token after it (-1 elsewhere); None when no sequence needs any."""
    if not any(s.needs_prompt_logprobs for s in seqs):
        return None
    targets = np.full(T, -1, np.int32)
    row = 0
    for s, n in zip(seqs, num_new):
        if s.needs_prompt_logprobs:
            start = s.num_computed
            stop = min(start + n, len(s.prompt_ids) - 1)  # the last prompt row samples
            if stop > start:
                targets[row:row + stop - start] = s.prompt_ids[start + 1:stop + 1]
        row += n
    return targets
